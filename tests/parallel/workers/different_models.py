"""Keras: rank 1 builds its model with one layer more than rank 0's, then both call fit.

Each rank's optimizer reduces its own list of gradients (2 on rank 0, 4 on rank 1). On the direct path the
layout exchange refuses it on every rank at the first step; on Horovod's path each rank waits for a list the
other never sends until the stall timeout. Either way the job must end saying the models differ.
"""

from __future__ import annotations

import numpy as np

import hvdp

hvdp.init()

import keras


def main() -> None:
    layers = [keras.Input(shape=(8,)), keras.layers.Dense(4)]
    if hvdp.rank() == 1:
        layers.append(keras.layers.Dense(4))
    model = keras.Sequential(layers)
    model.compile(optimizer=hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.fit(np.zeros((8, 8), np.float32), np.zeros((8, 4), np.float32), batch_size=4, verbose=0)


if __name__ == "__main__":
    main()
