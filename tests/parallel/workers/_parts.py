"""A small classifier (8 inputs, 3 classes) with hvdp's Adam, as torch or Keras 3 parts:
(model, optimizer, step(x, y), flat() -> all parameters as one array)."""

from __future__ import annotations

import numpy as np

import hvdp


def torch_parts(seed: int, width: int = 16, shard: bool = False) -> tuple:
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 3))
    optimizer = hvdp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model,
                                          shard_optimizer_state=shard)

    def step(x: np.ndarray, y: np.ndarray) -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        optimizer.step()

    def flat() -> np.ndarray:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()

    return model, optimizer, step, flat


def keras_parts(seed: int, width: int = 16, shard: bool = False) -> tuple:
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input(shape=(8,)), keras.layers.Dense(width, activation="tanh"),
                              keras.layers.Dense(3)])
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.Adam(0.01), shard_optimizer_state=shard)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def step(x: np.ndarray, y: np.ndarray) -> None:
        model.train_on_batch(x, y)

    def flat() -> np.ndarray:
        return np.concatenate([np.asarray(v).reshape(-1) for v in model.trainable_variables])

    return model, optimizer, step, flat
