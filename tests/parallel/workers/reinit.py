"""hvdp.shutdown() and hvdp.init() again, ROUNDS times in one process, as elastic resets and test suites do, with
the direct path in use in every round: a fresh torch model and DistributedOptimizer (its first step learns the
layout on Horovod's path, the others go direct), hvdp.allreduce of a small tensor (one direct exchange) and of a
1 MB one (Gloo's ring by the calling thread), two process sets added, used and removed. Each rank reports every
round.
"""

from __future__ import annotations

import os
import time

import torch
from _report import digest, write

import hvdp

ROUNDS = int(os.environ.get("HVDP_REINIT_ROUNDS", "20"))
STEPS = 3
LARGE = 1 << 18  # float32 elements: 1 MB, past the single exchange's 256 KB


def one_round(round_: int) -> dict:
    hvdp.init(process_sets="dynamic")
    rank, size = hvdp.rank(), hvdp.size()
    torch.manual_seed(round_ + rank)  # different on each rank: broadcast_state makes them equal
    model = torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4))
    opt = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model=model)
    hvdp.broadcast_state(model, opt, root_rank=0)
    generator = torch.Generator().manual_seed(1000 * round_ + rank)
    for _ in range(STEPS):
        opt.zero_grad()
        x, y = torch.randn(8, 32, generator=generator), torch.randn(8, 4, generator=generator)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    path = getattr(opt, "gradient_path", None)
    small = hvdp.allreduce(torch.full((16,), float(rank + round_)), op="sum")
    large = hvdp.allreduce(torch.full((LARGE,), float(rank + 1)), op="sum")
    evens = hvdp.add_process_set([r for r in range(size) if r % 2 == 0])
    odds = hvdp.add_process_set([r for r in range(size) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    in_set = hvdp.allreduce(torch.tensor([float(rank + 1)]), op="sum", process_set=mine)
    hvdp.remove_process_set(odds)
    hvdp.remove_process_set(evens)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    record = {"round": round_, "rank": rank, "small": float(small[0]),
              "large": [float(large.min()), float(large.max())],
              "in_set": float(in_set[0]), "counts": None if path is None else dict(path.counts),
              "params": digest(params)}
    hvdp.shutdown()
    return record


def main() -> None:
    start = time.monotonic()
    rounds = [one_round(r) for r in range(ROUNDS)]
    rank = rounds[0]["rank"]
    write(rank, {"rank": rank, "rounds": rounds, "initialized_after": hvdp.is_initialized(),
                 "seconds": round(time.monotonic() - start, 1)})


if __name__ == "__main__":
    main()
