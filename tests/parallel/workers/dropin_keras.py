"""An existing horovod.tensorflow.keras script, unchanged, on Keras 3 (hvdp's Horovod build).

Only Horovod's own API: hvd.DistributedOptimizer in model.fit and in a custom loop,
hvd.callbacks (broadcast, metric average, warmup), hvd.load_model, and the same through
horovod.keras (the binding for the standalone keras package, which is Keras 3 now) with its
learning rate schedule callback. Every rank starts
from different weights and trains on different data; each result is compared with one
process (plain Keras, no Horovod) that trains on the union of the ranks' batches.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings

import horovod.keras as hvd_keras
import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf
from tensorflow import keras

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report
from _report import compare, digest, refusal

FEATURES, CLASSES, BATCH, STEPS = 12, 3, 8, 3


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input(shape=(FEATURES,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(CLASSES)])


def flat(model: keras.Model) -> np.ndarray:
    return np.concatenate([np.asarray(v).reshape(-1) for v in model.trainable_variables]).astype(np.float64)


def rank_data(rank: int, seed: int) -> tuple:
    data = np.random.default_rng(seed * 100 + rank)
    return (data.normal(size=(BATCH * STEPS, FEATURES)).astype(np.float32),
            data.integers(0, CLASSES, size=BATCH * STEPS))


def union(size: int, seed: int) -> tuple:
    """The ranks' batches, step by step: step s of one process is every rank's batch s."""
    parts = [rank_data(r, seed) for r in range(size)]
    xs = [np.concatenate([p[0][s * BATCH:(s + 1) * BATCH] for p in parts]) for s in range(STEPS)]
    ys = [np.concatenate([p[1][s * BATCH:(s + 1) * BATCH] for p in parts]) for s in range(STEPS)]
    return np.concatenate(xs), np.concatenate(ys)


def loss_fn() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def fit(rank: int, size: int) -> dict:
    """model.fit with hvd.DistributedOptimizer(Adam) and Horovod's callbacks."""
    model = make_model(seed=rank)
    before = flat(model)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=opt, loss=loss_fn())
    x, y = rank_data(rank, seed=1)
    local_losses: list = []
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: local_losses.append(logs["loss"])),
        hvd.callbacks.MetricAverageCallback()])

    reference = make_model(seed=0)
    reference.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss_fn())
    ux, uy = union(size, seed=1)
    reference.fit(ux, uy, batch_size=BATCH * size, epochs=2, shuffle=False, verbose=0)
    return {"before": digest(before), "after": flat(model).tolist(), "vs_union": compare(flat(model), flat(reference)),
            "moved": float(np.max(np.abs(flat(model) - flat(make_model(seed=0))))),
            "class": type(model.optimizer).__name__, "is_adam": isinstance(model.optimizer, keras.optimizers.Adam),
            "iterations": int(model.optimizer.iterations.numpy()),
            "history": [float(v) for v in history.history["loss"]], "local_losses": local_losses}, model


def custom_loop(rank: int, size: int) -> dict:
    """tf.GradientTape + hvd.DistributedOptimizer(SGD).apply_gradients, eager and in a tf.function,
    with Horovod's TF2 way of broadcasting (hvd.broadcast_variables after the optimizer exists)."""
    model = make_model(seed=10 + rank)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    opt.build(model.trainable_variables)
    hvd_tf.broadcast_variables(model.variables, root_rank=0)
    hvd_tf.broadcast_variables(opt.variables(), root_rank=0)  # Horovod's examples call it; Keras 3 has a list
    start = flat(model)
    loss = loss_fn()

    def step(xb: tf.Tensor, yb: tf.Tensor) -> None:
        with tf.GradientTape() as tape:
            value = loss(yb, model(xb, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    compiled = tf.function(step)
    x, y = rank_data(rank, seed=2)
    for s in range(STEPS):
        (step if s == 0 else compiled)(x[s * BATCH:(s + 1) * BATCH], y[s * BATCH:(s + 1) * BATCH])

    reference = make_model(seed=10)
    ref_opt = keras.optimizers.SGD(0.1, momentum=0.9)
    ux, uy = union(size, seed=2)
    for s in range(STEPS):
        xb, yb = ux[s * BATCH * size:(s + 1) * BATCH * size], uy[s * BATCH * size:(s + 1) * BATCH * size]
        with tf.GradientTape() as tape:
            value = loss(yb, reference(xb, training=True))
        ref_opt.apply_gradients(zip(tape.gradient(value, reference.trainable_variables), reference.trainable_variables))
    return {"start": digest(start), "after": flat(model).tolist(), "vs_union": compare(flat(model), flat(reference)),
            "get_gradients": refusal(lambda: opt.get_gradients(value, model.trainable_variables))}


def accumulate(rank: int, size: int) -> dict:
    """backward_passes_per_step=2 in model.fit: one update per two batches, gradients summed over the
    passes (Horovod's default) and averaged over ranks."""
    model = make_model(seed=20 + rank)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.05), backward_passes_per_step=2)
    model.compile(optimizer=opt, loss=loss_fn())
    x, y = rank_data(rank, seed=3)
    x, y = x[:4 * BATCH // 2], y[:4 * BATCH // 2]  # 4 batches of BATCH // 2: two updates
    model.fit(x, y, batch_size=BATCH // 2, epochs=1, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

    reference = make_model(seed=20)
    ref_opt = keras.optimizers.SGD(0.05)
    loss = loss_fn()
    parts = [rank_data(r, seed=3) for r in range(size)]
    for update in range(2):
        grads = None
        for p in parts:
            for half in range(2):
                lo = (2 * update + half) * (BATCH // 2)
                with tf.GradientTape() as tape:
                    value = loss(p[1][lo:lo + BATCH // 2], reference(p[0][lo:lo + BATCH // 2]))
                g = tape.gradient(value, reference.trainable_variables)
                grads = g if grads is None else [a + b for a, b in zip(grads, g)]
        ref_opt.apply_gradients(zip([g / size for g in grads], reference.trainable_variables))
    return {"after": flat(model).tolist(), "vs_union": compare(flat(model), flat(reference)),
            "iterations": int(opt.iterations.numpy())}


def warmup(rank: int, size: int) -> dict:
    """LearningRateWarmupCallback over 2 epochs of 2 batches sets the learning rate on every rank alike."""
    model = make_model(seed=30 + rank)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.2 * size)), loss=loss_fn())
    x, y = rank_data(rank, seed=4)
    seen: list = []
    model.fit(x[:2 * BATCH], y[:2 * BATCH], batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.2 * size, warmup_epochs=2),
        keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: seen.append(
            float(np.asarray(model.optimizer.learning_rate))))])
    return {"lr": seen, "after": digest(flat(model))}


def reload(rank: int, size: int, trained: keras.Model) -> dict:
    """hvd.load_model: the optimizer comes back distributed with its state; training on goes on averaging."""
    folder = hvd_tf.broadcast_object(tempfile.mkdtemp() if rank == 0 else None, root_rank=0)
    path = os.path.join(folder, "model.keras")
    if rank == 0:
        trained.save(path)
    hvd.allreduce(0.0, name="saved")  # a barrier: the file exists before anyone loads it
    model = hvd.load_model(path)
    iterations = int(model.optimizer.iterations.numpy())
    x, y = rank_data(rank, seed=5)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)

    reference = keras.models.load_model(path)
    ux, uy = union(size, seed=5)
    reference.fit(ux, uy, batch_size=BATCH * size, epochs=1, shuffle=False, verbose=0)
    return {"iterations_loaded": iterations, "class": type(model.optimizer).__name__,
            "after": flat(model).tolist(), "vs_union": compare(flat(model), flat(reference)),
            "legacy": refusal(lambda: hvd.load_model(path, legacy_opts=True))}


def standalone_keras(rank: int, size: int) -> dict:
    """horovod.keras: DistributedOptimizer(SGD with momentum) in model.fit with its callbacks, the learning
    rate halved each epoch by LearningRateScheduleCallback; momentum correction cannot apply to a Keras 3
    optimizer (momentum is compiled in as a constant): a warning says so, and training stays exact."""
    model = make_model(seed=40 + rank)
    before = flat(model)
    opt = hvd_keras.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    model.compile(optimizer=opt, loss=loss_fn())
    x, y = rank_data(rank, seed=6)
    lrs: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[
            hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd_keras.callbacks.MetricAverageCallback(),
            hvd_keras.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=lambda epoch: 0.5 ** epoch),
            keras.callbacks.LambdaCallback(on_train_batch_begin=lambda batch, logs: lrs.append(
                float(np.asarray(model.optimizer.learning_rate))))])

    reference = make_model(seed=40)
    reference.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss_fn())
    ux, uy = union(size, seed=6)
    reference.fit(ux, uy, batch_size=BATCH * size, epochs=3, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.LearningRateScheduler(lambda epoch: 0.1 * 0.5 ** epoch)])
    return {"before": digest(before), "after": flat(model).tolist(), "vs_union": compare(flat(model), flat(reference)),
            "class": type(model.optimizer).__name__, "lr": lrs, "logged_lr": [float(v) for v in history.history["lr"]],
            "history": [float(v) for v in history.history["loss"]],
            "warnings": sorted({str(w.message) for w in caught if "momentum" in str(w.message)})}


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    fitted, model = fit(rank, size)
    record = {"rank": rank, "size": size, "keras": keras.__version__, "fit": fitted,
              "custom_loop": custom_loop(rank, size), "accumulate": accumulate(rank, size),
              "warmup": warmup(rank, size), "load_model": reload(rank, size, model),
              "standalone_keras": standalone_keras(rank, size)}
    _report.write(rank, record)


if __name__ == "__main__":
    main()
