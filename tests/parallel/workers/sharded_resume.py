"""torch at np=3: a checkpoint saved by the np=2 equivalence job's sharded Adam, loaded into a sharded Adam
(a new split: the buffers divide by 3 no more than by 2) and continued; see ``_sharded.resume``."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _report
import _sharded

import hvdp


def main() -> None:
    hvdp.init()
    rank, size = hvdp.rank(), hvdp.size()
    _report.write(rank, {"rank": rank, "resume": _sharded.resume(rank, size, os.environ["HVDP_SHARDED_CHECKPOINT"])})
    hvdp.shutdown()


if __name__ == "__main__":
    main()
