"""The benchmark models of :mod:`hvdp.bench.models` in Keras 3 (imported by the bench's TensorFlow processes only)."""

from __future__ import annotations

from typing import Any

import keras
from keras import layers

from hvdp.bench.models import CLASSES, MLP_LAYERS, MLP_WIDTH, MODELS


def model(name: str) -> Any:
    """The Keras 3 model named ``name`` (one of :data:`hvdp.bench.models.MODELS`; channels-last inputs)."""
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
