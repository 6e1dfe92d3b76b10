"""hvdp for Keras 3 scripts, on either Keras backend: the callbacks, and whether an optimizer averages.

``import hvdp.keras`` imports neither Keras nor a framework; the callbacks import Keras on first
use. How hvdp wraps Keras optimizers and broadcasts Keras state is the backends' Keras adapter,
:mod:`hvdp.backends.keras`.
"""

from __future__ import annotations

from typing import Any

from hvdp._keras_jobs import is_distributed as is_distributed  # whether an optimizer averages

_CALLBACKS = ("BroadcastInitialState", "MetricAverage", "LearningRateWarmup", "LearningRateSchedule",
              "ModelCheckpoint")
_LAYERS = ("SyncBatchNormalization",)


def __getattr__(name: str) -> Any:
    """The Keras callbacks and layers, imported on first use so that importing hvdp never imports Keras."""
    if name in _CALLBACKS:
        from hvdp import _keras_callbacks

        return getattr(_keras_callbacks, name)
    if name in _LAYERS:
        from hvdp import _keras_layers

        return getattr(_keras_layers, name)
    raise AttributeError(f"module 'hvdp.keras' has no attribute {name!r}")
