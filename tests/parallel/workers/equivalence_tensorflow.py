"""TensorFlow/Keras 3: N replicas on N slices of a batch take the step one process takes on the
whole batch, through model.fit and through DistributedGradientTape. Plus the Keras callbacks,
check_consistency, the other collectives and bad input.

Every rank also runs the single-process reference itself (no collectives).
"""

from __future__ import annotations

import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import hvdp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _report
from _report import compare, digest

STEPS, GLOBAL_BATCH, FEATURES, CLASSES = 5, 64, 16, 4
OPTIONS = {
    "average": {},
    "sum": {"op": "sum"},
    "bpps2": {"backward_passes_per_step": 2},
    "fp16": {"compression": "fp16"},
    "adasum": {"op": "adasum"},
    "predivide": {"gradient_predivide_factor": 2.0},
    "groups2": {"groups": 2},  # the gradients in two requests
    "tape": {},
}
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_model(kind: str, seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    if kind == "mlp":
        layers = [keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(CLASSES)]
    else:
        layers = [keras.layers.Reshape((4, 4, 1)), keras.layers.Conv2D(6, 3, padding="same", activation="relu"),
                  keras.layers.Flatten(), keras.layers.Dense(CLASSES)]
    return keras.Sequential([keras.Input(shape=(FEATURES,)), *layers])


def make_optimizer(name: str) -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.1, momentum=0.9) if name == "sgd" else keras.optimizers.Adam(0.01)


def batches(size: int) -> list:
    data = np.random.default_rng(7)
    out = []
    for _ in range(STEPS):
        x = data.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32)
        y = data.integers(0, CLASSES, size=GLOBAL_BATCH)
        out.append([(x[r::size], y[r::size]) for r in range(size)])
    return out


def flat(model: keras.Model) -> np.ndarray:
    return np.concatenate([np.asarray(v).reshape(-1) for v in model.trainable_variables]).astype(np.float64)


def distributed_run(kind: str, opt_name: str, option: str, data: list, rank: int) -> np.ndarray:
    model = make_model(kind, seed=rank)  # different weights on every rank until broadcast_state: rank 0's
    if option == "tape":
        opt = make_optimizer(opt_name)
        hvdp.broadcast_state(model, opt)

        @tf.function
        def step(x: tf.Tensor, y: tf.Tensor) -> None:
            with tf.GradientTape() as tape:
                loss = LOSS(y, model(x, training=True))
            grads = hvdp.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))

        for batch in data:
            step(*batch[rank])
        return flat(model)
    opt = hvdp.DistributedOptimizer(make_optimizer(opt_name), **OPTIONS[option])
    model.compile(optimizer=opt, loss=LOSS)
    hvdp.broadcast_state(model, opt)
    x = np.concatenate([batch[rank][0] for batch in data])
    y = np.concatenate([batch[rank][1] for batch in data])
    per_rank = len(data[0][rank][0])
    model.fit(x, y, batch_size=per_rank // 2 if option == "bpps2" else per_rank, epochs=1, shuffle=False, verbose=0)
    return flat(model)


def reference_run(kind: str, opt_name: str, option: str, data: list, size: int) -> np.ndarray:
    model = make_model(kind)
    opt = make_optimizer(opt_name)
    for step in data:
        with tf.GradientTape() as tape:
            if option == "sum":
                loss = tf.add_n([LOSS(y, model(x, training=True)) for x, y in step])
            elif option == "bpps2":
                half = len(step[0][0]) // 2
                loss = tf.add_n([LOSS(y[:half], model(x[:half], training=True)) +
                                 LOSS(y[half:], model(x[half:], training=True)) for x, y in step]) / size
            else:
                loss = tf.add_n([LOSS(y, model(x, training=True)) for x, y in step]) / size
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return flat(model)


def equivalence(rank: int, size: int, only: list | None = None) -> dict:
    """Every case, or those named in ``only`` ('mlp/sgd/average', ...)."""
    data = batches(size)
    results = {}
    for kind in ("mlp", "cnn"):
        for opt_name in ("sgd", "adam"):
            if only is not None and not any(case.startswith(f"{kind}/{opt_name}/") for case in only):
                continue
            ref_avg = reference_run(kind, opt_name, "average", data, size)
            start = flat(make_model(kind))
            for option in OPTIONS:
                if only is not None and f"{kind}/{opt_name}/{option}" not in only:
                    continue
                try:
                    got = distributed_run(kind, opt_name, option, data, rank)
                except ValueError as exc:  # adasum under Gloo: the test checks the message
                    results[f"{kind}/{opt_name}/{option}"] = {"error": str(exc)}
                    continue
                ref = ref_avg if option in ("fp16", "adasum", "predivide", "tape", "groups2") else \
                    reference_run(kind, opt_name, option, data, size)
                if option == "average":
                    uncompressed = got
                if option == "fp16":
                    worst = int(np.argmax(np.abs(got - uncompressed)))
                    results[f"{kind}/{opt_name}/fp16_vs_uncompressed"] = {
                        "max_abs": float(np.abs(got - uncompressed)[worst]), "at_value": float(uncompressed[worst]),
                        "relative_l2": float(np.linalg.norm(got - uncompressed) / np.linalg.norm(uncompressed))}
                results[f"{kind}/{opt_name}/{option}"] = {
                    **compare(got, ref), "digest": digest(got), "moved": float(np.max(np.abs(got - start)))}
    return results


def consistency(rank: int) -> dict:
    model = make_model("mlp")
    hvdp.check_consistency(model)
    if rank == 1:
        kernel = model.trainable_variables[0]
        kernel.assign(kernel + 1e-3)
    try:
        hvdp.check_consistency(model)
        return {"raised": None}
    except hvdp.ReplicaMismatchError as exc:
        return {"raised": str(exc)}


def collectives(rank: int, size: int) -> dict:
    return {
        "allgather_tensor": hvdp.allgather(tf.fill((rank + 1, 2), float(rank))).numpy().tolist(),
        "allgather_numpy": hvdp.allgather(np.array([rank], dtype=np.int32)).tolist(),
        "allgather_number": hvdp.allgather(rank * 10),
        "broadcast_tensor": hvdp.broadcast(tf.constant([float(rank)] * 3), root_rank=1).numpy().tolist(),
        "broadcast_number": hvdp.broadcast(rank + 7, root_rank=0),
        "broadcast_object": hvdp.broadcast_object({"from": rank}, root_rank=1),
        "allgather_object": hvdp.allgather_object(("rank", rank)),
        "barrier": hvdp.barrier() is None,
    }


def bad_input(rank: int) -> dict:
    out = {}
    for case, call in {
        "optimizer_type": lambda: hvdp.DistributedOptimizer("adam"),
        "unknown_op": lambda: hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1), op="mean"),
        "unknown_compression": lambda: hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="int8"),
        "shape_mismatch": lambda: hvdp.allreduce(tf.zeros([3 + rank]), name="grad.w"),
        "dtype_mismatch": lambda: hvdp.allreduce(np.zeros(3, dtype=np.float32 if rank == 0 else np.float64),
                                                 name="grad.b"),
        "sync_batch_norm_on_tf": lambda: hvdp.SyncBatchNorm(8),
        "convert_on_tf": lambda: hvdp.convert_sync_batchnorm(keras.Sequential()),
        "bf16": lambda: hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1), compression="bf16"),
        "groups_zero": lambda: hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1), groups=0),
        "groups_kind": lambda: hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1), groups="all"),
        "groups_lists_keras": lambda: hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1), groups=[[0]]),
    }.items():
        start = time.perf_counter()
        try:
            call()
            out[case] = {"type": None}
        except Exception as exc:  # the test checks the type and message
            out[case] = {"type": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - start}
    out["after_errors"] = hvdp.allreduce(1.0, op="sum")
    return out


def main() -> None:
    hvdp.init()
    rank, size = hvdp.rank(), hvdp.size()
    only = os.environ.get("HVDP_EQUIVALENCE_ONLY")
    if only:  # a few cases at another size (test_equivalence's np=3 and np=6 jobs)
        _report.write(rank, {"rank": rank, "size": size,
                             "equivalence": equivalence(rank, size, only.split(","))})
        hvdp.shutdown()
        return
    record = {"rank": rank, "equivalence": equivalence(rank, size),
              "consistency": consistency(rank), "collectives": collectives(rank, size),
              "bad_input": bad_input(rank)}
    _report.write(rank, record)
    hvdp.shutdown()


if __name__ == "__main__":
    main()
