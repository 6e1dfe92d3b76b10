"""What a worker reports: one JSON file per rank in $HVDP_TEST_OUT."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Callable, Dict

import numpy as np


def write(rank: int, record: Dict[str, Any]) -> None:
    """Write this rank's record; the test reads every rank's file."""
    out = os.environ["HVDP_TEST_OUT"]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)


def digest(values: np.ndarray) -> str:
    """A digest of the exact bits, to compare replicas across ranks."""
    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()


def compare(a: np.ndarray, b: np.ndarray) -> Dict[str, Any]:
    """Largest difference, and whether a equals b within rtol 1e-5, atol 1e-6."""
    return {"max_abs": float(np.max(np.abs(a - b))), "close": bool(np.allclose(a, b, rtol=1e-5, atol=1e-6))}


def refusal(call: Callable[[], object]) -> str:
    """The error ``call`` raises, as 'Type: message' for the test to read."""
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
