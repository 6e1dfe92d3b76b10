"""Horovod's reducescatter on hvdp's build (Gloo: one alltoallv of the ranks' blocks and a local sum) in every
case its code takes: each dtype, fewer rows than ranks (ranks that receive nothing), a lone tensor and a fused
group of several, a prescale and a postscale, an empty tensor beside others; each against NumPy over every
rank's inputs (rank r's come from seed 300 + r, so every rank can draw them all), and the inputs unchanged."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

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


def error(got: torch.Tensor, want: np.ndarray, dtype: str) -> Tuple[List[int], float]:
    """(got's shape, the largest difference from ``want`` relative to ``want``'s largest value)."""
    diff = np.abs(got.numpy().astype(np.float64) - want)
    return list(got.shape), float(diff.max() / max(1.0, np.abs(want).max())) if diff.size else 0.0


def main() -> None:
    hvdp.init(framework="torch")
    rank, size = hvdp.rank(), hvdp.size()
    cases: Dict[str, Any] = {}
    salt = 0
    for dtype, torch_dtype in DTYPES.items():
        for rows in (1, size - 1, size, 2 * size + 1, 4000):  # 4000 rows: 48 KB of float32 a rank
            salt += 1
            mine = torch.from_numpy(drawn(rank, rows, dtype, salt)).to(torch_dtype)
            kept = mine.clone()
            got = hvd.reducescatter(mine, op=hvd.Sum, name=f"lone.{dtype}.{rows}")
            shape, err = error(got, expected(rows, dtype, salt, 1.0, size, rank), dtype)
            cases[f"lone {dtype} {rows} rows"] = {"shape": shape, "want_rows": expected(
                rows, dtype, salt, 1.0, size, rank).shape[0], "error": err, "input_kept": bool(torch.equal(mine, kept))}
    for dtype in ("float32", "float16"):
        salt += 1
        mine = torch.from_numpy(drawn(rank, 10, dtype, salt)).to(DTYPES[dtype])
        got = hvd.reducescatter(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0, name=f"scaled.{dtype}")
        shape, err = error(got, expected(10, dtype, salt, 1.5, size, rank), dtype)
        cases[f"scaled {dtype}"] = {"shape": shape, "want_rows": expected(10, dtype, salt, 1.5, size, rank).shape[0],
                                    "error": err, "input_kept": True}
        salt += 1
        mine = torch.from_numpy(drawn(rank, 10, dtype, salt)).to(DTYPES[dtype])
        got = hvd.reducescatter(mine, op=hvd.Average, name=f"average.{dtype}")
        shape, err = error(got, expected(10, dtype, salt, 1.0 / size, size, rank), dtype)
        cases[f"average {dtype}"] = {"shape": shape, "want_rows": expected(10, dtype, salt, 1.0 / size, size,
                                                                              rank).shape[0],
                                     "error": err, "input_kept": True}
    # A fused group: several tensors of different row counts (one smaller than the ranks, one empty) in one request.
    group_rows = (7, 1, 0, 2 * size, 4000)
    salts = list(range(salt + 1, salt + 1 + len(group_rows)))
    mine_group = [torch.from_numpy(drawn(rank, rows, "float32", s)) for rows, s in zip(group_rows, salts)]
    kept_group = [t.clone() for t in mine_group]
    got_group = hvd.grouped_reducescatter(mine_group, op=hvd.Sum, prescale_factor=2.0, name="group")
    for rows, s, got, mine, kept in zip(group_rows, salts, got_group, mine_group, kept_group):
        shape, err = error(got, expected(rows, "float32", s, 2.0, size, rank), "float32")
        cases[f"group float32 {rows} rows"] = {"shape": shape, "want_rows": expected(
            rows, "float32", s, 2.0, size, rank).shape[0], "error": err, "input_kept": bool(torch.equal(mine, kept))}
    write(rank, {"rank": rank, "size": size, "cases": cases})


if __name__ == "__main__":
    main()
