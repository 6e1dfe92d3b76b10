"""Where /dev/shm is too small for shared memory's buffers (a 4 MiB tmpfs, as a container without --shm-size has,
in a mount namespace of its own), large calls go through Gloo's ring with the right results, and rank 0 says so
once, with the reason and the fix (np=2, torch, Gloo)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
from harness import REPO, WORKERS

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs in a mount namespace: root only")


def test_a_small_dev_shm_falls_back_to_gloos_ring_and_rank_0_says_so_once(tmp_path):
    job = shlex.join([sys.executable, "-m", "hvdp.cli", "run", "-np", "2", "--gloo", "--framework", "torch",
                      str(WORKERS / "small_shm.py")])
    env = {**os.environ, "HVDP_TEST_OUT": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    env.pop("HVDP_FRAMEWORK", None)
    done = subprocess.run(["unshare", "--mount", "sh", "-c",
                           f"mount --make-rprivate / && mount -t tmpfs -o size=4m tmpfs /dev/shm && exec {job}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    for rank in range(2):
        report = (tmp_path / f"rank{rank}.json").read_text()
        assert '"results": [1.0, 3.0, 5.0]' in report, (rank, report)  # 0 + 1, 1 + 2, 2 + 3: the ring's sums
    said = [line for line in output.splitlines() if "could not reserve" in line]
    assert len(said) == 1, output[-4000:]
    assert "No space left on device" in said[0] and "--shm-size" in said[0] and "HVDP_SHARED_MEMORY=0" in said[0]
