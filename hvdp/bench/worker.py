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
import resource
import time
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from hvdp.bench import models

#: Synthetic batches per rank, cycled through (enough to defeat caching, small in memory).
POOL = 4


def _write(out: str, record: dict) -> None:
    tmp = out + ".tmp"
    with open(tmp, "w") as handle:
        json.dump(record, handle)
    os.replace(tmp, out)


#: CPU seconds (all threads of this process, user + system) per measured step, set by _timed_steps.
CPU_PER_STEP: List[float] = []


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _timed_steps(step: Callable[[int], None], warmup: int, steps: int) -> List[float]:
    """Wall seconds of each measured step (after ``warmup`` unmeasured ones); CPU time in CPU_PER_STEP."""
    for i in range(warmup):
        step(i)
    times = []
    cpu = _cpu_seconds()
    for i in range(steps):
        start = time.perf_counter()
        step(warmup + i)
        times.append(time.perf_counter() - start)
    CPU_PER_STEP[:] = [(_cpu_seconds() - cpu) / max(1, steps)]
    return times


# --- torch -----------------------------------------------------------------------------------

def _torch_train(impl: str, model_name: str, batch: int, warmup: int, steps: int) -> Tuple[int, int, List[float]]:
    import torch
    import torch.nn.functional as F  # noqa: N812

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    model = models.build("torch", model_name)
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
    xs, ys = models.synthetic_batches(model_name, batch, POOL, seed=1000 + rank)
    x, y = torch.from_numpy(xs), torch.from_numpy(ys)

    def step(i: int) -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[i % POOL]), y[i % POOL])
        loss.backward()
        optimizer.step()

    times = _timed_steps(step, warmup, steps)
    if impl == "ddp":
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return rank, size, times


# --- TensorFlow ------------------------------------------------------------------------------

def _tf_train(impl: str, model_name: str, batch: int, warmup: int, steps: int) -> Tuple[int, int, List[float]]:
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import tensorflow as tf

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                         reduction="sum_over_batch_size")
    strategy: Optional[Any] = None
    if impl == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        rank, size = int(json.loads(os.environ["TF_CONFIG"])["task"]["index"]), strategy.num_replicas_in_sync
        with strategy.scope():
            model = models.build("tensorflow", model_name)
            optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
            model.build((None, *_keras_shape(model_name)))
            optimizer.build(model.trainable_variables)
    else:
        model = models.build("tensorflow", model_name)
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        optimizer.build(model.trainable_variables)
    reduce: Optional[Callable[[List[Any]], List[Any]]] = None
    if impl == "hvdp":
        import hvdp

        hvdp.init(framework="tensorflow")
        rank, size = hvdp.rank(), hvdp.size()
        optimizer = hvdp.DistributedOptimizer(optimizer)
        hvdp.broadcast_state(model, optimizer)
    elif impl == "horovod":
        import horovod.tensorflow as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        for variable in model.variables:
            variable.assign(hvd.broadcast(tf.convert_to_tensor(variable), 0))

        def reduce(grads: List[Any]) -> List[Any]:
            # What horovod.tensorflow.DistributedGradientTape does (it fails on Keras 3 variables).
            return [hvd.allreduce(g, op=hvd.Average) for g in grads]
    elif impl == "single":
        rank, size = 0, 1
    elif impl != "mwms":
        raise ValueError(f"Unknown TensorFlow training implementation {impl!r}.")
    xs, ys = models.synthetic_batches(model_name, batch, POOL, seed=1000 + rank)
    if len(xs.shape) == 5:
        xs = np.ascontiguousarray(xs.transpose(0, 1, 3, 4, 2))
    x, y = tf.constant(xs), tf.constant(ys)
    variables = model.trainable_variables

    if strategy is None:
        @tf.function(jit_compile=False)
        def train(features: Any, labels: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = loss_fn(labels, model(features, training=True))
            grads = tape.gradient(loss, variables)
            if reduce is not None:
                grads = reduce(grads)
            optimizer.apply_gradients(zip(grads, variables))
            return loss

        def step(i: int) -> None:
            float(train(x[i % POOL], y[i % POOL]))
    else:
        global_batch = batch * size
        per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

        @tf.function(jit_compile=False)
        def replica_step(features: Any, labels: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(per_example(labels, model(features, training=True))) / global_batch
            grads = tape.gradient(loss, variables)
            optimizer.apply_gradients(zip(grads, variables))
            return loss

        @tf.function(jit_compile=False)
        def train_mwms(features: Any, labels: Any) -> Any:
            per_replica = strategy.run(replica_step, args=(features, labels))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        def step(i: int) -> None:
            float(train_mwms(x[i % POOL], y[i % POOL]))

    times = _timed_steps(step, warmup, steps)
    return rank, size, times


def _keras_shape(model_name: str) -> Tuple[int, ...]:
    shape = models.INPUT_SHAPES[model_name]
    return (shape[1], shape[2], shape[0]) if len(shape) == 3 else shape


# --- allreduce -------------------------------------------------------------------------------

def _allreduce(impl: str, sizes: List[int], budget: float) -> Tuple[int, int, dict]:
    """Seconds per allreduce of each size (float32, bytes given), median of timed repetitions."""
    import torch

    if impl == "hvdp":
        import hvdp

        hvdp.init(framework="torch")
        rank, size = hvdp.rank(), hvdp.size()

        def make(nbytes: int) -> Callable[[], None]:
            tensor = torch.ones(nbytes // 4)
            name = f"bench.{nbytes}"
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
    parser.add_argument("task", choices=("train", "allreduce"))
    parser.add_argument("--impl", required=True)
    parser.add_argument("--framework", default="torch", choices=("torch", "tensorflow"))
    parser.add_argument("--model", default="cnn", choices=models.MODELS)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sizes", default="4096")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timed allreduces per size")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.task == "train":
        train = _torch_train if args.framework == "torch" else _tf_train
        rank, size, times = train(args.impl, args.model, args.batch, args.warmup, args.steps)
        record: dict = {"rank": rank, "size": size, "batch": args.batch, "step_seconds": times,
                        "cpu_seconds_per_step": CPU_PER_STEP[0]}
    else:
        rank, size, by_size = _allreduce(args.impl, [int(s) for s in args.sizes.split(",")], args.budget)
        record = {"rank": rank, "size": size, "seconds": by_size}
    if rank == 0:
        _write(args.out, record)
    if args.impl == "hvdp":
        import hvdp

        hvdp.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
