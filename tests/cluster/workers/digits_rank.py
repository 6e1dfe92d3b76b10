"""Train examples/train_digits.py as one rank, then report where this rank ran and what hvdp saw.

Run by the multi-host test under `hvdp run`; writes $HVDP_TEST_OUT/rank<N>.json.
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import sys
from pathlib import Path

import psutil

import hvdp

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_digits.py"
seen: dict = {}
_shutdown = hvdp.shutdown


def _record_then_shutdown() -> None:
    """What hvdp reports about the job, read just before the example shuts it down."""
    seen.update(rank=hvdp.rank(), size=hvdp.size(), local_rank=hvdp.local_rank(), local_size=hvdp.local_size(),
                cross_rank=hvdp.cross_rank(), cross_size=hvdp.cross_size(), framework=hvdp.framework())
    _shutdown()


hvdp.shutdown = _record_then_shutdown
sys.argv = [str(EXAMPLE), *sys.argv[1:]]
sys.path.insert(0, str(EXAMPLE.parent))  # as `python examples/train_digits.py` does
runpy.run_path(str(EXAMPLE), run_name="__main__")

report = {
    **seen,
    "netns": os.stat("/proc/self/ns/net").st_ino,
    "eth0": [a.address for a in psutil.net_if_addrs().get("eth0", []) if a.family == socket.AF_INET],
    "ssh_connection": os.environ.get("SSH_CONNECTION"),
    "horovod_controller": os.environ.get("HOROVOD_CONTROLLER"),
    "ompi_world_size": os.environ.get("OMPI_COMM_WORLD_SIZE"),
    "slurm_step_id": os.environ.get("SLURM_STEP_ID"),  # under a Slurm job step (srun), which one
}
Path(os.environ["HVDP_TEST_OUT"], f"rank{seen['rank']}.json").write_text(json.dumps(report))
