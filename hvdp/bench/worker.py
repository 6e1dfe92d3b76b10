"""One benchmark process: trains a model or times allreduces, and rank 0 writes the times as JSON.

Started by :mod:`hvdp.bench` under ``hvdp run`` / ``horovodrun`` (``--impl hvdp``, ``horovod``,
``mpi4py``), ``torchrun`` (``ddp``, ``torchdist``) or as a TF_CONFIG worker (``mwms``).
Every contender trains the same model on the same synthetic batches with plain SGD;
only the way gradients are reduced differs.

Example:
    >>> # hvdp run -np 2 --framework torch python -m hvdp.bench.worker train --impl hvdp --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable, List, Optional, Tuple

import numpy as np

from hvdp.bench import models, per_framework, timing
from hvdp.frameworks import SPECS


def _write(out: str, record: dict) -> None:
    tmp = out + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(record, handle)
    os.replace(tmp, out)


# --- allreduce -------------------------------------------------------------------------------

def _allreduce(impl: str, sizes: List[int], budget: float, form: str = "new") -> Tuple[int, int, dict]:
    """Seconds per allreduce of each size (float32, bytes given), median of timed repetitions.

    hvdp's ``form``: "new" returns a new tensor each call; "out" reduces in place (``out=``), as
    Horovod's ``allreduce_``, torch.distributed and mpi4py (into its receive buffer) do.
    """
    import torch

    if impl == "hvdp":
        import hvdp

        hvdp.init(framework="torch")
        rank, size = hvdp.rank(), hvdp.size()

        def make(nbytes: int) -> Callable[[], None]:
            tensor = torch.ones(nbytes // 4)
            name = f"bench.{nbytes}"
            if form == "out":
                return lambda: hvdp.allreduce(tensor, op="sum", name=name, out=tensor)
            return lambda: hvdp.allreduce(tensor, op="sum", name=name)

        sync: Callable[[], None] = hvdp.barrier
    elif impl == "horovod":  # Horovod's own in-place op: no copy, no output tensor
        import horovod.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()

        def make(nbytes: int) -> Callable[[], None]:
            tensor = torch.ones(nbytes // 4)
            name = f"bench.{nbytes}"
            return lambda: hvd.allreduce_(tensor, op=hvd.Sum, name=name)

        sync = hvd.barrier
    elif impl == "mpi4py":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()

        def make(nbytes: int) -> Callable[[], None]:
            send, recv = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
            return lambda: comm.Allreduce(send, recv, op=MPI.SUM)

        sync = comm.Barrier
    elif impl == "torchdist":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()

        def make(nbytes: int) -> Callable[[], None]:
            tensor = torch.ones(nbytes // 4)
            return lambda: dist.all_reduce(tensor)

        sync = dist.barrier
    else:
        raise ValueError(f"Unknown allreduce implementation {impl!r}.")
    results = {}
    for nbytes in sizes:
        call = make(nbytes)
        for _ in range(2):
            call()
        # About `budget` seconds per size: estimate from one call, then 5..200 repetitions.
        sync()
        start = time.perf_counter()
        call()
        estimate = time.perf_counter() - start
        reps = int(max(5, min(200, budget / max(estimate, 1e-6))))
        # Every rank must run the same count: take rank 0's.
        reps = _agree(impl, reps)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        results[str(nbytes)] = times
    if impl == "torchdist":
        import torch.distributed as dist

        dist.destroy_process_group()
    return rank, size, results


def _agree(impl: str, value: int) -> int:
    """Rank 0's ``value`` on every rank."""
    if impl == "hvdp":
        import hvdp

        return int(hvdp.broadcast_object(value, 0))
    if impl == "horovod":
        import horovod.torch as hvd

        return int(hvd.broadcast_object(value, 0, name="bench.agree"))
    if impl == "mpi4py":
        from mpi4py import MPI

        return int(MPI.COMM_WORLD.bcast(value, root=0))
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def main(argv: Optional[List[str]] = None) -> int:
    """Run one benchmark process as the command line says; rank 0 writes ``--out``."""
    parser = argparse.ArgumentParser(prog="python -m hvdp.bench.worker")
    parser.add_argument("task", choices=("train", "allreduce", "breakdown"))
    parser.add_argument("--impl", required=True)
    parser.add_argument("--framework", default="torch", choices=tuple(SPECS))
    parser.add_argument("--model", default="cnn", choices=models.MODELS)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sizes", default="4096")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timed allreduces per size")
    parser.add_argument("--form", default="new", choices=("new", "out"), help="allreduce: hvdp's call form")
    parser.add_argument("--calls", type=int, default=20, help="breakdown: timed calls per size and variant (most)")
    parser.add_argument("--timeline", help="breakdown: where rank 0 writes Horovod's timeline (default: --out's)")
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adam"), help="train: the optimizer")
    parser.add_argument("--shard", action="store_true",
                        help="train: hvdp's shard_optimizer_state=True (ddp: torch's ZeroRedundancyOptimizer)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.task == "train":
        bench = per_framework.load(args.framework)
        options = {"optimizer": args.optimizer, "shard": True} if args.shard else \
            {"optimizer": args.optimizer} if args.optimizer != "sgd" else {}
        rank, size, times = bench.train(args.impl, args.model, args.batch, args.warmup, args.steps, **options)
        record: dict = {"rank": rank, "size": size, "batch": args.batch, "step_seconds": times,
                        "cpu_seconds_per_step": timing.CPU_PER_STEP[0]}
        if timing.MEMORY:
            record["memory"] = dict(timing.MEMORY)
    elif args.task == "breakdown":
        from hvdp.bench import torch_bench

        rank, record = torch_bench.breakdown([int(s) for s in args.sizes.split(",")], args.calls, args.warmup,
                                             args.budget, args.timeline or args.out + ".timeline.json")
        if rank == 0:
            _write(args.out, record)
        return 0  # the job is shut down already
    else:
        rank, size, by_size = _allreduce(args.impl, [int(s) for s in args.sizes.split(",")], args.budget, args.form)
        record = {"rank": rank, "size": size, "seconds": by_size}
    if rank == 0:
        _write(args.out, record)
    if args.impl == "hvdp":
        import hvdp

        hvdp.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
