"""Checkpoint and resume, on the framework hvdp run chose (argv[1]: full | crash | resume | errors).

full: 10 steps, checkpoints at steps 5 and 10. crash: the same, but rank 1 raises at step 7.
resume: load the step-5 checkpoint and train to step 10. The data of every step is fixed by
(step, rank), so resume must end exactly where full ends. errors: bad checkpoints, on every rank.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import hvdp

hvdp.init()

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _report
from _parts import keras_parts, torch_parts
from _report import digest

STEPS, SAVE_EVERY, CRASH_AT, BATCH = 10, 5, 7, 16


def batch(step: int, rank: int) -> tuple:
    data = np.random.default_rng(1000 * step + rank)
    return data.normal(size=(BATCH, 8)).astype(np.float32), data.integers(0, 3, size=BATCH)


#: The seed differs per rank, so the replicas differ until a broadcast or a load.
PARTS = {"torch": torch_parts, "tensorflow": keras_parts}


def main() -> None:
    mode, folder = sys.argv[1], os.environ["HVDP_TEST_OUT"]
    rank = hvdp.rank()
    model, optimizer, step, flat = PARTS[hvdp.framework()](hvdp.rank())
    record: dict = {"rank": rank, "mode": mode}
    first = 0
    if mode == "resume":
        extras = hvdp.load_checkpoint(os.path.join(folder, "step5.npz"), model, optimizer)
        first = extras["step"]
        record["extras"] = extras
    elif mode == "errors":
        record["errors"] = bad_checkpoints(folder, model, optimizer)
        _report.write(rank, record)
        return
    else:
        hvdp.broadcast_state(model, optimizer)
    for number in range(first, STEPS):
        if mode == "crash" and number == CRASH_AT and rank == 1:
            raise RuntimeError("injected crash at step 7")
        step(*batch(number, rank))
        if (number + 1) % SAVE_EVERY == 0:
            hvdp.save_checkpoint(os.path.join(folder, f"step{number + 1}.npz"), model, optimizer,
                                 step=number + 1, note="digits")
    record["final"] = digest(flat())
    _report.write(rank, record)
    hvdp.shutdown()


def bad_checkpoints(folder: str, model: object, optimizer: object) -> dict:
    """Each bad checkpoint must raise CheckpointError on every rank, naming the file."""
    good = os.path.join(folder, "good.npz")
    hvdp.broadcast_state(model, optimizer)
    hvdp.save_checkpoint(good, model, optimizer, step=1)
    if hvdp.rank() == 0:
        data = open(good, "rb").read()
        open(os.path.join(folder, "truncated.npz"), "wb").write(data[: len(data) // 3])
    hvdp.barrier()
    other = PARTS[hvdp.framework()](hvdp.rank(), width=32)
    cases = {"missing": (os.path.join(folder, "nope.npz"), model, optimizer),
             "truncated": (os.path.join(folder, "truncated.npz"), model, optimizer),
             "architecture": (good, other[0], other[1])}
    if os.path.exists(os.path.join(folder, "other_framework.npz")):
        cases["other_framework"] = (os.path.join(folder, "other_framework.npz"), model, optimizer)
    errors = {}
    for case, (path, target, target_optimizer) in cases.items():
        try:
            hvdp.load_checkpoint(path, target, target_optimizer)
            errors[case] = None
        except hvdp.CheckpointError as exc:
            errors[case] = str(exc)
    errors["job_still_works"] = hvdp.allreduce(1.0, op="sum")
    return errors


if __name__ == "__main__":
    main()
