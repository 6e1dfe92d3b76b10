"""``hvdp.keras.SyncBatchNormalization``: Keras 3 batch normalization over every rank's batch, on either Keras
backend (imported lazily by :mod:`hvdp.keras`)."""

from __future__ import annotations

import itertools
from typing import Any, Optional, Tuple

import keras
from keras import ops

from hvdp import _runtime
from hvdp import process_sets as _process_sets
from hvdp.backends.keras import sum_across_ranks
from hvdp.process_sets import ProcessSet

#: Numbers the layers in the order they are made, the same on every rank (Keras's layer names follow
#: counters that a model built on one rank only would shift): the collectives' names.
_NUMBERS = itertools.count()


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose batch mean and variance are those of the global batch:
    every rank's examples (of ``process_set``, when given), as one process would compute them on the
    union of the batches; the moving statistics follow them, so they are equal on every rank. Horovod's
    ``SyncBatchNormalization`` (TensorFlow only there); here on both Keras backends. A mask weighs the
    examples as BatchNormalization's does. Takes BatchNormalization's arguments (``synchronized``
    excepted: it is this layer's whole point). A forward in training mode is a collective: every rank
    runs it.

    Example:
        >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
        ...                           hvdp.keras.SyncBatchNormalization(), keras.layers.Dense(4)])  # doctest: +SKIP
    """

    def __init__(self, *args: Any, process_set: Optional[ProcessSet] = None, **kwargs: Any) -> None:
        if kwargs.pop("synchronized", False):
            raise ValueError("hvdp.keras.SyncBatchNormalization synchronizes through Horovod already; drop "
                             "synchronized=True (it is keras.layers.BatchNormalization's, for tf.distribute).")
        super().__init__(*args, **kwargs)
        _runtime.current("keras.SyncBatchNormalization")
        self._hvdp_set = _process_sets.handle(process_set, "keras.SyncBatchNormalization")
        self._hvdp_label = f"hvdp.sync_batch_norm.{next(_NUMBERS)}"

    def _moments(self, inputs: Any, mask: Any) -> Tuple[Any, Any]:
        weights = ops.ones_like(inputs) if mask is None else ops.cast(
            ops.broadcast_to(ops.expand_dims(mask, axis=-1), ops.shape(inputs)), inputs.dtype)
        axes = self._reduction_axes
        # One request for the sums and the counts, one for the squared deviations from the global mean.
        both = ops.stack([ops.sum(inputs * weights, axes, keepdims=True), ops.sum(weights, axes, keepdims=True)])
        both = sum_across_ranks(both, f"{self._hvdp_label}.sums", self._hvdp_set)
        count = both[1]
        mean = both[0] / ops.maximum(count, 1.0)
        deviations = ops.sum(ops.square(inputs - mean) * weights, axes, keepdims=True)
        variance = sum_across_ranks(deviations, f"{self._hvdp_label}.deviations", self._hvdp_set) / \
            ops.maximum(count, 1.0)
        return ops.squeeze(mean, axes), ops.squeeze(variance, axes)
