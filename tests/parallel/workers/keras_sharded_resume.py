"""Keras at np=3: a checkpoint saved by the np=2 Keras job's sharded Adam (keras_fit.py), loaded into a sharded
Adam (a new split of its 143 elements) and continued; see ``_keras_sharded.resume``."""

from __future__ import annotations

import os
import sys

import hvdp

hvdp.init()  # before importing keras: it sets KERAS_BACKEND to the framework

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _keras_sharded
import _report


def main() -> None:
    rank, size = hvdp.rank(), hvdp.size()
    _report.write(rank, {"rank": rank, "resume": _keras_sharded.resume(rank, size,
                                                                      os.environ["HVDP_SHARDED_CHECKPOINT"])})
    hvdp.shutdown()


if __name__ == "__main__":
    main()
