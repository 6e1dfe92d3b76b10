"""Replicas that part between two drift checks are still caught: before hvdp.save_checkpoint writes, and
at the job's end (either framework: a torch loop, or a tf.GradientTape loop with a Keras optimizer).

Rank 1 nudges one weight after step 3 of 30 (the guard checks after step 1 and every 100 steps):
``save_checkpoint`` refuses on every rank (the job goes on: the replicas are made equal again), then
the same nudge is left in place, and the job must end non-zero at its end, naming the difference.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import numpy as np

import hvdp

hvdp.init()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report

RANK, STEPS = hvdp.rank(), 30


def torch_job() -> tuple:
    import torch

    torch.manual_seed(RANK)
    model = torch.nn.Linear(8, 2)
    optimizer = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), 0.1), model)
    hvdp.broadcast_state(model, optimizer)

    def step(k: int) -> None:
        optimizer.zero_grad()
        model(torch.from_numpy(np.random.default_rng([RANK, k]).normal(size=(4, 8)).astype(np.float32))).sum()\
            .backward()
        optimizer.step()

    def nudge() -> None:
        with torch.no_grad():
            model.weight[0, 0] += 1e-3

    return model, optimizer, step, nudge


def tensorflow_job() -> tuple:
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(RANK)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1))
    optimizer.build(model.trainable_variables)
    hvdp.broadcast_state(model, optimizer)

    def step(k: int) -> None:
        x = np.random.default_rng([RANK, k]).normal(size=(4, 8)).astype(np.float32)
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x))
        gradients = hvdp.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))

    def nudge() -> None:
        kernel = model.trainable_variables[0]
        kernel.assign(kernel.numpy() + np.eye(8, 2, dtype=np.float32) * 1e-3)

    return model, optimizer, step, nudge


def run(step: Callable[[int], None], nudge: Callable[[], None]) -> None:
    for k in range(STEPS):
        step(k)
        if k == 3 and RANK == 1:
            nudge()


def main() -> None:
    model, optimizer, step, nudge = (torch_job if hvdp.framework() == "torch" else tensorflow_job)()
    run(step, nudge)
    path = os.path.join(os.environ["HVDP_TEST_OUT"], "checkpoint.npz")
    refused: Any = _report.refusal(lambda: hvdp.save_checkpoint(path, model, optimizer, step=STEPS))
    hvdp.broadcast_state(model, optimizer)  # equal again: the job goes on
    saved = _report.refusal(lambda: hvdp.save_checkpoint(path, model, optimizer, step=STEPS))
    run(step, nudge)  # apart again, and left so: the job's end must say so
    _report.write(RANK, {"rank": RANK, "refused": refused, "saved": saved, "written": os.path.exists(path)})


main()
