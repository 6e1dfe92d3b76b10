"""An existing horovod.tensorflow script, unchanged, on Keras 3 models (hvdp's Horovod build).

Only Horovod's own API: hvd.broadcast_variables (also inplace and inside a tf.function),
hvd.DistributedGradientTape, hvd.PartialDistributedGradientTape, hvd.SyncBatchNormalization.
Every rank starts from different weights and trains on different data; results are compared
with one process (no Horovod) on the union of the ranks' batches.
"""

from __future__ import annotations

import os
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from tensorflow import keras

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report
from _report import compare, digest

FEATURES, CLASSES, BATCH, STEPS = 10, 3, 8, 3


def make_model(seed: int, *layers: keras.layers.Layer) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input(shape=(FEATURES,)), keras.layers.Dense(12, activation="tanh"), *layers,
                             keras.layers.Dense(CLASSES)])


def flat(model: keras.Model) -> np.ndarray:
    return np.concatenate([np.asarray(v).reshape(-1) for v in model.trainable_variables]).astype(np.float64)


def batches(rank: int, seed: int) -> list:
    data = np.random.default_rng(seed * 100 + rank)
    return [(tf.constant(data.normal(size=(BATCH, FEATURES)).astype(np.float32)),
             tf.constant(data.integers(0, CLASSES, size=BATCH))) for _ in range(STEPS)]


def union(size: int, seed: int) -> list:
    parts = [batches(r, seed) for r in range(size)]
    return [(tf.concat([p[s][0] for p in parts], 0), tf.concat([p[s][1] for p in parts], 0)) for s in range(STEPS)]


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def reference_run(model: keras.Model, optimizer: keras.optimizers.Optimizer, data: list) -> None:
    for x, y in data:
        with tf.GradientTape() as tape:
            value = LOSS(y, model(x, training=True))
        optimizer.apply_gradients(zip(tape.gradient(value, model.trainable_variables), model.trainable_variables))


def tape(rank: int, size: int) -> dict:
    """Eager steps with DistributedGradientTape on a Keras 3 model and a plain Keras 3 optimizer."""
    model = make_model(rank)
    before = flat(model)
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    opt.build(model.trainable_variables)
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(opt.variables, root_rank=0)
    start = flat(model)
    for x, y in batches(rank, seed=1):
        with tf.GradientTape() as plain:
            value = LOSS(y, model(x, training=True))
        grads = hvd.DistributedGradientTape(plain).gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    reference = make_model(0)
    reference_run(reference, keras.optimizers.SGD(0.1, momentum=0.9), union(size, seed=1))
    return {"before": digest(before), "start": digest(start), "after": flat(model).tolist(),
            "vs_union": compare(flat(model), flat(reference))}


def tape_in_function(rank: int, size: int) -> dict:
    """Horovod's TF2 pattern: one tf.function step, broadcasting on the first batch (here before the update)."""
    model = make_model(20 + rank)
    opt = keras.optimizers.Adam(0.01)
    opt.build(model.trainable_variables)

    @tf.function
    def step(x: tf.Tensor, y: tf.Tensor, first_batch: bool) -> None:
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        with tf.GradientTape() as plain:
            value = LOSS(y, model(x, training=True))
        distributed = hvd.DistributedGradientTape(plain)
        grads = distributed.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    for s, (x, y) in enumerate(batches(rank, seed=2)):
        step(x, y, s == 0)
    reference = make_model(20)
    reference_run(reference, keras.optimizers.Adam(0.01), union(size, seed=2))
    return {"after": flat(model).tolist(), "vs_union": compare(flat(model), flat(reference))}


def inplace(rank: int) -> dict:
    model = make_model(40 + rank)
    before = digest(flat(model))
    hvd.broadcast_variables(model.variables, root_rank=0, inplace=True)
    return {"after": digest(flat(model)), "changed_on_rank1": rank != 1 or digest(flat(model)) != before}


def partial(rank: int, size: int) -> dict:
    """PartialDistributedGradientTape: the local layer's gradient is this rank's own / size, the rest averaged."""
    model = make_model(60)
    x, y = batches(rank, seed=3)[0]
    with tf.GradientTape(persistent=True) as plain:
        value = LOSS(y, model(x, training=True))
    own = plain.gradient(value, model.trainable_variables)
    grads = hvd.PartialDistributedGradientTape(plain, local_layers=[model.layers[0]]).gradient(
        value, model.trainable_variables)
    averaged = [hvd.allreduce(g, op=hvd.Average) for g in own]
    local = len(model.layers[0].trainable_variables)
    flat_of = lambda tensors: np.concatenate([np.asarray(t).reshape(-1) for t in tensors])  # noqa: E731
    return {"local_is_own_over_size": compare(flat_of(grads[:local]), flat_of(own[:local]) / size),
            "shared_is_average": compare(flat_of(grads[local:]), flat_of(averaged[local:]))}


def sync_bn(rank: int, size: int) -> dict:
    """SyncBatchNormalization trains like BatchNormalization on the union of the ranks' batches."""
    model = make_model(80 + rank, hvd.SyncBatchNormalization())
    opt = keras.optimizers.SGD(0.1)
    hvd.broadcast_variables(model.variables, root_rank=0)
    data = batches(rank, seed=4)
    first = np.asarray(model(data[0][0], training=True))
    for x, y in data:
        with tf.GradientTape() as plain:
            value = LOSS(y, model(x, training=True))
        grads = hvd.DistributedGradientTape(plain).gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    reference = make_model(80, keras.layers.BatchNormalization())
    joint = union(size, seed=4)
    reference_first = np.asarray(reference(joint[0][0], training=True))[rank * BATCH:(rank + 1) * BATCH]
    reference_run(reference, keras.optimizers.SGD(0.1), joint)
    moving = np.concatenate([np.asarray(v).reshape(-1) for v in model.non_trainable_variables])
    reference_moving = np.concatenate([np.asarray(v).reshape(-1) for v in reference.non_trainable_variables])
    return {"after": flat(model).tolist(), "vs_union": compare(flat(model), flat(reference)),
            "outputs_vs_union": compare(first, reference_first),
            "moving_vs_union": compare(moving, reference_moving)}


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    record = {"rank": rank, "size": size, "keras": keras.__version__, "tape": tape(rank, size),
              "tape_in_function": tape_in_function(rank, size), "inplace": inplace(rank),
              "partial": partial(rank, size), "sync_bn": sync_bn(rank, size)}
    _report.write(rank, record)


if __name__ == "__main__":
    main()
