"""A TensorFlow loop on the direct gradient path (a traced DistributedGradientTape) in which rank 1 stops taking
part at step 5 (argv[1]: stall); it writes the moment to $HVDP_TEST_OUT/fault_time, as faults.py does."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import hvdp

hvdp.init()

import tensorflow as tf

FAULT_STEP = 5


def main() -> None:
    assert sys.argv[1] == "stall", sys.argv
    rank = hvdp.rank()
    weights = tf.Variable(np.ones((8, 2), dtype=np.float32))

    @tf.function
    def step(x: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(x @ weights)
        grads = hvdp.DistributedGradientTape(tape).gradient(loss, [weights])
        weights.assign_sub(0.1 * grads[0])

    for s in range(1000):
        if rank == 1 and s == FAULT_STEP:
            with open(os.path.join(os.environ["HVDP_TEST_OUT"], "fault_time"), "w") as out:
                out.write(str(time.time()))
            time.sleep(3600)
        step(tf.random.normal((4, 8)))
        time.sleep(0.01)
    hvdp.shutdown()


if __name__ == "__main__":
    main()
