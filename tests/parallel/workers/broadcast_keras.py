"""Keras 3 (on the framework hvdp runs): broadcast_state leaves no trace, whatever the optimizer.

Every rank builds its model from different random weights; rank 0's are the reference's.
* ``fresh``: compile with a new wrapped optimizer, broadcast_state, train on slices;
* ``resumed``: every rank first takes 2 steps of its own (so ranks hold different optimizer
  state), then wraps its optimizer, recompiles, broadcast_state, trains on slices.
Either must equal one process on the whole batch from rank 0's start (and rank 0's own
steps), including ``optimizer.iterations``. Also a LearningRateSchedule through
broadcast_state and a checkpoint, and the object collectives with None off the root.
"""

from __future__ import annotations

import os
import sys

import keras
import numpy as np

import hvdp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _report
from _report import compare, digest

STEPS, PRE_STEPS, GLOBAL_BATCH, FEATURES, CLASSES = 5, 2, 32, 8, 3
OPTIMIZERS = {
    "sgd_momentum": lambda lr=0.1: keras.optimizers.SGD(lr, momentum=0.9),
    "adam": lambda lr=0.01: keras.optimizers.Adam(lr),
    "adamw": lambda lr=0.01: keras.optimizers.AdamW(lr, weight_decay=0.1),
    "rmsprop": lambda lr=0.01: keras.optimizers.RMSprop(lr, momentum=0.5),
}
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input(shape=(FEATURES,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(CLASSES)])


def data(step: int, size: int) -> list:
    rng = np.random.default_rng([7, step])
    x = rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=GLOBAL_BATCH)
    return [(x[r::size], y[r::size]) for r in range(size)]


def whole(step: int, size: int) -> tuple:
    parts = data(step, size)
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


def own_data(rank: int, step: int) -> tuple:
    rng = np.random.default_rng([rank, 100 + step])
    return rng.normal(size=(8, FEATURES)).astype(np.float32), rng.integers(0, CLASSES, size=8)


def flat(model: keras.Model) -> np.ndarray:
    return np.concatenate([np.asarray(w).reshape(-1) for w in model.get_weights()]).astype(np.float64)


def pre_steps(model: keras.Model, rank: int) -> None:
    for step in range(PRE_STEPS):
        model.train_on_batch(*own_data(rank, step))


def run(name: str, resumed: bool, rank: int, size: int) -> dict:
    model = make_model(100 + rank)
    opt = OPTIMIZERS[name]()
    if resumed:
        model.compile(optimizer=opt, loss=LOSS)
        pre_steps(model, rank)
    opt = hvdp.DistributedOptimizer(opt)
    model.compile(optimizer=opt, loss=LOSS)
    hvdp.broadcast_state(model, opt)
    after_broadcast = int(opt.iterations)
    for step in range(STEPS):
        model.train_on_batch(*data(step, size)[rank])
    ref = make_model(100)
    ref.compile(optimizer=OPTIMIZERS[name](), loss=LOSS)
    if resumed:
        pre_steps(ref, 0)
    ref_after_broadcast = int(ref.optimizer.iterations)
    for step in range(STEPS):
        ref.train_on_batch(*whole(step, size))
    return {**compare(flat(model), flat(ref)), "digest": digest(flat(model)),
            "steps": int(opt.iterations), "reference_steps": int(ref.optimizer.iterations),
            "steps_after_broadcast": after_broadcast, "reference_steps_after_broadcast": ref_after_broadcast,
            "moved": float(np.max(np.abs(flat(model) - flat(make_model(100)))))}


def schedule(rank: int, size: int, out_dir: str) -> dict:
    """A LearningRateSchedule keeps its position through broadcast_state and a checkpoint."""
    def build(seed: int, distributed: bool) -> tuple:
        model = make_model(seed)
        lr = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5)
        opt = keras.optimizers.Adam(lr)
        model.compile(optimizer=hvdp.DistributedOptimizer(opt) if distributed else opt, loss=LOSS)
        return model, opt

    model = make_model(100 + rank)
    plain = keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5))
    model.compile(optimizer=plain, loss=LOSS)
    for step in range(3):  # every rank alone, from its own weights
        model.train_on_batch(*whole(step, size))
    opt = hvdp.DistributedOptimizer(plain)
    model.compile(optimizer=opt, loss=LOSS)
    hvdp.broadcast_state(model, opt)
    for step in range(3, 6):
        model.train_on_batch(*data(step, size)[rank])
    path = os.path.join(out_dir, "schedule.npz")
    hvdp.save_checkpoint(path, model, opt, step=6)
    for step in range(6, 9):
        model.train_on_batch(*data(step, size)[rank])
    uninterrupted = flat(model)
    resumed, resumed_opt = build(500 + rank, distributed=True)
    extras = hvdp.load_checkpoint(path, resumed, resumed_opt)
    for step in range(extras["step"], 9):
        resumed.train_on_batch(*data(step, size)[rank])
    ref, ref_opt = build(100, distributed=False)
    for step in range(9):
        ref.train_on_batch(*whole(step, size))
    learning_rate = lambda o: float(o.learning_rate)  # noqa: E731
    return {"vs_single_process": compare(uninterrupted, flat(ref)), "iterations": int(opt.iterations),
            "reference_iterations": int(ref_opt.iterations), "lr": learning_rate(opt),
            "reference_lr": learning_rate(ref_opt),
            "resumed_vs_uninterrupted": float(np.max(np.abs(flat(resumed) - uninterrupted))),
            "resumed_iterations": int(resumed_opt.iterations)}


def objects(rank: int) -> dict:
    return {
        "config": hvdp.broadcast_object({"lr": 0.1, "layers": [4, 8]} if rank == 0 else None),
        "from_rank_1": hvdp.broadcast_object("text" if rank == 1 else rank, root_rank=1),
        "gathered": [g if g is None else g["rank"] for g in
                     hvdp.allgather_object(None if rank == 0 else {"rank": rank, "pad": "x" * 1000 * rank})],
    }


def main() -> None:
    hvdp.init()
    rank, size = hvdp.rank(), hvdp.size()
    record = {"rank": rank, "backend": keras.backend.backend(),
              "runs": {f"{name}/{when}": run(name, when == "resumed", rank, size)
                       for name in OPTIMIZERS for when in ("fresh", "resumed")},
              "schedule": schedule(rank, size, os.environ["HVDP_TEST_OUT"]), "objects": objects(rank)}
    _report.write(rank, record)
    hvdp.shutdown()


if __name__ == "__main__":
    main()
