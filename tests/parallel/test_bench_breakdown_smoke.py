"""The bench's breakdown section for real: 2 processes under `hvdp run --gloo`, 4 KB, a few calls of
hvdp.allreduce (a direct exchange at this size), the same call on Horovod's path, and Horovod's allreduce_.
Every rank's phases must be there, none negative (beyond the
clock alignment of Python's and Horovod's timeline's clocks), and together at most the measured call."""

from __future__ import annotations

import json
import subprocess
import sys

from harness import HVDP, REPO

from hvdp.bench import breakdown as bd

#: Python's wall clock against Horovod's timeline clock: both are the system clock, read microseconds apart.
CLOCK_SLACK_US = 50.0


def test_breakdown_section_gloo_small(tmp_path):
    out = tmp_path / "breakdown.json"
    proc = subprocess.run([*HVDP, "run", "-np", "2", "--gloo", sys.executable, "-m", "hvdp.bench.worker",
                           "breakdown", "--impl", "hvdp", "--sizes", "4096", "--calls", "4", "--warmup", "1",
                           "--budget", "1", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["controller"] == "gloo" and record["size"] == 2
    assert set(record["phases"]) == set(bd.VARIANTS)
    for variant in bd.VARIANTS:
        by_rank = record["phases"][variant]["4096"]
        assert set(by_rank) == {"0", "1"}
        for rank, rows in by_rank.items():
            assert len(rows) >= 3, (variant, rank)
            # hvdp's 4 KB call goes by a direct exchange, outside Horovod's timeline: Python's phases only
            expected = set(bd.PYTHON_PHASES) - {"wait"} | set(bd.TIMELINE_PHASES) \
                if rank == "0" and variant != bd.DIRECT else set(bd.PYTHON_PHASES)
            for row in rows:
                assert set(row) == expected | {"call", "unaccounted"}, (variant, rank, row)
                phases = {k: v for k, v in row.items() if k not in ("call", "unaccounted")}
                assert min(phases.values()) >= -CLOCK_SLACK_US, (variant, rank, row)
                assert sum(phases.values()) <= row["call"] + 1.0, (variant, rank, row)
                assert row["call"] > 0
        if variant == bd.VARIANTS[2]:  # in place: no result to allocate
            assert all(row["output allocation"] == 0 for rows in by_rank.values() for row in rows)
        if variant == bd.DIRECT:  # no enqueue into Horovod: the exchange is the wait
            assert all(row["enqueue"] == 0 and row["wait"] > 0 for rows in by_rank.values() for row in rows)
    table = bd.format_table(bd.summarize([record]))
    print(table)
    assert "gloo, 4 KB" in table and "transport" in table
