"""hvdp.reducescatter and hvdp.alltoall on a framework tensor and a NumPy array, each against NumPy
over every rank's inputs (rank r's come from seed r, so every rank can draw them all)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import numpy as np
from _report import refusal

import hvdp


def rows(rank: int, count: int = 5) -> np.ndarray:
    return np.random.default_rng(200 + rank).standard_normal((count, 3)).astype(np.float32)


def tagged(rank: int, count: int) -> np.ndarray:
    """Row i of rank r is [r, i]: where each received row came from is readable."""
    return np.stack([np.full(count, rank), np.arange(count)], axis=1).astype(np.int64)


def splits_of(rank: int, size: int) -> List[int]:
    return [1 + (rank + s) % 3 for s in range(size)]  # a different count for every pair


def check(tensor: Callable[[np.ndarray], Any], numpy: Callable[[Any], np.ndarray]) -> Dict[str, Any]:
    rank, size = hvdp.rank(), hvdp.size()
    found: Dict[str, Any] = {}
    total = np.sum([rows(r) for r in range(size)], axis=0)
    for op, whole in (("sum", total), ("average", total / size)):
        want = np.array_split(whole, size)[rank]  # the first rows % size ranks get one more row
        got_tensor = numpy(hvdp.reducescatter(tensor(rows(rank)), op=op))
        got_array = hvdp.reducescatter(rows(rank), op=op)
        found[f"reducescatter_{op}"] = {"shape": list(got_tensor.shape), "want_shape": list(want.shape),
                                        "tensor_error": float(np.abs(got_tensor - want).max()),
                                        "numpy_error": float(np.abs(got_array - want).max()),
                                        "numpy_kind": type(got_array).__name__}
    equal = numpy(hvdp.alltoall(tensor(tagged(rank, 2 * size))))
    want_equal = np.concatenate([tagged(s, 2 * size)[2 * rank:2 * rank + 2] for s in range(size)])
    found["alltoall_equal"] = bool(np.array_equal(equal, want_equal))
    mine = splits_of(rank, size)
    received, counts = hvdp.alltoall(tensor(tagged(rank, sum(mine))), splits=mine)
    want_counts = [splits_of(s, size)[rank] for s in range(size)]
    want_rows = np.concatenate([tagged(s, sum(splits_of(s, size)))[sum(splits_of(s, size)[:rank]):][:want_counts[s]]
                                for s in range(size)])
    found["alltoall_splits"] = {"rows": bool(np.array_equal(numpy(received), want_rows)), "counts": counts,
                                "want_counts": want_counts}
    found["refusals"] = {
        "op": refusal(lambda: hvdp.reducescatter(rows(rank), op="max")),
        "number": refusal(lambda: hvdp.reducescatter(1.0)),
        "uneven": refusal(lambda: hvdp.alltoall(rows(rank, 2 * size + 1))),
        "splits_sum": refusal(lambda: hvdp.alltoall(rows(rank, 3), splits=[1] * size)),
        "splits_count": refusal(lambda: hvdp.alltoall(rows(rank, 3), splits=[3])),
    }
    found["after"] = hvdp.allreduce(1, op="sum")  # the refusals left the job working
    return found
