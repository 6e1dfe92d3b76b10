"""The benchmark models, built the same way in PyTorch and Keras 3, with synthetic data.

* ``cnn``: the reference small CNN (3 conv layers, 2 dense; 0.6 M parameters, 10 tensors).
* ``mlp``: 32 dense layers of width 128 (64 small tensors, 0.5 M parameters): stresses fusion.
* ``resnet18``: ResNet-18 (BasicBlock [2, 2, 2, 2], ImageNet stem) on 32x32 inputs, 10 classes
  (11.2 M parameters, 45 MB of float32 gradients).

Frameworks are imported inside the builders only.
"""

from __future__ import annotations

from typing import Any, Tuple

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


def torch_model(name: str) -> Any:
    """The torch ``nn.Module`` named ``name``."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, CLASSES),
        )
    if name == "mlp":
        layers: list = []
        for _ in range(MLP_LAYERS - 1):
            layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(MLP_WIDTH, CLASSES))
    if name == "resnet18":
        return _torch_resnet18()
    raise ValueError(f"Unknown model {name!r}. Expected one of: {', '.join(MODELS)}.")


def _torch_block(cin: int, cout: int, stride: int) -> Any:
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x: Any) -> Any:
            out = self.bn1(self.conv1(x)).relu()
            return (self.bn2(self.conv2(out)) + self.down(x)).relu()

    return Block()


def _torch_resnet18() -> Any:
    from torch import nn

    layers: list = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_torch_block(cin, cout, stride), _torch_block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, CLASSES)]
    return nn.Sequential(*layers)


def keras_model(name: str) -> Any:
    """The Keras 3 model named ``name`` (channels-last inputs)."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(0)
    if name == "cnn":
        return keras.Sequential([
            keras.Input((32, 32, 3)),
            layers.Conv2D(32, 3, padding="same", activation="relu"),
            layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),
            layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),
            layers.Flatten(), layers.Dense(128, activation="relu"), layers.Dense(CLASSES),
        ])
    if name == "mlp":
        stack = [keras.Input((MLP_WIDTH,))]
        stack += [layers.Dense(MLP_WIDTH, activation="relu") for _ in range(MLP_LAYERS - 1)]
        return keras.Sequential([*stack, layers.Dense(CLASSES)])
    if name == "resnet18":
        inputs = keras.Input((32, 32, 3))
        x = layers.Conv2D(64, 7, 2, padding="same", use_bias=False)(inputs)
        x = layers.MaxPooling2D(3, 2, padding="same")(layers.ReLU()(layers.BatchNormalization()(x)))
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            for block_stride in (stride, 1):
                out = layers.Conv2D(cout, 3, block_stride, padding="same", use_bias=False)(x)
                out = layers.ReLU()(layers.BatchNormalization()(out))
                out = layers.BatchNormalization()(layers.Conv2D(cout, 3, 1, padding="same", use_bias=False)(out))
                short = x
                if block_stride != 1 or cin != cout:
                    short = layers.BatchNormalization()(layers.Conv2D(cout, 1, block_stride, use_bias=False)(x))
                x = layers.ReLU()(layers.Add()([out, short]))
                cin = cout
        x = layers.Dense(CLASSES)(layers.GlobalAveragePooling2D()(x))
        return keras.Model(inputs, x)
    raise ValueError(f"Unknown model {name!r}. Expected one of: {', '.join(MODELS)}.")
