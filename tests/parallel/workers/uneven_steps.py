"""torch: a script with its own data split in which rank 1 has one batch fewer.

Rank 0 takes its last step while rank 1 already waits at exit; the job must not end
like a success. Each rank reports the steps it took before exit; hvdp's exit then
names every rank's count in one line and the job exits non-zero.
"""

from __future__ import annotations

import sys

import torch

import hvdp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _report


def main() -> None:
    hvdp.init()
    rank = hvdp.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    hvdp.broadcast_state(model, opt)
    batches = 5 if rank == 0 else 4  # the user's own split: 9 batches over 2 ranks
    data = torch.Generator().manual_seed(rank)
    for _ in range(batches):
        x = torch.randn(8, 4, generator=data)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    _report.write(rank, {"rank": rank, "steps": batches})


if __name__ == "__main__":
    main()
