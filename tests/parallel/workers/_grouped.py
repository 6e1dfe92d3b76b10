"""hvdp.grouped_allreduce, grouped_allgather and grouped_reducescatter on a list of mixed values (a framework
tensor, a NumPy array, Python numbers), each result against NumPy over every rank's inputs."""

from __future__ import annotations

from typing import Any, Callable, Dict

import numpy as np
from _report import refusal

import hvdp


def inputs(rank: int) -> tuple:
    """Rank r's values: a float32 tensor's data, an int64 array, a float and an int."""
    rng = np.random.default_rng(300 + rank)
    return (rng.standard_normal(5).astype(np.float32), rng.integers(-9, 9, size=(2, 3)).astype(np.int64),
            0.5 + rank, 3 + rank)


def check(tensor: Callable[[np.ndarray], Any], numpy: Callable[[Any], np.ndarray]) -> Dict[str, Any]:
    rank, size = hvdp.rank(), hvdp.size()
    every = [inputs(r) for r in range(size)]
    mine = inputs(rank)
    found: Dict[str, Any] = {}
    for op, reduce in (("sum", np.sum), ("average", np.mean), ("max", np.max)):
        got = hvdp.grouped_allreduce([tensor(mine[0]), mine[1], mine[2], mine[3]], op=op)
        want = [reduce([e[i] for e in every], axis=0) for i in range(4)]
        found[f"allreduce_{op}"] = {
            "tensor_error": float(np.abs(numpy(got[0]) - want[0]).max()),
            "array_error": float(np.abs(np.asarray(got[1]) - want[1]).max()),
            # an integer array averages in its dtype, as hvdp.allreduce's does (Horovod scales in the dtype)
            "array_as_allreduce": bool(np.array_equal(got[1], hvdp.allreduce(mine[1], op=op))),
            "array_kind": type(got[1]).__name__,
            "numbers": [got[2], got[3]], "want_numbers": [float(want[2]), want[3].item()],
            "number_types": [type(got[2]).__name__, type(got[3]).__name__],
        }
    rows = [np.full((r + 1, 2), r, dtype=np.float32) for r in range(size)]  # a different first dimension per rank
    got = hvdp.grouped_allgather([tensor(rows[rank]), mine[1], mine[3]])
    found["allgather"] = {"tensor": bool(np.array_equal(numpy(got[0]), np.concatenate(rows))),
                          "array": bool(np.array_equal(got[1], np.concatenate([e[1] for e in every]))),
                          "numbers": got[2], "want_numbers": [e[3] for e in every]}
    stacked = [np.arange(6, dtype=np.float32).reshape(3, 2) * (r + 1) for r in range(size)]
    got = hvdp.grouped_reducescatter([tensor(stacked[rank]), mine[1].astype(np.float32)], op="sum")
    found["reducescatter"] = {
        "tensor_error": float(np.abs(numpy(got[0]) - np.array_split(np.sum(stacked, axis=0), size)[rank]).max()),
        "array_error": float(np.abs(got[1] - np.array_split(np.sum([e[1] for e in every], axis=0),
                                                               size)[rank]).max())}
    found["refusals"] = {
        "one_value": refusal(lambda: hvdp.grouped_allreduce(mine[0])),
        "empty": refusal(lambda: hvdp.grouped_allgather([])),
        "adasum": refusal(lambda: hvdp.grouped_allreduce([mine[0]], op="adasum")),
        "scatter_op": refusal(lambda: hvdp.grouped_reducescatter([mine[0]], op="max")),
        "scatter_number": refusal(lambda: hvdp.grouped_reducescatter([mine[0], 1.0])),
    }
    found["after"] = hvdp.allreduce(1, op="sum")  # the refusals left the job working
    return found
