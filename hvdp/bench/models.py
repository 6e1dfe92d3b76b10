"""The benchmark models, built the same way in PyTorch and Keras 3, with synthetic data.

* ``cnn``: the reference small CNN (3 conv layers, 2 dense; 0.6 M parameters, 10 tensors).
* ``mlp``: 32 dense layers of width 128 (64 small tensors, 0.5 M parameters): stresses fusion.
* ``resnet18``: ResNet-18 (BasicBlock [2, 2, 2, 2], ImageNet stem) on 32x32 inputs, 10 classes
  (11.2 M parameters, 45 MB of float32 gradients).

Each framework builds them in its own module (``hvdp/bench/<framework>_bench.py``, named in
:mod:`hvdp.bench.per_framework`), so nothing here imports a framework.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np

MODELS = ("cnn", "mlp", "resnet18")
#: Input shape of one example (channels first; Keras models take it channels last).
INPUT_SHAPES = {"cnn": (3, 32, 32), "mlp": (128,), "resnet18": (3, 32, 32)}
CLASSES = 10
MLP_LAYERS = 32
MLP_WIDTH = 128


def synthetic_batches(model: str, batch: int, count: int, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """``count`` batches of inputs and labels, identical for a given seed in every contender.

    Example:
        >>> x, y = synthetic_batches("mlp", 4, 2, seed=0)
        >>> x.shape, y.shape
        ((2, 4, 128), (2, 4))
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((count, batch, *INPUT_SHAPES[model]), dtype=np.float32)
    y = rng.integers(0, CLASSES, size=(count, batch)).astype(np.int64)
    return x, y

