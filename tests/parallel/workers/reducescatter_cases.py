"""Horovod's reducescatter on hvdp's build (Gloo: one alltoallv of the ranks' blocks and a local sum) in every
case its code takes: each dtype, fewer rows than ranks (ranks that receive nothing), a lone tensor and a fused
group of several, a prescale and a postscale, an empty tensor beside others; each against NumPy over every
rank's inputs (rank r's come from seed 300 + r, so every rank can draw them all), and the inputs unchanged."""

from __future__ import annotations

from typing import Any, Dict

import horovod.torch as hvd
import numpy as np
import torch
from _report import write

import hvdp

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "int32": torch.int32,
          "int64": torch.int64}


def drawn(rank: int, rows: int, dtype: str, salt: int) -> np.ndarray:
    rng = np.random.default_rng(300 + 7 * salt + rank)
    if dtype.startswith("int"):
        return rng.integers(-50, 50, size=(rows, 3)).astype(dtype)
    return rng.standard_normal((rows, 3)).astype(dtype)


def expected(rows: int, dtype: str, salt: int, scale: float, size: int, rank: int) -> np.ndarray:
    whole = np.sum([drawn(r, rows, dtype, salt).astype(np.float64) for r in range(size)], axis=0) * scale
    return np.array_split(whole, size)[rank]  # the first rows % size ranks get one more row


def record(got: torch.Tensor, rows: int, dtype: str, salt: int, scale: float, input_kept: bool) -> Dict[str, Any]:
    """What this rank saw of one case: its rows, the rows it should get, and the largest difference from
    NumPy's sum (times ``scale``) relative to the largest expected value."""
    rank, size = hvdp.rank(), hvdp.size()
    want = expected(rows, dtype, salt, scale, size, rank)
    diff = np.abs(got.numpy().astype(np.float64) - want)
    error = float(diff.max() / max(1.0, np.abs(want).max())) if diff.size else 0.0
    return {"shape": list(got.shape), "want_rows": want.shape[0], "error": error, "input_kept": input_kept}


def main() -> None:
    hvdp.init(framework="torch")
    rank = hvdp.rank()
    cases: Dict[str, Any] = {}
    salt = 0
    for dtype, torch_dtype in DTYPES.items():
        for rows in (1, hvdp.size() - 1, hvdp.size(), 2 * hvdp.size() + 1, 4000):  # 4000 rows: 16 KB a rank
            salt += 1
            mine = torch.from_numpy(drawn(rank, rows, dtype, salt)).to(torch_dtype)
            kept = mine.clone()
            got = hvd.reducescatter(mine, op=hvd.Sum, name=f"lone.{dtype}.{rows}")
            cases[f"lone {dtype} {rows} rows"] = record(got, rows, dtype, salt, 1.0, bool(torch.equal(mine, kept)))
    for dtype in ("float32", "float16"):
        for kind, op, prescale, postscale, scale in (("scaled", hvd.Sum, 0.5, 3.0, 1.5),
                                                     ("average", hvd.Average, 1.0, 1.0, 1.0 / hvdp.size())):
            salt += 1
            mine = torch.from_numpy(drawn(rank, 10, dtype, salt)).to(DTYPES[dtype])
            kept = mine.clone()
            got = hvd.reducescatter(mine, op=op, prescale_factor=prescale, postscale_factor=postscale,
                                    name=f"{kind}.{dtype}")
            cases[f"{kind} {dtype}"] = record(got, 10, dtype, salt, scale, bool(torch.equal(mine, kept)))
    # A fused group: several tensors of different row counts (one smaller than the ranks, one empty) in one request.
    group_rows = (7, 1, 0, 2 * hvdp.size(), 4000)
    salts = list(range(salt + 1, salt + 1 + len(group_rows)))
    mine_group = [torch.from_numpy(drawn(rank, rows, "float32", s)) for rows, s in zip(group_rows, salts)]
    kept_group = [t.clone() for t in mine_group]
    got_group = hvd.grouped_reducescatter(mine_group, op=hvd.Sum, prescale_factor=2.0, name="group")
    for rows, s, got, mine, kept in zip(group_rows, salts, got_group, mine_group, kept_group):
        cases[f"group float32 {rows} rows"] = record(got, rows, "float32", s, 2.0, bool(torch.equal(mine, kept)))
    write(rank, {"rank": rank, "size": hvdp.size(), "cases": cases, "ring": ring_cases(RING_ROWS, False),
                 "shared memory": ring_cases(SHM_ROWS, True)})


#: Rows (of 3) per dtype: past 256 KB (Gloo's ring, shared memory switched off), or past 8 MB (shared memory).
RING_ROWS = (("float32", 33_335), ("float64", 500_001), ("int64", 200_000))
SHM_ROWS = (("float32", 700_001), ("float64", 350_003), ("int64", 400_000))


def ring_cases(sizes: Any, shared: bool) -> Dict[str, Any]:
    """hvdp.allreduce past 256 KB: Gloo's ring from the input apart from the output (hvdp's build), or past
    8 MB, shared memory (every rank on this machine). At np=3 a rank sends its first segments straight from
    its input and forwards segments it reduced, which np=2 never does; in shared memory each rank sums one
    segment of three places. A new tensor, out= (another tensor, the tensor itself), against NumPy; the input
    unchanged."""
    from hvdp.backends.torch.direct import calls as direct_calls
    from hvdp.backends.torch.direct.allreduce import local_memory

    rank, size, found, rings = hvdp.rank(), hvdp.size(), {}, []
    local = local_memory()
    served = local.served if local is not None else 0
    if local is not None:
        local.on = shared  # off: as HVDP_SHARED_MEMORY=0
    entry = direct_calls._RING.entry
    direct_calls._RING.entry = lambda *args: rings.append(args[2]) or entry(*args)
    try:
        for salt, (dtype, rows) in enumerate(sizes, 100):
            want = np.sum([drawn(r, rows, dtype, salt).astype(np.float64) for r in range(size)], axis=0)
            mine = torch.from_numpy(drawn(rank, rows, dtype, salt))
            kept = mine.clone()
            into = torch.empty_like(mine)
            results = {"new": hvdp.allreduce(mine, op="sum", name=f"ring.{dtype}")}
            results["out="] = hvdp.allreduce(mine, op="sum", name=f"ring.out.{dtype}", out=into)
            input_kept = bool(torch.equal(mine, kept))
            results["in place"] = hvdp.allreduce(mine, op="sum", name=f"ring.inplace.{dtype}", out=mine)
            for form, got in results.items():
                error = float(np.abs(got.numpy().astype(np.float64) - want).max() / max(1.0, np.abs(want).max()))
                found[f"{form} {dtype}"] = {"error": error, "input_kept": input_kept}
    finally:
        direct_calls._RING.entry = entry
        if local is not None:
            local.on = True
    found["ring calls"] = len(rings)
    found["shared memory calls"] = (local.served if local is not None else 0) - served
    return found


if __name__ == "__main__":
    main()
