"""hvdp.elastic.State and run() under a plain (not elastic) 2-process job, on the framework hvdp run chose.

- sync: the ranks start with different parameters and extras; inside the decorated
  function every rank has rank 0's parameters, optimizer state and extras.
- restore: after training steps and changed extras, restore() brings back exactly the
  last commit (parameters, optimizer state, extras); commit() then keeps the new ones.
- refusals: a first argument that is not a State, an extra named like a method, and a
  State made before hvdp.init() (in a fresh process, so here: after shutdown) each raise
  an error that names the problem.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import hvdp

hvdp.init()

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _report
from _report import digest, refusal
from checkpoint_resume import PARTS, batch


def optimizer_digest(optimizer: object) -> str:
    """A digest of the optimizer's whole state, through hvdp's own export."""
    arrays: list = []

    def walk(tree: object) -> None:
        if isinstance(tree, np.ndarray):
            arrays.append(tree.reshape(-1).astype(np.float64))
        elif isinstance(tree, dict):
            for key in sorted(tree, key=str):
                walk(tree[key])
        elif isinstance(tree, (list, tuple)):
            for item in tree:
                walk(item)
        elif isinstance(tree, (int, float)):
            arrays.append(np.asarray([tree], dtype=np.float64))

    from hvdp import _runtime

    walk(_runtime.current("test").export_state(model, optimizer)[1])
    return digest(np.concatenate(arrays)) if arrays else "empty"


# The replicas start apart on purpose, and step once so (the state sync must undo it): the
# drift guard, which would stop that first step, is off for this worker.
os.environ["HVDP_CHECK_EVERY"] = "0"
rank = hvdp.rank()
model, optimizer, step, flat = PARTS[hvdp.framework()](rank)  # parameters seeded by rank: they differ
step(*batch(0, rank))  # and so does the optimizer state
before = digest(flat())
state = hvdp.elastic.State(model, optimizer, epoch=rank * 10, note=f"from rank {rank}", history=[rank])
record: dict = {"rank": rank, "before": before}


@hvdp.elastic.run
def check(state: hvdp.elastic.State, label: str) -> str:
    record["synced"] = {"params": digest(flat()), "optimizer": optimizer_digest(optimizer), "epoch": state.epoch,
                        "note": state.note, "history": state.history}
    committed = (digest(flat()), optimizer_digest(optimizer))
    for number in range(3):
        step(*batch(number + 1, rank))
    state.epoch, state.history = 99, state.history + [7]
    changed = (digest(flat()), optimizer_digest(optimizer))
    state.restore()
    record["restored"] = {"equal_to_commit": (digest(flat()), optimizer_digest(optimizer)) == committed,
                          "changed_before": changed != committed, "epoch": state.epoch, "history": state.history}
    step(*batch(5, rank))
    state.epoch = 3
    state.commit()
    kept = digest(flat())
    step(*batch(6, rank))
    state.restore()
    record["after_commit"] = {"params_kept": digest(flat()) == kept, "epoch": state.epoch}
    return label


record["returned"] = check(state, "done")
everyone = hvdp.allgather_object(before)
record["differed"] = len(set(everyone)) == 2
record["refusals"] = {
    "not_a_state": refusal(lambda: check({"epoch": 0}, "x")),
    "reserved_extra": refusal(lambda: hvdp.elastic.State(model, optimizer, commit=1, epoch=0)),
}
record["final"] = digest(flat())
hvdp.shutdown()
record["refusals"]["before_init"] = refusal(lambda: hvdp.elastic.State(model, optimizer, epoch=0))
_report.write(rank, record)
