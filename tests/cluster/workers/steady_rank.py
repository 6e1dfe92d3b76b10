"""Take part in an allreduce every 0.1 s until ended from outside (the scancel test).

Once the job runs, each rank writes $HVDP_TEST_OUT/rank<N>.json: its pid and network namespace,
so the test can check that no rank outlives the job on any node.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import hvdp

hvdp.init()
hvdp.barrier()  # every rank is up
report = {"rank": hvdp.rank(), "pid": os.getpid(), "netns": os.stat("/proc/self/ns/net").st_ino}
Path(os.environ["HVDP_TEST_OUT"], f"rank{hvdp.rank()}.json").write_text(json.dumps(report))
deadline = time.monotonic() + 600  # a job nobody ends still ends
while time.monotonic() < deadline:
    hvdp.allreduce(1.0, name="tick")
    time.sleep(0.1)
hvdp.shutdown()
