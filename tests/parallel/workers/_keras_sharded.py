"""hvdp.DistributedOptimizer(keras_opt, shard_optimizer_state=True), for keras_fit.py (both Keras backends).

Each case starts from different weights on every rank (broadcast_state makes them one), trains on each
rank's own batches, and is compared with one process stepping the union of the ranks' batches: the
weights, and the whole optimizer state gathered from the ranks' parts against that process's.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List

import _report
import keras
import numpy as np
from _report import compare, digest

import hvdp
import hvdp.keras

FEATURES, CLASSES, BATCH, STEPS = 16, 3, 16, 3  # 16 * 7 + 7 + 7 * 3 + 3 = 143 elements: an uneven split at np=2


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input(shape=(FEATURES,)), keras.layers.Dense(7, activation="tanh"),
                             keras.layers.Dense(CLASSES)])


def flat(arrays: List[Any]) -> np.ndarray:
    return np.concatenate([np.asarray(keras.ops.convert_to_numpy(a), np.float64).reshape(-1) for a in arrays]) \
        if arrays else np.zeros(0)


def rank_data(rank: int) -> tuple:
    data = np.random.default_rng(700 + rank)
    return data.normal(size=(BATCH * STEPS, FEATURES)).astype(np.float32), data.integers(0, CLASSES, BATCH * STEPS)


def union(size: int, steps: int = STEPS) -> tuple:
    parts = [rank_data(r) for r in range(size)]
    return tuple(np.concatenate([np.concatenate([p[i][s * BATCH:(s + 1) * BATCH] for p in parts])
                                 for s in range(steps)]) for i in (0, 1))


def loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


OPTIMIZERS: Dict[str, Callable[[], keras.optimizers.Optimizer]] = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.5),  # its biases excluded: by name, per variable
    "sgd_momentum_schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5), momentum=0.9),
    "rmsprop_global_clipnorm": lambda: keras.optimizers.RMSprop(0.01, global_clipnorm=0.05),
    "adam_clipnorm": lambda: keras.optimizers.Adam(0.01, clipnorm=0.02),
}


def made(name: str) -> keras.optimizers.Optimizer:
    optimizer = OPTIMIZERS[name]()
    if name == "adamw":
        optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


def trained(rank: int, name: str, shard: bool = True, **options: Any) -> tuple:
    model = make_model(seed=rank)
    optimizer = hvdp.DistributedOptimizer(made(name), shard_optimizer_state=shard, **options)
    model.compile(optimizer=optimizer, loss=loss())
    hvdp.broadcast_state(model, optimizer)
    start = flat(model.trainable_variables)
    model.fit(*rank_data(rank), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model, optimizer, start


def reference(name: str, size: int) -> tuple:
    model = make_model(seed=0)
    optimizer = made(name)
    model.compile(optimizer=optimizer, loss=loss())
    model.fit(*union(size), batch_size=BATCH * size, epochs=1, shuffle=False, verbose=0)
    return model, optimizer


def state_elements(optimizer: Any) -> int:
    return int(sum(np.prod(v.shape) for v in optimizer.variables))


def equivalence(rank: int, size: int) -> dict:
    out = {}
    for name in OPTIMIZERS:
        model, optimizer, start = trained(rank, name)
        one, one_optimizer = reference(name, size)
        whole = optimizer._hvdp_export(keras.ops.convert_to_numpy)  # every rank's part, gathered
        unclipped = None
        if "clipnorm" in name:  # the clipping did act: without it, the step differs
            plain = make_model(seed=0)
            config = {**one_optimizer.get_config(), "clipnorm": None, "global_clipnorm": None}
            plain.compile(optimizer=type(one_optimizer).from_config(config), loss=loss())
            plain.fit(*union(size), batch_size=BATCH * size, epochs=1, shuffle=False, verbose=0)
            unclipped = float(np.max(np.abs(flat(plain.trainable_variables) - flat(one.trainable_variables))))
        out[name] = {"vs_one_process": compare(flat(model.trainable_variables), flat(one.trainable_variables)),
                     "state_vs_one_process": compare(flat(whole), flat(one_optimizer.variables)),
                     "state_shapes_equal": [tuple(np.shape(w)) for w in whole] ==
                     [tuple(v.shape) for v in one_optimizer.variables],
                     "moved": float(np.max(np.abs(flat(model.trainable_variables) - start))),
                     "part_elements": state_elements(optimizer), "whole_elements": state_elements(one_optimizer),
                     "iterations": int(keras.ops.convert_to_numpy(optimizer.iterations)),
                     "class": type(optimizer).__name__, "unclipped_differs_by": unclipped,
                     "digest": digest(flat(model.trainable_variables))}
    for option, settings in (("fp16", {"compression": "fp16"}), ("bpps2", {"backward_passes_per_step": 2}),
                             ("sum", {"op": "sum"})):  # against the unsharded optimizer with the same option
        sharded, _, _ = trained(rank, "adam", **settings)
        whole, _, _ = trained(rank, "adam", shard=False, **settings)
        out[option] = compare(flat(sharded.trainable_variables), flat(whole.trainable_variables))
    return out


def custom_loop(rank: int, size: int) -> dict:
    """An eager loop of the Keras backend's own (GradientTape, or torch autograd) calling apply."""
    model = make_model(seed=rank)
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.Adam(0.01), shard_optimizer_state=True, check_every=1)
    hvdp.broadcast_state(model, optimizer)
    x, y = rank_data(rank)
    for s in range(STEPS):
        batch = (x[s * BATCH:(s + 1) * BATCH], y[s * BATCH:(s + 1) * BATCH])
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                value = loss()(batch[1], model(batch[0], training=True))
            optimizer.apply(tape.gradient(value, model.trainable_variables), model.trainable_variables)
        else:
            import torch

            model.zero_grad()
            loss()(batch[1], model(batch[0], training=True)).backward()
            with torch.no_grad():
                optimizer.apply([v.value.grad for v in model.trainable_variables], model.trainable_variables)
    one, _ = reference("adam", size)
    return {"vs_one_process": compare(flat(model.trainable_variables), flat(one.trainable_variables)),
            "digest": digest(flat(model.trainable_variables))}


def checkpoints(rank: int, size: int) -> dict:
    """hvdp.save_checkpoint of a sharded Adam (the whole state), loaded into an unsharded optimizer and into a
    sharded one; each continues one epoch, against one process trained for both epochs."""
    path = os.path.join(os.environ["HVDP_TEST_OUT"], "keras_sharded.ckpt")
    model, optimizer, _ = trained(rank, "adam")
    hvdp.save_checkpoint(path, model, optimizer)
    one, one_optimizer = reference("adam", size)
    one.fit(*union(size), batch_size=BATCH * size, epochs=1, shuffle=False, verbose=0)
    out = {}
    for case, shard in (("to_unsharded", False), ("to_sharded", True)):
        loaded = make_model(seed=10 + rank)
        loaded_optimizer = hvdp.DistributedOptimizer(keras.optimizers.Adam(0.01), shard_optimizer_state=shard)
        loaded.compile(optimizer=loaded_optimizer, loss=loss())
        hvdp.load_checkpoint(path, loaded, loaded_optimizer)
        state = loaded_optimizer._hvdp_export(keras.ops.convert_to_numpy) if shard else \
            [keras.ops.convert_to_numpy(v) for v in loaded_optimizer.variables]
        iterations = int(keras.ops.convert_to_numpy(loaded_optimizer.iterations))
        loaded.fit(*rank_data(rank), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        out[case] = {"iterations": iterations, "state_elements": state_elements(loaded_optimizer),
                     "state_vs_saved": compare(flat(state), flat(optimizer._hvdp_export(keras.ops.convert_to_numpy))),
                     "continued_vs_one_process": compare(flat(loaded.trainable_variables),
                                                         flat(one.trainable_variables)),
                     "digest": digest(flat(loaded.trainable_variables))}
    # An optimizer built (and stepped) before it is sharded: its state is taken apart, not lost.
    built = keras.optimizers.Adam(0.01)
    built.build(one.trainable_variables)
    for variable, value in zip(built.variables, one_optimizer.variables):
        variable.assign(value)
    taken = hvdp.DistributedOptimizer(built, shard_optimizer_state=True)
    out["built_before"] = {"state_vs_given": compare(flat(taken._hvdp_export(keras.ops.convert_to_numpy)),
                                                     flat(one_optimizer.variables)),
                           "part_elements": state_elements(taken)}
    return out


def saving(rank: int, size: int) -> dict:
    """Keras's own saving: model.save on one rank is refused with the fix; hvdp.keras.ModelCheckpoint
    gathers on every rank, and keras.models.load_model reads the whole state back."""
    folder = os.path.join(os.environ["HVDP_TEST_OUT"], "keras_sharded_saves")
    os.makedirs(folder, exist_ok=True)
    model = make_model(seed=0)
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.Adam(0.01), shard_optimizer_state=True)
    model.compile(optimizer=optimizer, loss=loss())
    model.fit(*rank_data(rank), batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvdp.keras.ModelCheckpoint(os.path.join(folder, "epoch-{epoch}.keras"))])
    whole = optimizer._hvdp_export(keras.ops.convert_to_numpy)
    refused = _report.refusal(lambda: model.save(os.path.join(folder, f"rank{rank}.keras")))
    hvdp.barrier()
    loaded = keras.models.load_model(os.path.join(folder, "epoch-2.keras"))
    return {"files": sorted(f for f in os.listdir(folder) if f.startswith("epoch")), "refused": refused,
            "loaded_vs_whole": compare(flat(loaded.optimizer.variables), flat(whole)),
            "loaded_weights_equal": bool(np.array_equal(flat(loaded.trainable_variables),
                                                        flat(model.trainable_variables)))}


def refusals() -> dict:
    def sharded(optimizer: Any) -> Callable[[], Any]:
        return lambda: hvdp.DistributedOptimizer(optimizer, shard_optimizer_state=True)

    model = make_model(seed=0)
    other = make_model(seed=1)
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.SGD(0.1), shard_optimizer_state=True)
    optimizer.build(model.trainable_variables)
    return {"lamb": _report.refusal(sharded(keras.optimizers.Lamb())),
            "loss_scale": _report.refusal(sharded(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))),
            "ema": _report.refusal(sharded(keras.optimizers.Adam(use_ema=True))),
            "other_variables": _report.refusal(lambda: optimizer.apply(
                [keras.ops.zeros(v.shape) for v in other.trainable_variables], other.trainable_variables))}


def report(rank: int, size: int) -> dict:
    return {"equivalence": equivalence(rank, size), "custom_loop": custom_loop(rank, size),
            "checkpoints": checkpoints(rank, size), "saving": saving(rank, size), "refusals": refusals()}


def resume(rank: int, size: int, path: str) -> dict:
    """At ``size`` ranks (a new split of the 143 elements): the np=2 job's checkpoint of its sharded Adam loaded
    into a sharded Adam, one epoch on each rank's batches, against one process continuing from the same file."""
    model = make_model(seed=20 + rank)
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.Adam(0.01), shard_optimizer_state=True)
    model.compile(optimizer=optimizer, loss=loss())
    hvdp.load_checkpoint(path, model, optimizer)
    loaded = int(keras.ops.convert_to_numpy(optimizer.iterations))
    part = state_elements(optimizer)
    model.fit(*rank_data(rank), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    one = make_model(seed=30)
    one_optimizer = keras.optimizers.Adam(0.01)  # plain: every rank steps the union alone
    one.compile(optimizer=one_optimizer, loss=loss())
    hvdp.load_checkpoint(path, one, one_optimizer)
    one.fit(*union(size), batch_size=BATCH * size, epochs=1, shuffle=False, verbose=0)
    return {"vs_one_process": compare(flat(model.trainable_variables), flat(one.trainable_variables)),
            "loaded_iterations": loaded, "part_elements": part, "digest": digest(flat(model.trainable_variables)),
            "moved": float(np.max(np.abs(flat(model.trainable_variables) - flat(make_model(seed=0).weights))))}
