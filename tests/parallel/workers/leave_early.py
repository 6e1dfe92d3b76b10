"""Rank 1 leaves training while rank 0 still trains (hvdp run names it within seconds, never the stall timeout).

Modes: ``tape`` (a tf.GradientTape loop on TensorFlow's direct gradient path; rank 1 breaks out after 3 of 10
steps and finishes its script) and ``fit`` (rank 1 never calls model.fit; either Keras backend). Each rank writes
the time its script ended (``left``), so the test measures from there.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import hvdp

hvdp.init()
import keras

MODE, RANK = sys.argv[1], hvdp.rank()
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
if MODE == "tape":
    import tensorflow as tf

    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    hvdp.broadcast_state(model, optimizer)
    for step in range(10):
        if RANK == 1 and step == 3:
            break
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(tf.ones((4, 8))))
        gradients = hvdp.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        time.sleep(0.5 if RANK == 0 and step >= 2 else 0)  # rank 0 is still training when rank 1 leaves
else:
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=optimizer, loss="mse")
    hvdp.broadcast_state(model, optimizer)
    if RANK == 0:
        time.sleep(1)
        model.fit(np.ones((64, 8)), np.ones((64, 2)), batch_size=8, epochs=3, verbose=0)
with open(os.path.join(os.environ["HVDP_TEST_OUT"], f"left{RANK}"), "w") as out:
    out.write(str(time.time()))
