"""The allreduce data path on either framework: ``out=`` (and its refusals) and the early wake.

Each rank reports the results of ``hvdp.allreduce`` with and without ``out=``, the
errors bad ``out=`` values raise, and how long a blocking 4 KB allreduce and a
gradient step took. The test runs it with a long HOROVOD_CYCLE_TIME (200 ms), with
the early wake on and off: woken, a call ends well inside one cycle; not woken, it
waits for the next one.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Callable, Dict

import numpy as np

import hvdp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _report

CALLS = 5


def median_ms(call: Callable[[], Any]) -> float:
    call()  # negotiated once (the response cache), as every later step is
    times = []
    for _ in range(CALLS):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def torch_checks(rank: int, record: Dict[str, Any]) -> None:
    import torch

    value = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1)
    plain = hvdp.allreduce(value, op="sum", name="plain")
    out = torch.full((2, 3), -1.0)
    returned = hvdp.allreduce(value, op="sum", name="out", out=out)
    record["out_is_returned"] = returned is out
    record["value_unchanged"] = value.tolist() == (torch.arange(6, dtype=torch.float32).reshape(2, 3)
                                                   * (rank + 1)).tolist()
    record["out"], record["plain"] = out.tolist(), plain.tolist()
    inplace = value.clone()
    hvdp.allreduce(inplace, op="average", name="inplace", out=inplace)
    record["inplace_average"] = inplace.tolist()
    array = np.full(4, rank + 1, dtype=np.float64)
    array_out = np.empty_like(array)
    record["numpy_out"] = hvdp.allreduce(array, op="sum", name="np", out=array_out).tolist()
    record["numpy_out_written"] = array_out.tolist()
    leaf = torch.zeros(3, requires_grad=True)
    hvdp.allreduce(torch.ones(3) * (rank + 1), op="sum", name="leaf", out=leaf)
    record["leaf_out"] = leaf.tolist()
    record["refusals"] = {
        "shape": _report.refusal(lambda: hvdp.allreduce(value, out=torch.empty(3, 2))),
        "dtype": _report.refusal(lambda: hvdp.allreduce(value, out=torch.empty(2, 3, dtype=torch.float64))),
        "number": _report.refusal(lambda: hvdp.allreduce(1.0, out=torch.empty(1))),
        "kind": _report.refusal(lambda: hvdp.allreduce(value, out=np.empty((2, 3), np.float32))),
        "strided": _report.refusal(lambda: hvdp.allreduce(value, out=torch.empty(3, 2).t())),
    }

    small = torch.ones(1024)  # 4 KB
    record["allreduce_4k_ms"] = median_ms(lambda: hvdp.allreduce(small, op="sum", name="small"))
    record["allreduce_4k_out_ms"] = median_ms(lambda: hvdp.allreduce(small, op="sum", name="small_out", out=small))
    import horovod.torch as hvd  # Horovod's own calls: the build's loop wakes at their enqueue

    record["allgather_4k_ms"] = median_ms(lambda: hvd.allgather(small, name="gather"))
    record["reducescatter_4k_ms"] = median_ms(lambda: hvd.reducescatter(small, name="scatter"))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def step() -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    record["step_ms"] = median_ms(step)


def tensorflow_checks(rank: int, record: Dict[str, Any]) -> None:
    import keras
    import tensorflow as tf

    value = tf.reshape(tf.range(6, dtype=tf.float32), (2, 3)) * (rank + 1)
    plain = hvdp.allreduce(value, op="sum", name="plain")
    out = tf.Variable(tf.fill((2, 3), -1.0))
    returned = hvdp.allreduce(value, op="sum", name="out", out=out)
    record["out_is_returned"] = returned is out
    record["value_unchanged"] = value.numpy().tolist() == (np.arange(6, dtype=np.float32).reshape(2, 3)
                                                           * (rank + 1)).tolist()
    record["out"], record["plain"] = out.numpy().tolist(), plain.numpy().tolist()
    inplace = tf.Variable(value)
    hvdp.allreduce(inplace, op="average", name="inplace", out=inplace)
    record["inplace_average"] = inplace.numpy().tolist()
    array = np.full(4, rank + 1, dtype=np.float64)
    array_out = np.empty_like(array)
    record["numpy_out"] = hvdp.allreduce(array, op="sum", name="np", out=array_out).tolist()
    record["numpy_out_written"] = array_out.tolist()
    record["refusals"] = {
        "shape": _report.refusal(lambda: hvdp.allreduce(value, out=tf.Variable(tf.zeros((3, 2))))),
        "dtype": _report.refusal(lambda: hvdp.allreduce(value, out=tf.Variable(tf.zeros((2, 3), tf.float64)))),
        "number": _report.refusal(lambda: hvdp.allreduce(1.0, out=tf.Variable(tf.zeros(1)))),
        "kind": _report.refusal(lambda: hvdp.allreduce(value, out=np.empty((2, 3), np.float32))),
        "immutable": _report.refusal(lambda: hvdp.allreduce(value, out=tf.zeros((2, 3)))),
    }

    small = tf.ones(1024)  # 4 KB; TensorFlow's eager op blocks inside Horovod: no wake for it
    record["allreduce_4k_ms"] = median_ms(lambda: hvdp.allreduce(small, op="sum", name="small"))
    import horovod.tensorflow as hvd  # its eager allgather and reducescatter wake the loop at their enqueue

    record["allgather_4k_ms"] = median_ms(lambda: hvd.allgather(small, name="gather"))
    record["reducescatter_4k_ms"] = median_ms(lambda: hvd.reducescatter(small, name="scatter"))

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)])
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.SGD(0.01), model)
    x, y = tf.random.normal((8, 16)), tf.random.uniform((8,), 0, 4, tf.int64)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step() -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)  # 4 gradients: one grouped allreduce

    record["step_ms"] = median_ms(step)

    # A sharded optimizer's update in a traced step: a reducescatter, then an allgather, each woken.
    sharded = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(4)])
    zero = hvdp.DistributedOptimizer(keras.optimizers.Adam(0.01), shard_optimizer_state=True)
    zero.build(sharded.trainable_variables)

    @tf.function
    def traced() -> None:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, sharded(x))
        zero.apply(tape.gradient(loss, sharded.trainable_variables), sharded.trainable_variables)

    record["sharded_step_ms"] = median_ms(traced)


def main() -> None:
    hvdp.init()
    rank = hvdp.rank()
    record: Dict[str, Any] = {"rank": rank, "framework": hvdp.framework(),
                              "cycle_ms": os.environ.get("HOROVOD_CYCLE_TIME"),
                              "early_wake": os.environ.get("HVDP_EARLY_WAKE", "1")}
    (torch_checks if hvdp.framework() == "torch" else tensorflow_checks)(rank, record)
    _report.write(rank, record)
    hvdp.shutdown()


if __name__ == "__main__":
    main()
