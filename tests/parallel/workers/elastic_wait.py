"""An elastic job that loses a worker and is left with fewer than --min-np, for hvdp run's messages.

argv: MODEL (torch | keras) HOST LOCAL_RANK [STOP]. The model trains under hvdp.elastic.run,
committing every 5 steps. At step 20 the worker on HOST with that local rank (its first
incarnation; $HVDP_TEST_OUT/failed marks it) writes the time and raises RuntimeError, so
Horovod blacklists HOST. Every worker reports once it has trained a step; with STOP, the job
ends at step STOP and every worker reports again: the sizes it trained at.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import hvdp

hvdp.init()

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _report
from _parts import keras_parts, torch_parts

MODEL, HOST, LOCAL_RANK = sys.argv[1], sys.argv[2], int(sys.argv[3])
STOP = int(sys.argv[4]) if len(sys.argv) > 4 else None
FAILED = os.path.join(os.environ["HVDP_TEST_OUT"], "failed")


def main() -> None:
    model, optimizer, step, _ = {"torch": torch_parts, "keras": keras_parts}[MODEL](0)
    state = hvdp.elastic.State(model, optimizer, step=0)
    data = np.random.default_rng(hvdp.rank())
    x, y = data.normal(size=(16, 8)).astype(np.float32), data.integers(0, 3, size=16)

    sizes: list = []

    @hvdp.elastic.run
    def train(state: hvdp.elastic.State) -> None:
        while STOP is None or state.step < STOP:
            if not sizes or sizes[-1][0] != hvdp.size():
                sizes.append([hvdp.size(), time.time()])
            if state.step == 20 and os.environ["HOROVOD_HOSTNAME"] == HOST and \
                    hvdp.local_rank() == LOCAL_RANK and not os.path.exists(FAILED):
                with open(FAILED, "w") as out:
                    out.write(f"{time.time()} {hvdp.rank()}")
                raise RuntimeError(f"injected failure on {HOST}")
            step(x, y)
            state.step += 1
            if state.step == 1:
                _report.write(hvdp.rank(), {"rank": hvdp.rank(), "size": hvdp.size(), "pid": os.getpid()})
            if state.step % 5 == 0:
                state.commit()
            time.sleep(0.02)

    train(state)
    _report.write(hvdp.rank(), {"rank": hvdp.rank(), "size": hvdp.size(), "pid": os.getpid(), "sizes": sizes,
                                "step": state.step})


if __name__ == "__main__":
    main()
