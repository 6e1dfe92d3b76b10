"""Core API on torch: rank/size, broadcast_state, and training on different data per rank."""

from __future__ import annotations

import sys

import numpy as np
import torch

import hvdp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _data
import _elementwise
import _grouped
import _report
import _scatter
from _report import refusal


def flat(module: torch.nn.Module) -> list:
    """Every parameter and buffer (BatchNorm statistics included)."""
    return torch.cat([p.detach().reshape(-1).float() for p in module.state_dict().values()]).tolist()


def params(module: torch.nn.Module) -> list:
    """The trainable parameters only: BatchNorm running statistics stay local to each replica."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).tolist()


def adam_state(optimizer: torch.optim.Optimizer) -> list:
    values = []
    for state in optimizer.state_dict()["state"].values():
        values += [float(v.float().sum()) for v in state.values() if torch.is_tensor(v)]
    return values


def main() -> None:
    hvdp.init()
    rank, size = hvdp.rank(), hvdp.size()
    record = {"rank": rank, "size": size, "local_rank": hvdp.local_rank(),
              "local_size": hvdp.local_size(), "cross_rank": hvdp.cross_rank(),
              "cross_size": hvdp.cross_size(), "framework": hvdp.framework()}

    # Different initial weights and optimizer state on every rank ...
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3))
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))
    torch.nn.functional.cross_entropy(model(x), torch.zeros(16, dtype=torch.long)).backward()
    adam.step()
    record["before_broadcast"] = flat(model)
    record["adam_before"] = adam_state(adam)
    # ... made identical by broadcast_state.
    hvdp.broadcast_state(model, adam, root_rank=0)
    record["after_broadcast"] = flat(model)
    record["params_after_broadcast"] = params(model)
    record["adam_after"] = adam_state(adam)

    # Training with different data on each rank keeps replicas identical.
    sgd = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    data = np.random.default_rng(100 + rank)
    losses = []
    for _ in range(5):
        xb = torch.from_numpy(data.normal(size=(32, 8)).astype(np.float32))
        yb = torch.from_numpy(data.integers(0, 3, size=32))
        sgd.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        sgd.step()
        losses.append(loss.item())
    record["losses"] = losses
    record["after_training"] = params(model)
    record["optimizer_class"] = type(sgd).__name__
    record["allreduce_number"] = hvdp.allreduce(rank + 1.0)
    record["allreduce_sum_int"] = hvdp.allreduce(rank + 1, op="sum")
    record["allreduce_numpy"] = hvdp.allreduce(np.full(3, rank, dtype=np.float32)).tolist()
    record["elementwise"] = _elementwise.check(torch.from_numpy, lambda t: t.numpy())
    record["scatter"] = _scatter.check(torch.from_numpy, lambda t: t.numpy())
    record["grouped"] = _grouped.check(torch.from_numpy, lambda t: t.numpy())
    record["data"] = {"sampler": _data.sampler(), "loader": _data.torch_loader()}
    record["elementwise_refusals"] = {
        "optimizer": refusal(lambda: hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), 0.1), op="max")),
        "requires_grad": refusal(lambda: hvdp.allreduce(torch.ones(2, requires_grad=True), op="min")),
        "unknown": refusal(lambda: hvdp.allreduce(1.0, op="median")),
    }
    _report.write(rank, record)
    hvdp.shutdown()


if __name__ == "__main__":
    main()
