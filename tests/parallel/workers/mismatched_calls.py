"""Collective calls that differ between ranks (rank 0 makes one call, every other rank another), each followed
by a call every rank makes alike: each rank reports what its call raised, in how long, and the next call's result.

torch under Gloo, where every whole-job call starts with the header exchange (hvdp.backends.torch.direct.calls): the
path (direct or Horovod's) is chosen from the agreed headers, so a difference is refused on every rank at once
instead of two ranks waiting in two mechanisms until the stall timeout.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict

import numpy as np
import torch
from _report import write

import hvdp

hvdp.init()
RANK, SIZE = hvdp.rank(), hvdp.size()
SMALL, LARGE = torch.ones(1024), torch.ones(1 << 18)  # 4 KB (one exchange), 1 MB (the header, then the ring)


def grad_tensor() -> torch.Tensor:
    return torch.ones(4, requires_grad=True)


#: case: (rank 0's call, every other rank's call)
CASES: Dict[str, Any] = {
    "op 4 KB": (lambda: hvdp.allreduce(SMALL, op="sum"), lambda: hvdp.allreduce(SMALL, op="max")),
    "op 1 MB": (lambda: hvdp.allreduce(LARGE, op="sum"), lambda: hvdp.allreduce(LARGE, op="max")),
    "kind allreduce/allgather": (lambda: hvdp.allreduce(SMALL), lambda: hvdp.allgather(SMALL)),
    "kind allreduce/broadcast": (lambda: hvdp.allreduce(SMALL), lambda: hvdp.broadcast(SMALL, 0)),
    "kind allreduce/barrier": (lambda: hvdp.allreduce(SMALL), lambda: hvdp.barrier()),
    "kind allgather/allgather_object": (lambda: hvdp.allgather(SMALL), lambda: hvdp.allgather_object(RANK)),
    "kind broadcast_object/allreduce": (lambda: hvdp.broadcast_object("x"), lambda: hvdp.allreduce(SMALL)),
    "root": (lambda: hvdp.broadcast(SMALL, 0), lambda: hvdp.broadcast(SMALL, 1)),
    "name": (lambda: hvdp.allreduce(SMALL, name="a"), lambda: hvdp.allreduce(SMALL, name="b")),
    "dtype float16/float32": (lambda: hvdp.allreduce(SMALL.half()), lambda: hvdp.allreduce(SMALL)),
    "shape 1 MB": (lambda: hvdp.allreduce(LARGE), lambda: hvdp.allreduce(LARGE[:-1])),
    "grouped/allreduce": (lambda: hvdp.grouped_allreduce([SMALL, SMALL]), lambda: hvdp.allreduce(SMALL)),
}


def attempt(call: Callable[[], Any]) -> Dict[str, Any]:
    start = time.perf_counter()
    try:
        call()
        return {"raised": None, "seconds": time.perf_counter() - start}
    except Exception as exc:  # the report says what each rank raised
        return {"raised": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - start}


report: Dict[str, Any] = {"rank": RANK, "size": SIZE, "cases": {}}
for case, (first, other) in CASES.items():
    got = attempt(first if RANK == 0 else other)
    got["after"] = float(hvdp.allreduce(torch.full((3,), float(RANK)), op="sum")[0])  # the job goes on
    report["cases"][case] = got

# Alike on every rank, not refused: a tensor that needs a gradient on rank 0 only (Horovod's path on every rank),
# an allgather whose first dimension differs, a large op that only Horovod's path has.
with torch.enable_grad():
    mixed = hvdp.allreduce(grad_tensor() if RANK == 0 else torch.ones(4), op="sum")
report["grad on one rank"] = mixed.detach().tolist()
report["allgather rows"] = hvdp.allgather(torch.ones(RANK + 1, 2)).shape[0]
report["max 1 MB"] = float(hvdp.allreduce(LARGE * (RANK + 1), op="max")[0])
report["numpy"] = np.asarray(hvdp.allreduce(np.ones(3), op="sum")).tolist()
write(RANK, report)
