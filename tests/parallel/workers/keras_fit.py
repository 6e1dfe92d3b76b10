"""One Keras 3 worker for both Keras backends (the framework comes from hvdp run --framework).

Reports: the Keras backend in use; broadcast_state; model.fit on different data per rank
against one process trained on the union of the batches; and the hvdp.keras callbacks.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

import hvdp

hvdp.init()  # before importing keras: it sets KERAS_BACKEND to the framework

import keras

import hvdp.keras

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _keras_sharded
import _report
from _report import compare, digest

FEATURES, CLASSES, PER_RANK_BATCH, STEPS = 16, 4, 16, 3


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input(shape=(FEATURES,)), keras.layers.Dense(32, activation="tanh"),
                             keras.layers.Dense(CLASSES)])


def flat(model: keras.Model) -> np.ndarray:
    return np.concatenate([keras.ops.convert_to_numpy(v).reshape(-1) for v in model.trainable_variables]
                          ).astype(np.float64)


def rank_data(rank: int, n: int) -> tuple:
    data = np.random.default_rng(100 + rank)
    return data.normal(size=(n, FEATURES)).astype(np.float32), data.integers(0, CLASSES, size=n)


def loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def fit_against_union(rank: int, size: int) -> dict:
    model = make_model(seed=rank)  # different on every rank ...
    before = flat(model)
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=optimizer, loss=loss())
    hvdp.broadcast_state(model, optimizer)  # ... until broadcast
    start = flat(model)
    x, y = rank_data(rank, PER_RANK_BATCH * STEPS)
    shm, on_torch = None, keras.backend.backend() == "torch"
    if on_torch:  # its direct updates through shared memory (threshold lowered: 1 byte)
        from hvdp.backends.torch.direct import allreduce as direct_allreduce
        from hvdp.backends.torch.direct import shm as direct_shm
        shm, least = direct_allreduce.local_memory(), direct_shm.SHM_MIN_BYTES
        served, direct_shm.SHM_MIN_BYTES = (shm.served if shm is not None else 0), 1
    try:
        model.fit(x, y, batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0)
    finally:
        if on_torch:
            direct_shm.SHM_MIN_BYTES = least
    shared = shm.served - served if shm is not None else None

    # One process, same start (rank 0's), each step on the union of the ranks' batches.
    reference = make_model(seed=0)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss())
    parts = [rank_data(r, PER_RANK_BATCH * STEPS) for r in range(size)]
    steps = [(np.concatenate([p[0][s * PER_RANK_BATCH:(s + 1) * PER_RANK_BATCH] for p in parts]),
              np.concatenate([p[1][s * PER_RANK_BATCH:(s + 1) * PER_RANK_BATCH] for p in parts]))
             for s in range(STEPS)]
    reference.fit(np.concatenate([s[0] for s in steps]), np.concatenate([s[1] for s in steps]),
                  batch_size=PER_RANK_BATCH * size, epochs=1, shuffle=False, verbose=0)
    return {"before": digest(before), "start": digest(start), "after": flat(model).tolist(),
            "vs_union": compare(flat(model), flat(reference)), "moved": float(np.max(np.abs(flat(model) - start))),
            "path": dict(getattr(optimizer, "_hvdp_gradient_path", None).counts)  # the direct path
            if getattr(optimizer, "_hvdp_gradient_path", None) is not None else None, "shared memory calls": shared}


def callbacks(rank: int, size: int) -> dict:
    model = make_model(seed=rank)
    model.compile(optimizer=hvdp.DistributedOptimizer(keras.optimizers.SGD(0.2)), loss=loss())
    x, y = rank_data(50 + rank, 64)
    before = flat(model)
    seen_lr: list = []
    record_lr = keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: seen_lr.append(
        float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))))
    seen_losses: list = []  # what a user's callback reads: the ranks' loss already (hvdp._keras_fit)
    record_loss = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: seen_losses.append(logs["loss"]))
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False, callbacks=[
        hvdp.keras.BroadcastInitialState(), hvdp.keras.LearningRateWarmup(warmup_epochs=2), record_lr, record_loss,
        hvdp.keras.MetricAverage()])
    return {"before": digest(before), "after": digest(flat(model)), "lr": seen_lr,
            "final_lr": float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)),
            "history": [float(v) for v in history.history["loss"]], "seen_losses": seen_losses}


def schedules(rank: int, size: int) -> dict:
    """LearningRateWarmup then LearningRateSchedule on SGD with momentum 0.9, with and without momentum
    correction, against one process on the union of the batches; the momentum buffers read around each
    change of rate; hvdp.keras.ModelCheckpoint writing on rank 0 only."""
    batches_per_epoch, epochs = 4, 3
    parts = [rank_data(300 + r, PER_RANK_BATCH * batches_per_epoch) for r in range(size)]
    x, y = parts[rank]
    union = [(np.concatenate([p[0][s * PER_RANK_BATCH:(s + 1) * PER_RANK_BATCH] for p in parts]),
              np.concatenate([p[1][s * PER_RANK_BATCH:(s + 1) * PER_RANK_BATCH] for p in parts]))
             for s in range(batches_per_epoch)]
    folder = os.path.join(os.environ["HVDP_TEST_OUT"], "checkpoints")
    os.makedirs(folder, exist_ok=True)

    class Counted(hvdp.keras.ModelCheckpoint):
        saves = 0

        def _save_model(self, *args: Any, **kwargs: Any) -> None:
            Counted.saves += 1
            super()._save_model(*args, **kwargs)

    def run(distributed: bool, correction: bool) -> tuple:
        model = make_model(seed=0)
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        model.compile(optimizer=hvdp.DistributedOptimizer(optimizer) if distributed else optimizer, loss=loss())
        seen: list = []  # (where, learning rate, sum of |momentum buffers|)

        def probe(where: str) -> Any:
            return lambda batch, logs: seen.append((where, float(keras.ops.convert_to_numpy(
                model.optimizer.learning_rate)), float(sum(np.abs(keras.ops.convert_to_numpy(m)).sum()
                                                          for m in getattr(model.optimizer, "momentums", [])))))

        extra = [Counted(os.path.join(folder, "ckpt-{epoch}.weights.h5"), save_weights_only=True)] \
            if distributed and correction else []
        data = (x, y) if distributed else (np.concatenate([u[0] for u in union]), np.concatenate([u[1] for u in union]))
        model.fit(*data, batch_size=PER_RANK_BATCH * (1 if distributed else size), epochs=epochs, shuffle=False,
                  verbose=0, callbacks=[
                      hvdp.keras.LearningRateWarmup(warmup_epochs=1, momentum_correction=correction),
                      hvdp.keras.LearningRateSchedule(start_epoch=1, multiplier=lambda epoch: 0.5 ** epoch,
                                                      momentum_correction=correction),
                      keras.callbacks.LambdaCallback(on_train_batch_begin=probe("begin"),
                                                     on_train_batch_end=probe("end")), *extra])
        return model, seen

    corrected, seen = run(True, True)
    plain, seen_plain = run(True, False)
    reference, _ = run(False, True)
    hvdp.barrier()
    restored = make_model(seed=1)
    restored.load_weights(os.path.join(folder, f"ckpt-{epochs}.weights.h5"))
    return {"lr": [lr for where, lr, _ in seen if where == "begin"], "seen": seen, "seen_plain": seen_plain,
            "vs_union": compare(flat(corrected), flat(reference)),
            "correction_changes": float(np.max(np.abs(flat(corrected) - flat(plain)))),
            "digest": digest(flat(corrected)), "saves": Counted.saves, "files": sorted(os.listdir(folder)),
            "restored_equal": bool(np.array_equal(flat(restored), flat(corrected))),
            "refusals": {"steps": _report.refusal(lambda: hvdp.keras.LearningRateWarmup(steps_per_epoch=0)),
                         "end": _report.refusal(lambda: hvdp.keras.LearningRateSchedule(start_epoch=3, end_epoch=2)),
                         "multiplier": _report.refusal(lambda: hvdp.keras.LearningRateSchedule(multiplier="half"))}}


def sync_batch_norm(rank: int, size: int) -> dict:
    """hvdp.keras.SyncBatchNormalization in fit, from different weights per rank, against one process with
    keras.layers.BatchNormalization on the union of the batches: weights and moving statistics."""
    def model_with(norm: Any, seed: int) -> keras.Model:
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input(shape=(FEATURES,)), keras.layers.Dense(12), norm,
                                 keras.layers.Activation("tanh"), keras.layers.Dense(CLASSES)])

    parts = [rank_data(400 + r, PER_RANK_BATCH * STEPS) for r in range(size)]
    x, y = parts[rank]
    model = model_with(hvdp.keras.SyncBatchNormalization(momentum=0.5), seed=rank)
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    model.compile(optimizer=optimizer, loss=loss())
    hvdp.broadcast_state(model, optimizer)
    model.fit(x, y, batch_size=PER_RANK_BATCH, epochs=2, shuffle=False, verbose=0)
    reference = model_with(keras.layers.BatchNormalization(momentum=0.5), seed=0)
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss())
    union = [np.concatenate([p[i][s * PER_RANK_BATCH:(s + 1) * PER_RANK_BATCH] for p in parts])
             for i in (0, 1) for s in range(STEPS)]
    reference.fit(np.concatenate(union[:STEPS]), np.concatenate(union[STEPS:]), batch_size=PER_RANK_BATCH * size,
                  epochs=2, shuffle=False, verbose=0)

    def stats(m: keras.Model) -> np.ndarray:
        norm = m.layers[1]
        return np.concatenate([keras.ops.convert_to_numpy(norm.moving_mean),
                               keras.ops.convert_to_numpy(norm.moving_variance)]).astype(np.float64)

    return {"weights": compare(flat(model), flat(reference)), "stats": compare(stats(model), stats(reference)),
            "moved_stats": float(np.max(np.abs(stats(model) - np.concatenate([np.zeros(12), np.ones(12)])))),
            "digest": digest(np.concatenate([flat(model), stats(model)])),
            "facade": type(hvdp.SyncBatchNorm(momentum=0.9)).__name__ if hvdp.framework() == "tensorflow" else None,
            "refused": _report.refusal(lambda: hvdp.keras.SyncBatchNormalization(synchronized=True))}


def mixed_precision(rank: int, size: int) -> dict:
    """keras.mixed_precision ("mixed_float16") with hvdp.DistributedOptimizer(LossScaleOptimizer(SGD)): fit
    against one process on the union; a first batch that overflows on rank 1 only (every rank skips it, the
    scale halves alike); the other order refused in fit."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        def compiled(distributed: bool, seed: int) -> tuple:
            keras.utils.set_random_seed(seed)
            model = keras.Sequential([keras.Input(shape=(FEATURES,)), keras.layers.Dense(32, activation="tanh"),
                                      keras.layers.Dense(CLASSES, dtype="float32")])
            scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
            optimizer = hvdp.DistributedOptimizer(scaled) if distributed else scaled
            model.compile(optimizer=optimizer, loss=loss())
            return model, optimizer

        parts = [rank_data(500 + r, PER_RANK_BATCH * STEPS) for r in range(size)]
        x, y = parts[rank]
        model, optimizer = compiled(True, seed=rank)
        hvdp.broadcast_state(model, optimizer)
        start = flat(model)
        model.fit(x, y, batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0)
        reference, _ = compiled(False, seed=0)
        union = [np.concatenate([p[i][s * PER_RANK_BATCH:(s + 1) * PER_RANK_BATCH] for p in parts])
                 for i in (0, 1) for s in range(STEPS)]
        reference.fit(np.concatenate(union[:STEPS]), np.concatenate(union[STEPS:]), batch_size=PER_RANK_BATCH * size,
                      epochs=1, shuffle=False, verbose=0)

        overflowing, scaler = compiled(True, seed=0)
        hvdp.broadcast_state(overflowing, scaler)
        first = flat(overflowing)
        spoiled = x.copy()
        if rank == 1:
            spoiled[0] = 1e6  # beyond float16: inf in the forward, NaN gradients on this rank only
        overflowing.fit(spoiled[:PER_RANK_BATCH], y[:PER_RANK_BATCH], batch_size=PER_RANK_BATCH, epochs=1,
                        verbose=0, shuffle=False)
        after_overflow = {"unchanged": bool(np.array_equal(flat(overflowing), first)),
                          "scale": float(keras.ops.convert_to_numpy(scaler.dynamic_scale))}
        overflowing.fit(x, y, batch_size=PER_RANK_BATCH, epochs=1, verbose=0, shuffle=False)

        keras.utils.set_random_seed(0)
        inner = keras.Sequential([keras.Input(shape=(FEATURES,)), keras.layers.Dense(CLASSES, dtype="float32")])
        inner.compile(optimizer=keras.optimizers.LossScaleOptimizer(hvdp.DistributedOptimizer(
            keras.optimizers.SGD(0.1))), loss=loss())
        return {"vs_union": compare(flat(model), flat(reference)), "moved": float(np.max(np.abs(flat(model) - start))),
                "digest": digest(flat(model)), "overflow": after_overflow,
                "overflow_digest": digest(flat(overflowing)), "compute_dtype": model.layers[0].compute_dtype,
                "inner_refused": _report.refusal(lambda: inner.fit(x, y, batch_size=PER_RANK_BATCH, verbose=0))}
    finally:
        keras.mixed_precision.set_global_policy("float32")


def save_and_resume(rank: int, size: int) -> dict:
    """model.save on rank 0, keras.models.load_model on every rank, one more epoch: as if never stopped."""
    path = os.path.join(os.environ["HVDP_TEST_OUT"], "resume.keras")
    x, y = rank_data(200 + rank, PER_RANK_BATCH * STEPS)

    def compiled() -> keras.Model:
        model = make_model(seed=0)
        model.compile(optimizer=hvdp.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss=loss())
        return model

    uninterrupted = compiled()
    uninterrupted.fit(x, y, batch_size=PER_RANK_BATCH, epochs=2, shuffle=False, verbose=0)
    first = compiled()
    first.fit(x, y, batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0)
    if rank == 0:
        first.save(path)
    hvdp.barrier()
    loaded = keras.models.load_model(path)
    loaded.fit(x, y, batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0)

    # keras.callbacks.BackupAndRestore: a fit stopped after epoch 1, then the restarted script's fit.
    backup = os.path.join(os.environ["HVDP_TEST_OUT"], f"backup-rank{rank}")  # each replica its own copy

    class StoppedError(Exception):
        pass

    class StopAfterEpoch1(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            raise StoppedError()

    stopped = compiled()
    try:
        stopped.fit(x, y, batch_size=PER_RANK_BATCH, epochs=2, shuffle=False, verbose=0,
                    callbacks=[keras.callbacks.BackupAndRestore(backup), StopAfterEpoch1()])
    except StoppedError:
        pass
    restarted = compiled()
    restarted.fit(x, y, batch_size=PER_RANK_BATCH, epochs=2, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup)])
    return {"class": type(loaded.optimizer).__name__, "distributed": hvdp.keras.is_distributed(loaded.optimizer),
            "iterations": int(keras.ops.convert_to_numpy(loaded.optimizer.iterations)),
            "vs_uninterrupted": compare(flat(loaded), flat(uninterrupted)), "digest": digest(flat(loaded)),
            "backup": {"iterations": int(keras.ops.convert_to_numpy(restarted.optimizer.iterations)),
                       "vs_uninterrupted": compare(flat(restarted), flat(uninterrupted)),
                       "moved": float(np.max(np.abs(flat(restarted) - flat(stopped)))),
                       "digest": digest(flat(restarted))}}


def helper_model_on_one_rank(rank: int) -> dict:
    """A model built on rank 0 only (a teacher) shifts Keras's layer names there; fit still trains."""
    if rank == 0:
        teacher = make_model(seed=5)
        teacher(np.zeros((1, FEATURES), np.float32))
    model = make_model(seed=rank)
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=optimizer, loss=loss())
    hvdp.broadcast_state(model, optimizer)
    x, y = rank_data(300 + rank, 2 * PER_RANK_BATCH)
    start = time.perf_counter()
    model.fit(x, y, batch_size=PER_RANK_BATCH, epochs=1, shuffle=False, verbose=0)
    return {"seconds": time.perf_counter() - start, "first_layer": model.layers[0].name,
            "digest": digest(flat(model))}


def drift_in_fit(rank: int) -> dict:
    """No broadcast_state: the replicas start apart, and fit stops after its first batch saying so."""
    model = make_model(seed=rank)
    model.compile(optimizer=hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1), check_every=2), loss=loss())
    x, y = rank_data(400 + rank, 2 * PER_RANK_BATCH)
    try:
        model.fit(x, y, batch_size=PER_RANK_BATCH, epochs=1, verbose=0)
        return {"raised": None}
    except hvdp.ReplicaMismatchError as exc:
        return {"raised": str(exc)}


def drift_in_custom_loop(rank: int) -> dict:
    """An eager custom loop (GradientTape on TensorFlow, autograd on torch) steps the optimizer itself:
    without broadcast_state the guard stops it after step 1; with it, 3 steps run clean."""

    def gradients(model: keras.Model, x: np.ndarray, y: np.ndarray) -> list:
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                value = loss()(y, model(x, training=True))
            return tape.gradient(value, model.trainable_variables)
        model.zero_grad()
        loss()(y, model(x, training=True)).backward()
        return [variable.value.grad for variable in model.trainable_variables]

    def apply(optimizer: Any, grads: list, model: keras.Model) -> None:
        if keras.backend.backend() == "tensorflow":
            optimizer.apply(grads, model.trainable_variables)
            return
        import torch

        with torch.no_grad():
            optimizer.apply(grads, model.trainable_variables)

    out = {}
    for case in ("no_broadcast", "broadcast"):
        model = make_model(seed=rank)
        optimizer = hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1))
        if case == "broadcast":
            hvdp.broadcast_state(model, optimizer)
        x, y = rank_data(500 + rank, PER_RANK_BATCH)
        steps = 0
        try:
            for _ in range(3):
                apply(optimizer, gradients(model, x, y), model)
                steps += 1
            out[case] = {"raised": None, "steps": steps}
        except hvdp.ReplicaMismatchError as exc:
            out[case] = {"raised": str(exc), "steps": steps}
    return out


def uneven_fit(rank: int, size: int) -> dict:
    """hvdp.join around fit: rank r has 5 - r batches an epoch, 2 epochs. Against one process on the
    union of each step's batches, a rank that ran out padded with zero-weight samples (its zeros,
    averaged over size(): DDP's Join); MetricAverage runs after the epoch's join."""
    counts, epochs, batch = [5 - r for r in range(size)], 2, PER_RANK_BATCH
    model = make_model(seed=rank)
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.Adam(0.01), check_every=1)
    model.compile(optimizer=optimizer, loss=loss())
    hvdp.broadcast_state(model, optimizer)
    start = model.get_weights()
    x, y = rank_data(200 + rank, counts[rank] * batch)
    with hvdp.join(model, optimizer) as block:
        history = model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                            callbacks=[hvdp.keras.MetricAverage()])

    reference = make_model(seed=0)
    reference.set_weights(start)
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss())
    parts = [rank_data(200 + r, counts[r] * batch) for r in range(size)]
    xs, ys, weights = [], [], []
    for k in range(max(counts)):
        for r in range(size):
            stepping = k < counts[r]
            xs.append(parts[r][0][k * batch:(k + 1) * batch] if stepping else np.zeros((batch, FEATURES), np.float32))
            ys.append(parts[r][1][k * batch:(k + 1) * batch] if stepping else np.zeros(batch, np.int64))
            weights.append(np.full(batch, 1.0 if stepping else 0.0, np.float32))
    reference.fit(np.concatenate(xs), np.concatenate(ys), sample_weight=np.concatenate(weights),
                  batch_size=batch * size, epochs=epochs, shuffle=False, verbose=0)
    return {"last_rank": block.last_rank, "iterations": int(keras.ops.convert_to_numpy(optimizer.iterations)),
            "digest": digest(np.concatenate([flat(model), [float(keras.ops.convert_to_numpy(v).sum())
                                                           for v in optimizer.variables]])),
            "loss": history.history["loss"], "vs_reference": compare(flat(model), flat(reference))}


def main() -> None:
    rank, size = hvdp.rank(), hvdp.size()
    record = {"rank": rank, "framework": hvdp.framework(), "keras_backend": keras.backend.backend(),
              "fit": fit_against_union(rank, size), "callbacks": callbacks(rank, size),
              "schedules": schedules(rank, size), "sync_batch_norm": sync_batch_norm(rank, size),
              "mixed_precision": mixed_precision(rank, size),
              "resume": save_and_resume(rank, size),
              "helper": helper_model_on_one_rank(rank),
              "drift": drift_in_fit(rank), "custom_loop": drift_in_custom_loop(rank),
              "uneven": uneven_fit(rank, size), "sharded": _keras_sharded.report(rank, size)}
    _report.write(rank, record)
    hvdp.shutdown()


if __name__ == "__main__":
    main()
