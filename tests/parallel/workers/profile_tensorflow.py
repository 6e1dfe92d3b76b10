"""A Keras 3 custom loop on TensorFlow under hvdp.profiler, with an injected straggler (argv[1]):
input_skew (rank 1 sleeps in its data phase), compute_skew (rank 1 computes more), or balanced."""

from __future__ import annotations

import sys
import time

import keras
import numpy as np
import tensorflow as tf

import hvdp

DELAY, STEPS, BATCH = 0.15, 12, 32
#: balanced: every rank's same extra compute, so that a step (about 40 ms) dwarfs the scheduling noise of
#: a loaded 2-core machine (a 2 ms median difference once named rank 0 in an 8 ms step).
BALANCED_WORK = 0.03


def busy(seconds: float) -> None:
    """Real extra compute (matrix products) for about ``seconds``."""
    a = tf.random.normal((256, 256))
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = tf.tanh(a @ a)


def main() -> None:
    mode = sys.argv[1]
    hvdp.init()
    rank = hvdp.rank()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(10)])
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.SGD(0.01))
    hvdp.broadcast_state(model, optimizer)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def gradients(x: tf.Tensor, y: tf.Tensor) -> list:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    @tf.function
    def apply(grads: list) -> None:
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    data = np.random.default_rng(rank)
    for _ in range(STEPS):
        with hvdp.profiler.phase("data"):
            x = data.normal(size=(BATCH, 64)).astype(np.float32)
            y = data.integers(0, 10, size=BATCH)
            if mode == "input_skew" and rank == 1:
                time.sleep(DELAY)
        with hvdp.profiler.phase("compute"):
            grads = gradients(x, y)
            if mode == "compute_skew" and rank == 1:
                busy(DELAY)
            if mode == "balanced":
                busy(BALANCED_WORK)
        apply(grads)
        hvdp.profiler.step(examples=BATCH)
    hvdp.shutdown()


if __name__ == "__main__":
    main()
