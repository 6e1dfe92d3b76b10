"""TensorFlow's direct gradient path (hvdp.backends.tensorflow.direct) against Horovod's, in one job (np=2).

Each case trains the same variables (float32 and float64, so two dtypes in one update) on per-rank data with
hvdp.DistributedGradientTape, once per path (HVDP_GRADIENT_PATH), and reports the parameters, their digest and
the direct groups' counts; then a collective on Horovod's path right after the direct steps.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List

import numpy as np

import hvdp

hvdp.init()

import tensorflow as tf

from hvdp.backends import direct

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _report
from _report import digest

STEPS, SWITCH = 6, 3
CASES = {
    # case: (traced, op, the sources change at SWITCH on every rank, a float16 variable among the sources)
    "traced, average": (True, "average", False, False),
    "eager, sum": (False, "sum", False, False),
    "traced, sources change": (True, "average", True, False),
    "traced, float16": (True, "average", False, True),
}


def make_variables(half: bool) -> List[tf.Variable]:
    rng = np.random.default_rng(7)
    made = [tf.Variable(rng.normal(size=(16, 32)).astype(np.float32) * 0.3),
            tf.Variable(np.zeros(32, dtype=np.float32)),
            tf.Variable(rng.normal(size=(32, 4)) * 0.3)]  # float64
    if half:
        made.append(tf.Variable(np.ones(4, dtype=np.float16)))
    return made


def batch(rank: int, step: int) -> tuple:
    rng = np.random.default_rng(1000 + 10 * rank + step)
    return rng.normal(size=(16, 16)).astype(np.float32), rng.normal(size=(16, 4))


def train(path: str, case: str, rank: int) -> Dict[str, Any]:
    traced, op, change, half = CASES[case]
    os.environ[direct.PATH_ENV] = path
    variables = make_variables(half)
    tapes: List[Any] = []  # every DistributedGradientTape made (once per trace, or once per eager step)

    def step(x: Any, y: Any, head: bool) -> None:
        sources = variables if head else variables[:2]
        with tf.GradientTape() as tape:
            hidden = tf.tanh(x @ variables[0] + variables[1])
            out = tf.cast(hidden, tf.float64) @ variables[2]
            if half:
                out = out * tf.cast(variables[3], tf.float64)
            loss = tf.reduce_mean((out - y) ** 2)
        distributed = hvdp.DistributedGradientTape(tape, op=op)
        tapes.append(distributed)
        for variable, grad in zip(sources, distributed.gradient(loss, sources)):
            variable.assign_sub(tf.cast(0.1 * tf.cast(grad, tf.float64), variable.dtype))

    run = tf.function(step) if traced else step
    for s in range(STEPS):
        x, y = batch(rank, s)
        run(tf.constant(x), tf.constant(y), not (change and s >= SWITCH))
    groups = [t._reduce.hvdp_direct_group for t in tapes]
    counts = None
    if any(g is not None for g in groups):
        counts = {key: sum(g.counts[key] for g in groups) for key in ("direct", "horovod", "differed")}
    flat = np.concatenate([v.numpy().astype(np.float64).reshape(-1) for v in variables])
    return {"params": flat.tolist(), "digest": digest(flat), "counts": counts, "quiet": direct.is_quiet(),
            "tapes": len(tapes)}


def main() -> None:
    rank = hvdp.rank()
    cases = {case: {path: train(path, case, rank) for path in ("horovod", "direct")} for case in CASES}
    os.environ[direct.PATH_ENV] = "direct"
    # A collective on Horovod's path after the direct steps: the quiet loop, woken by the submitted tensor.
    big = hvdp.allreduce(np.full(1 << 20, rank + 1.0, dtype=np.float32), op="sum")
    _report.write(rank, {"rank": rank, "cases": cases, "big": [float(big.min()), float(big.max())]})


if __name__ == "__main__":
    main()
