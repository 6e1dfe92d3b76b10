"""Training loops run by Ray Train workers under hvdp.ray (tests/parallel/test_ray.py,
tests/cluster/test_ray_two_nodes.py). Each worker writes what it saw to ``config["out"]/rank<N>.json``.

The test pickles this module by value (Ray's workers do not have tests/ on their path).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List

import numpy as np

#: Examples per worker per step, steps, features, classes of the torch equivalence loop.
BATCH, STEPS, FEATURES, CLASSES = 8, 6, 12, 3


def _write(config: Dict[str, Any], rank: int, record: Dict[str, Any]) -> None:
    with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)


def data(size: int) -> tuple:
    """The union of every worker's batches, in step order: (x, y) for STEPS steps of ``size`` workers."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(STEPS * BATCH * size, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=STEPS * BATCH * size).astype(np.int64)
    return x, y


def models(torch: Any) -> List[Any]:
    """The two models (one per optimizer), seeded differently on each call site's rank before broadcast."""
    return [torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))
            for _ in range(2)]


def torch_union(config: Dict[str, Any]) -> None:
    """SGD through DistributedOptimizer and Adam sharded (ZeRO-1), each worker on its part of every step's
    batch; the sampler, collectives, drift guard, Ray's context, report and Data shard beside them."""
    import ray.train
    import torch

    import hvdp

    entered = time.time()
    hvdp.init()
    rank, size = hvdp.rank(), hvdp.size()
    context = ray.train.get_context()
    torch.manual_seed(100 + rank)  # different weights on each worker: broadcast_state must equalize them
    sgd_model, adam_model = models(torch)
    sgd = hvdp.DistributedOptimizer(torch.optim.SGD(sgd_model.parameters(), lr=0.1), sgd_model)
    adam = hvdp.DistributedOptimizer(torch.optim.Adam(adam_model.parameters(), lr=0.01), adam_model,
                                     shard_optimizer_state=True)
    hvdp.broadcast_state(sgd_model, sgd)
    hvdp.broadcast_state(adam_model, adam)
    start = [[p.detach().numpy().tolist() for p in m.parameters()] for m in (sgd_model, adam_model)]
    x, y = data(size)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(STEPS):
        mine = slice((step * size + rank) * BATCH, (step * size + rank + 1) * BATCH)
        for model, optimizer in ((sgd_model, sgd), (adam_model, adam)):
            optimizer.zero_grad()
            loss_fn(model(torch.from_numpy(x[mine])), torch.from_numpy(y[mine])).backward()
            optimizer.step()
    ray.train.report({"steps": STEPS})  # once: every report is a round trip through Ray's controller
    hvdp.check_consistency(sgd_model)
    hvdp.check_consistency(adam_model)
    keras_backend, keras_weights = keras_on_torch(rank, x, y)
    sampler = hvdp.DistributedSampler(list(range(10)), seed=3)
    sampler.set_epoch(1)
    rows = sum(1 for _ in ray.train.get_dataset_shard("train").iter_rows())
    _write(config, rank, {
        "rank": rank, "size": size, "local_rank": hvdp.local_rank(), "local_size": hvdp.local_size(),
        "cross_rank": hvdp.cross_rank(), "cross_size": hvdp.cross_size(), "framework": hvdp.framework(),
        "ray": [context.get_world_rank(), context.get_world_size(), context.get_local_rank(),
                context.get_local_world_size(), context.get_node_rank()],
        "env": {var: os.environ.get(var) for var in ("HVDP_FRAMEWORK", "KERAS_BACKEND", "OMP_NUM_THREADS",
                                                      "TF_NUM_INTRAOP_THREADS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS",
                                                      "HOROVOD_GLOO_IFACE", "HOROVOD_HOSTNAME")},
        "torch_threads": torch.get_num_threads(),
        "start": start, "end": [[p.detach().numpy().tolist() for p in m.parameters()] for m in (sgd_model, adam_model)],
        "allreduce": float(hvdp.allreduce(float(rank + 1), op="sum")),
        "allgather": hvdp.allgather(np.array([rank], dtype=np.int64)).tolist(),
        "broadcast_object": hvdp.broadcast_object({"from": rank}, root_rank=0),
        "sampler": list(sampler), "data_rows": rows, "entered": entered,
        "keras_backend": keras_backend, "keras_weights": keras_weights})
    hvdp.barrier()


def keras_on_torch(rank: int, x: np.ndarray, y: np.ndarray) -> tuple:
    """A Keras 3 model fit on this worker's rows, in a torch job (Keras on the torch backend): (backend, weights)."""
    import keras

    import hvdp

    keras.utils.set_random_seed(300 + rank)
    model = keras.Sequential([keras.Input(shape=(FEATURES,)), keras.layers.Dense(CLASSES)])
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hvdp.broadcast_state(model, optimizer)
    model.fit(x[rank::2], y[rank::2], batch_size=BATCH, epochs=1, verbose=0)
    return keras.backend.backend(), np.concatenate([w.numpy().ravel() for w in model.weights]).tolist()


def keras_fit(config: Dict[str, Any]) -> None:
    """Keras 3 model.fit on each worker's own shard of a tf.data dataset; the replicas must end identical."""
    import hvdp

    hvdp.init()
    import keras
    import tensorflow as tf

    rank, size = hvdp.rank(), hvdp.size()
    keras.utils.set_random_seed(200 + rank)
    model = keras.Sequential([keras.Input(shape=(12,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hvdp.broadcast_state(model, optimizer)
    start = np.concatenate([w.numpy().ravel() for w in model.weights])
    x, y = data(size)
    dataset = hvdp.shard_dataset(tf.data.Dataset.from_tensor_slices((x, y))).batch(BATCH)
    model.fit(dataset, epochs=2, verbose=0)
    weights = np.concatenate([w.numpy().ravel() for w in model.weights])
    _write(config, rank, {"rank": rank, "size": size, "framework": hvdp.framework(),
                          "keras_backend": keras.backend.backend(), "env_keras": os.environ.get("KERAS_BACKEND"),
                          "weights": weights.tolist(), "moved": float(np.abs(weights - start).max())})


def stall(config: Dict[str, Any]) -> None:
    """Worker 1 stops taking part in collectives after the first; worker 0 goes on."""
    import hvdp

    hvdp.init()
    hvdp.allreduce(1.0, name="warm_up")
    if hvdp.rank() == 1:
        time.sleep(600)
    hvdp.allreduce(np.ones(4, dtype=np.float32), name="never_joined")
