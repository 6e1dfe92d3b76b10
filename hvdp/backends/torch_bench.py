"""``hvdp bench`` in PyTorch: its models, and training one under each contender (imported by the bench's torch
processes only)."""

from __future__ import annotations

import os
from typing import Any, List, Tuple

import torch
from torch import nn

from hvdp.bench import models, timing
from hvdp.bench.models import CLASSES, MLP_LAYERS, MLP_WIDTH, MODELS


def build_model(name: str) -> Any:
    """The torch ``nn.Module`` named ``name`` (one of :data:`hvdp.bench.models.MODELS`)."""
    torch.manual_seed(0)
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, CLASSES),
        )
    if name == "mlp":
        layers: list = []
        for _ in range(MLP_LAYERS - 1):
            layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(MLP_WIDTH, CLASSES))
    if name == "resnet18":
        return _resnet18()
    raise ValueError(f"Unknown model {name!r}. Expected one of: {', '.join(MODELS)}.")


def _block(cin: int, cout: int, stride: int) -> Any:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x: Any) -> Any:
            out = self.bn1(self.conv1(x)).relu()
            return (self.bn2(self.conv2(out)) + self.down(x)).relu()

    return Block()


def _resnet18() -> Any:
    layers: list = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_block(cin, cout, stride), _block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, CLASSES)]
    return nn.Sequential(*layers)


def train(impl: str, model_name: str, batch: int, warmup: int, steps: int) -> Tuple[int, int, List[float]]:
    """Train ``model_name`` under ``impl`` (hvdp, horovod, ddp, single); (rank, size, seconds per measured step)."""
    import torch.nn.functional as F  # noqa: N812

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    model = build_model(model_name)
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if impl == "hvdp":
        import hvdp

        hvdp.init(framework="torch")
        rank, size = hvdp.rank(), hvdp.size()
        optimizer = hvdp.DistributedOptimizer(optimizer, model)
        hvdp.broadcast_state(model, optimizer)
    elif impl == "horovod":
        import horovod.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    elif impl == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif impl == "single":
        rank, size = 0, 1
    else:
        raise ValueError(f"Unknown torch training implementation {impl!r}.")
    xs, ys = models.synthetic_batches(model_name, batch, timing.POOL, seed=1000 + rank)
    x, y = torch.from_numpy(xs), torch.from_numpy(ys)

    def step(i: int) -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[i % timing.POOL]), y[i % timing.POOL])
        loss.backward()
        optimizer.step()

    times = timing.timed_steps(step, warmup, steps)
    if impl == "ddp":
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return rank, size, times
