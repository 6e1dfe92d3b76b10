"""Large hvdp.allreduce calls (the shared-memory lane) where /dev/shm is too small for them (a tmpfs of a few MiB,
as a container has): each rank reports its results, which must be right (Gloo's ring took over)."""

from __future__ import annotations

import torch
from _report import write

import hvdp

hvdp.init()
RANK, SIZE = hvdp.rank(), hvdp.size()
results = []
for step in range(3):
    value = torch.full((4 << 20,), float(RANK + step))  # 16 MB
    results.append(float(hvdp.allreduce(value, op="sum")[-1]))
write(RANK, {"rank": RANK, "results": results})
