"""``hvdp bench`` in PyTorch: its models, and training one under each contender (imported by the bench's torch
processes only)."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

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


def train(impl: str, model_name: str, batch: int, warmup: int, steps: int, optimizer: str = "sgd",
          shard: bool = False) -> Tuple[int, int, List[float]]:
    """Train ``model_name`` under ``impl`` (hvdp, horovod, ddp, single); (rank, size, seconds per measured step).

    ``optimizer`` "adam" or ``shard`` (hvdp's shard_optimizer_state, DDP with torch's ZeroRedundancyOptimizer)
    also measure memory: every rank's optimizer-state bytes and peak RSS, in :data:`timing.MEMORY`.
    """
    import torch.nn.functional as F  # noqa: N812

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    model = build_model(model_name)
    optimizer_class: Any = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
    options: Dict[str, Any] = {"lr": 1e-3} if optimizer == "adam" else {"lr": 0.01, "momentum": 0.9}
    opt: Any = None if impl == "ddp" and shard else optimizer_class(model.parameters(), **options)
    if impl == "hvdp":
        import hvdp

        hvdp.init(framework="torch")
        rank, size = hvdp.rank(), hvdp.size()
        opt = hvdp.DistributedOptimizer(opt, model, shard_optimizer_state=shard)
        hvdp.broadcast_state(model, opt)
    elif impl == "horovod":
        import horovod.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    elif impl == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        model = torch.nn.parallel.DistributedDataParallel(model)
        if shard:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class, **options)
    elif impl == "single":
        rank, size = 0, 1
    else:
        raise ValueError(f"Unknown torch training implementation {impl!r}.")
    xs, ys = models.synthetic_batches(model_name, batch, timing.POOL, seed=1000 + rank)
    x, y = torch.from_numpy(xs), torch.from_numpy(ys)

    def step(i: int) -> None:
        opt.zero_grad()
        loss = F.cross_entropy(model(x[i % timing.POOL]), y[i % timing.POOL])
        loss.backward()
        opt.step()

    times = timing.timed_steps(step, warmup, steps)
    if optimizer != "sgd" or shard:
        timing.MEMORY.update(_memory(impl, getattr(opt, "optim", opt)))
    if impl == "ddp":
        import gc

        import torch.distributed as dist

        # DDP and ZeroRedundancyOptimizer hold the process group (and ZeRO its last broadcasts'
        # work handles): let them go while the interpreter is whole, so that the group's Gloo
        # threads end in destroy_process_group, not at exit (where torch aborts now and then).
        del step, opt, model
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return rank, size, times


def _memory(impl: str, optimizer: Any) -> dict:
    """Every rank's optimizer-state bytes (the tensors in ``optimizer.state``) and peak RSS, gathered to all."""
    mine = (sum(v.numel() * v.element_size() for entry in optimizer.state.values() for v in entry.values()
                if torch.is_tensor(v)), timing.peak_rss_bytes())
    if impl == "hvdp":
        import hvdp

        every = hvdp.allgather_object(mine)
    elif impl == "ddp":
        import torch.distributed as dist

        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    return {"state_bytes": [int(e[0]) for e in every], "peak_rss_bytes": [int(e[1]) for e in every]}


def _clock_offset_ns() -> int:
    """time_ns - perf_counter_ns on this process (the tightest of a few brackets): turns marks into wall time."""
    import time

    best = None
    for _ in range(7):
        before = time.perf_counter_ns()
        wall = time.time_ns()
        after = time.perf_counter_ns()
        if best is None or after - before < best[0]:
            best = (after - before, wall - (before + after) // 2)
    assert best is not None
    return best[1]


def breakdown(sizes: List[int], calls: int, warmup: int, budget: float, timeline: str) -> Tuple[int, dict]:
    """Time ``hvdp.allreduce`` and Horovod's in-place ``allreduce_`` call by call, alternating, at each size.

    Every call records the :data:`hvdp.bench.breakdown.MARKS` (perf_counter ns) at the points it passes
    through Horovod's Python (``allreduce_async``, ``_allreduce_async``, ``synchronize``, wrapped here
    for the run) and its minor page faults; rank 0 writes Horovod's timeline to ``timeline``. Returns
    (rank, record); rank 0's record holds every rank's phases, the timeline's split of rank 0's wait
    included (the job is shut down on return, so that the timeline is complete).
    """
    import resource
    import time

    import horovod.torch as hvd
    from horovod.torch import mpi_ops

    import hvdp
    from hvdp.backends.direct import PATH_ENV
    from hvdp.backends.torch.direct import calls as direct_calls
    from hvdp.bench import breakdown as bd

    os.environ["HOROVOD_TIMELINE"] = timeline
    hvdp.init(framework="torch")
    rank, size = hvdp.rank(), hvdp.size()
    controller = "mpi" if hvd.mpi_enabled() else "gloo"
    now = time.perf_counter_ns
    current: dict = {}
    originals = (hvd.allreduce_async, mpi_ops._allreduce_async, hvd.synchronize, mpi_ops.synchronize)

    def allreduce_async(*args: Any, **kwargs: Any) -> Any:
        current["alloc"] = now()
        return originals[0](*args, **kwargs)

    def _allreduce_async(*args: Any, **kwargs: Any) -> Any:
        current["enqueue"] = now()
        handle = originals[1](*args, **kwargs)
        current["enqueued"] = now()
        return handle

    def synchronize(handle: Any) -> Any:
        result = originals[2](handle)
        current["done"] = now()
        return result

    hvd.allreduce_async, mpi_ops._allreduce_async = allreduce_async, _allreduce_async
    hvd.synchronize = mpi_ops.synchronize = synchronize
    exchange = direct_calls._EXCHANGE  # the direct calls: marks around the packing, the exchange and the ring
    reduce, entry, ring = exchange.reduce, exchange.entry, direct_calls._RING.entry

    def reduce_marked(*args: Any, **kwargs: Any) -> Any:
        current["alloc"] = now()
        return reduce(*args, **kwargs)

    def entry_marked(*args: Any) -> Any:
        current["enqueue"] = current["enqueued"] = now()
        code = entry(*args)  # set: the build has it (else no call is direct)
        current["done"] = now()
        return code

    def ring_marked(*args: Any) -> Any:  # a large call: its header exchange (the "enqueue" mark), then the ring
        code = ring(*args)
        current["done"] = now()
        return code

    exchange.reduce, exchange.entry = reduce_marked, entry_marked  # type: ignore[method-assign]
    direct_calls._RING.entry = ring_marked

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    marks: dict = {v: {} for v in bd.VARIANTS}
    minflt: dict = {v: {} for v in bd.VARIANTS}
    def measure(nbytes: int) -> None:
        key = str(nbytes)
        tensors = {v: torch.ones(nbytes // 4) for v in bd.VARIANTS}
        names = {v: f"breakdown.{i}.{nbytes}" for i, v in enumerate(bd.VARIANTS)}
        def horovods_path() -> Any:
            os.environ[PATH_ENV] = "horovod"
            try:
                return hvdp.allreduce(tensors[bd.VARIANTS[1]], op="sum", name=names[bd.VARIANTS[1]])
            finally:
                del os.environ[PATH_ENV]

        run = {bd.VARIANTS[0]: lambda: hvdp.allreduce(tensors[bd.VARIANTS[0]], op="sum", name=names[bd.VARIANTS[0]]),
               bd.VARIANTS[1]: horovods_path,
               bd.VARIANTS[2]: lambda: hvd.allreduce_(tensors[bd.VARIANTS[2]], op=hvd.Sum, name=names[bd.VARIANTS[2]])}
        for variant in bd.VARIANTS:
            marks[variant][key], minflt[variant][key] = [], []

        def timed(variant: str) -> None:
            current.clear()
            before = faults()
            current["start"] = now()
            result = run[variant]()
            current["end"] = now()
            del result
            current["freed"] = now()
            minflt[variant][key].append(faults() - before)
            current.setdefault("alloc", current["enqueue"])
            marks[variant][key].append([current[m] for m in bd.MARKS])

        hvdp.barrier()
        for variant in bd.VARIANTS:  # the first call of each: an estimate of the time per call
            timed(variant)
        first = marks[bd.VARIANTS[0]][key][0]
        estimate = (first[-1] - first[0]) / 1e9
        # Every rank makes the same number of calls: rank 0's.
        count = int(hvdp.broadcast_object(int(max(3, min(calls, budget / max(estimate, 1e-6)))), 0))
        for _ in range(warmup + count):
            for variant in bd.VARIANTS:
                timed(variant)

    try:
        for nbytes in sizes:
            measure(nbytes)
    finally:
        hvd.allreduce_async, mpi_ops._allreduce_async, hvd.synchronize, mpi_ops.synchronize = originals
        exchange.reduce, exchange.entry = reduce, entry  # type: ignore[method-assign]
        direct_calls._RING.entry = ring
    mine = {"marks": marks, "faults": minflt, "offset_ns": _clock_offset_ns()}
    every = hvdp.allgather_object(mine)
    hvdp.shutdown()
    if rank != 0:
        return rank, {}
    parsed = bd.parse_timeline(open(timeline).read())
    phases: dict = {}
    fault_out: dict = {}
    for name_index, variant in enumerate(bd.VARIANTS):
        phases[variant], fault_out[variant] = {}, {}
        for nbytes in sizes:
            key = str(nbytes)
            per_rank = {r: {"marks": rec["marks"][variant][key], "offset_ns": rec["offset_ns"]}
                        for r, rec in enumerate(every)}
            skip = 1 + warmup  # the estimating call and the warm-up calls are left out
            # A direct call is not in Horovod's timeline (any under MPI is: it took Horovod's path).
            direct = variant == bd.DIRECT and f"allreduce.breakdown.{name_index}.{nbytes}" not in parsed.calls
            rows = bd.call_phases(per_rank, None if direct else parsed, f"allreduce.breakdown.{name_index}.{nbytes}",
                                  skip)
            phases[variant][key] = {str(r): v for r, v in rows.items()}
            fault_out[variant][key] = {str(r): rec["faults"][variant][key][skip:] for r, rec in enumerate(every)}
    env = {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_") and k != "HOROVOD_TIMELINE"}
    return rank, {"controller": controller, "size": size, "phases": phases, "faults": fault_out, "env": env}
