"""hvdp.allreduce's elementwise ops (min, max, product) on a framework tensor, a NumPy array, an
integer tensor and a Python number, each against NumPy over every rank's inputs (which every rank
can draw: rank r's come from seed r)."""

from __future__ import annotations

from typing import Any, Callable, Dict

import numpy as np

import hvdp

REFERENCES = {"min": np.min, "max": np.max, "product": np.prod}


def floats(rank: int) -> np.ndarray:
    return np.random.default_rng(rank).uniform(0.5, 2.0, size=6).astype(np.float32)


def ints(rank: int) -> np.ndarray:
    return np.random.default_rng(100 + rank).integers(-5, 6, size=6).astype(np.int64)


def check(tensor: Callable[[np.ndarray], Any], numpy: Callable[[Any], np.ndarray]) -> Dict[str, Dict[str, Any]]:
    """Per op: the largest error of each float result, whether the integer results are exact, and their kinds."""
    rank, size = hvdp.rank(), hvdp.size()
    found = {}
    for op, reference in REFERENCES.items():
        want_floats = reference(np.stack([floats(r) for r in range(size)]), axis=0)
        want_ints = reference(np.stack([ints(r) for r in range(size)]), axis=0)
        int_result = numpy(hvdp.allreduce(tensor(ints(rank)), op=op))
        number = hvdp.allreduce(rank + 2, op=op)
        found[op] = {
            "tensor_error": float(np.abs(numpy(hvdp.allreduce(tensor(floats(rank)), op=op)) - want_floats).max()),
            "numpy_error": float(np.abs(hvdp.allreduce(floats(rank), op=op) - want_floats).max()),
            "ints_exact": bool(np.array_equal(int_result, want_ints)), "ints_dtype": str(int_result.dtype),
            "number": number, "number_type": type(number).__name__,
            "number_expected": int(reference([r + 2 for r in range(size)])),
        }
    return found
