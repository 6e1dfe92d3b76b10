"""A torch training loop under hvdp.profiler, with an injected straggler (argv[1]):
input_skew (rank 1 sleeps in its data phase), compute_skew (rank 1 computes more), or balanced."""

from __future__ import annotations

import sys
import time

import torch

import hvdp

DELAY, STEPS, BATCH = 0.15, 12, 32
#: balanced: every rank's same extra compute, so that a step (about 40 ms) dwarfs the scheduling noise of
#: a loaded 2-core machine (a 2 ms median difference once named rank 0 in an 8 ms step).
BALANCED_WORK = 0.03


def busy(seconds: float) -> None:
    """Real extra compute (matrix products) for about ``seconds``."""
    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def main() -> None:
    mode = sys.argv[1]
    hvdp.init()
    rank = hvdp.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model)
    hvdp.broadcast_state(model, optimizer)
    data = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        with hvdp.profiler.phase("data"):
            x, y = torch.randn(BATCH, 64, generator=data), torch.randint(0, 10, (BATCH,), generator=data)
            if mode == "input_skew" and rank == 1:
                time.sleep(DELAY)
        with hvdp.profiler.phase("compute"):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if mode == "compute_skew" and rank == 1:
                busy(DELAY)
            if mode == "balanced":
                busy(BALANCED_WORK)
        optimizer.step()
        hvdp.profiler.step(examples=BATCH)
    hvdp.shutdown()


if __name__ == "__main__":
    main()
