"""What a worker reports: one JSON file per rank in $HVDP_TEST_OUT."""

from __future__ import annotations

import json
import os
from typing import Any, Dict


def write(rank: int, record: Dict[str, Any]) -> None:
    """Write this rank's record; the test reads every rank's file."""
    out = os.environ["HVDP_TEST_OUT"]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)
