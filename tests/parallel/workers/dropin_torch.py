"""An existing horovod.torch script, unchanged, with hvd.SyncBatchNorm on CPU tensors (hvdp's Horovod build).

Only Horovod's own API, as Horovod's synthetic benchmark uses it: a conv net with
norm_layer=hvd.SyncBatchNorm, hvd.DistributedOptimizer(SGD with momentum, named_parameters),
hvd.broadcast_parameters and hvd.broadcast_optimizer_state. Every rank starts from different
weights and trains on different images; the result is compared with one process (plain
nn.BatchNorm2d, no Horovod) on the union of the ranks' batches: weights, running statistics,
and the outputs in eval mode.
"""

from __future__ import annotations

import os
import sys

import horovod.torch as hvd
import numpy as np
import torch
from torch.nn import functional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report
from _report import compare, digest

CLASSES, BATCH, STEPS = 5, 4, 3


def make_model(seed: int, norm_layer: type) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 6, 3, padding=1, bias=False), norm_layer(6), torch.nn.ReLU(),
        torch.nn.Conv2d(6, 4, 3, stride=2, bias=False), norm_layer(4), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(4 * 3 * 3, CLASSES))


def flat(model: torch.nn.Module) -> np.ndarray:
    """Parameters and buffers (the running statistics), in order."""
    return torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()
                      if t.dtype.is_floating_point]).numpy()


def batches(rank: int) -> list:
    data = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(BATCH, 3, 8, 8, generator=data), torch.randint(0, CLASSES, (BATCH,), generator=data))
            for _ in range(STEPS)]


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = make_model(seed=rank, norm_layer=hvd.SyncBatchNorm)
    before = flat(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * size, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for x, y in batches(rank):
        optimizer.zero_grad()
        functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    probe = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    model.eval()
    with torch.no_grad():
        outputs = model(probe).numpy()

    reference = make_model(seed=0, norm_layer=torch.nn.BatchNorm2d)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1 * size, momentum=0.9)
    parts = [batches(r) for r in range(size)]
    for step in range(STEPS):
        x = torch.cat([p[step][0] for p in parts])
        y = torch.cat([p[step][1] for p in parts])
        ref_opt.zero_grad()
        functional.cross_entropy(reference(x), y).backward()  # union mean = mean of ranks' means
        ref_opt.step()
    reference.eval()
    with torch.no_grad():
        ref_outputs = reference(probe).numpy()
    _report.write(rank, {"rank": rank, "size": size, "before": digest(before), "after": flat(model).tolist(),
                         "vs_union": compare(flat(model), flat(reference)),
                         "eval_outputs_vs_union": compare(outputs, ref_outputs)})


if __name__ == "__main__":
    main()
