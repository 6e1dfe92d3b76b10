"""A Keras script as users write it for one process, run on every rank (either Keras backend).

Each rank trains on its own slice of the digits and validates on its own slice of the validation
set (slices of different sizes), with Keras's own callbacks: ``EarlyStopping``,
``ReduceLROnPlateau`` and ``ModelCheckpoint(save_best_only=True)``. The run is compared with one
process training on the union of the ranks' batches and validating on the union of their slices,
with the same callbacks: the same logs every epoch, the same stopping epoch, the same weights.

Then: a callback on rank 1 alone sets ``model.stop_training`` (after an epoch, and after a batch);
fits that differ between ranks (epochs, batches) are refused at their start; a weight nudged on rank 1
alone is caught at the epoch's end; ``evaluate`` returns the union's metrics. Every case that raises
raises on every rank at once, so the job goes on (the replicas are made equal again after the nudge).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Dict, List

import numpy as np

import hvdp

hvdp.init()

import keras
from sklearn.datasets import load_digits

import hvdp.keras

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report
from _report import digest

BATCH, TRAIN_PER_RANK, VALIDATION = 16, 320, (101, 76)  # rank r validates on VALIDATION[r] examples
RANK, SIZE = hvdp.rank(), hvdp.size()


def data() -> tuple:
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(7).permutation(len(x))
    x, y = (x[order] / 16.0).astype(np.float32), y[order].astype(np.int64)
    train = [(x[r * TRAIN_PER_RANK:(r + 1) * TRAIN_PER_RANK], y[r * TRAIN_PER_RANK:(r + 1) * TRAIN_PER_RANK])
             for r in range(SIZE)]
    start = SIZE * TRAIN_PER_RANK
    bounds = np.cumsum([0, *VALIDATION[:SIZE]]) + start
    validation = [(x[a:b], y[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return train, validation


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(10)])


def flat(model: keras.Model) -> np.ndarray:
    return np.concatenate([keras.ops.convert_to_numpy(v).reshape(-1) for v in model.trainable_variables]
                          ).astype(np.float64)


def compile_(model: keras.Model, distributed: bool, lr: float = 0.5) -> None:
    optimizer = keras.optimizers.SGD(lr)
    model.compile(optimizer=hvdp.DistributedOptimizer(optimizer) if distributed else optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])


def union_batches(train: List[tuple]) -> tuple:
    """The ranks' batches side by side: one process's batch s is every rank's batch s."""
    steps = TRAIN_PER_RANK // BATCH
    parts = [np.concatenate([t[i][s * BATCH:(s + 1) * BATCH] for s in range(steps) for t in train])
             for i in (0, 1)]
    return parts[0], parts[1]


def peers_callbacks(train: List[tuple], validation: List[tuple]) -> Dict[str, Any]:
    folder = os.path.join(os.environ["HVDP_TEST_OUT"], f"best-{keras.backend.backend()}-{RANK}")

    def run(distributed: bool) -> tuple:
        model = make_model(seed=RANK if distributed else 0)  # different weights until broadcast_state
        compile_(model, distributed)
        if distributed:
            hvdp.broadcast_state(model, model.optimizer)
        saved: List[int] = []

        class Saves(keras.callbacks.ModelCheckpoint):
            def _save_model(self, epoch: int, batch: Any, logs: Any) -> None:
                before = self.best
                super()._save_model(epoch, batch, logs)
                if self.best != before:
                    saved.append(epoch + 1)

        # hvdp.keras.MetricAverage (and Horovod's MetricAverageCallback on TensorFlow) as a Horovod script has
        # them: they leave the union's metrics as they are
        averaging = [hvdp.keras.MetricAverage()] if distributed else []
        if distributed and keras.backend.backend() == "tensorflow":
            import horovod.tensorflow.keras as hvd_keras

            averaging.append(hvd_keras.callbacks.MetricAverageCallback())
        callbacks = [*averaging,
                     keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0, min_delta=0.1),
                     Saves(os.path.join(folder if distributed else folder + "-one", "best.keras"),
                           monitor="val_loss", save_best_only=True),
                     keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=0.02)]
        x, y = train[RANK] if distributed else union_batches(train)
        xv, yv = validation[RANK] if distributed else (np.concatenate([v[0] for v in validation]),
                                                       np.concatenate([v[1] for v in validation]))
        started = time.perf_counter()
        history = model.fit(x, y, batch_size=BATCH * (1 if distributed else SIZE), epochs=40, shuffle=False,
                            verbose=0, validation_data=(xv, yv), callbacks=callbacks)
        took = time.perf_counter() - started
        evaluated = model.evaluate(xv, yv, batch_size=32, verbose=0, return_dict=True)
        return model, history.history, saved, took, evaluated

    model, history, saved, took, evaluated = run(True)
    reference, ref_history, ref_saved, _, ref_evaluated = run(False)
    return {"history": history, "reference_history": ref_history, "epochs": len(history["loss"]),
            "reference_epochs": len(ref_history["loss"]), "saved": saved, "reference_saved": ref_saved,
            "digest": digest(flat(model)), "vs_reference": float(np.max(np.abs(flat(model) - flat(reference)))),
            "evaluate": evaluated, "reference_evaluate": ref_evaluated, "seconds": took}


class StopOnRank(keras.callbacks.Callback):
    """Sets model.stop_training on one rank only, after an epoch or a batch (a rank-local decision)."""

    def __init__(self, rank: int, epoch: int, batch: Any = None) -> None:
        super().__init__()
        self.rank, self.epoch, self.batch, self.current = rank, epoch, batch, 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current = epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.batch is None and RANK == self.rank and epoch + 1 == self.epoch:
            self.model.stop_training = True

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.batch is not None and RANK == self.rank and (self.current + 1, batch + 1) == (self.epoch, self.batch):
            self.model.stop_training = True


class Nudge(keras.callbacks.Callback):
    """Moves one weight on rank 1 alone after batch 3 of the first epoch."""

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if RANK == 1 and batch == 2 and not getattr(self, "done", False):
            kernel = self.model.trainable_variables[0]
            value = keras.ops.convert_to_numpy(kernel).copy()
            value[0, 0] += 1e-3
            kernel.assign(value)
            self.done = True


def rank_local(train: List[tuple]) -> Dict[str, Any]:
    x, y = train[RANK]
    found: Dict[str, Any] = {}
    for case, stop in (("epoch", StopOnRank(1, epoch=2)), ("batch", StopOnRank(1, epoch=2, batch=3))):
        model = make_model(seed=RANK)
        compile_(model, True, lr=0.05)
        hvdp.broadcast_state(model, model.optimizer)
        history = model.fit(x, y, batch_size=BATCH, epochs=6, shuffle=False, verbose=0, callbacks=[stop])
        found[case] = {"epochs": len(history.history["loss"]), "digest": digest(flat(model)),
                       "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations))}
    return found


def refusals(train: List[tuple]) -> Dict[str, Any]:
    x, y = train[RANK]
    model = make_model(seed=0)
    compile_(model, True, lr=0.05)
    hvdp.broadcast_state(model, model.optimizer)
    started = time.perf_counter()
    epochs = _report.refusal(lambda: model.fit(x, y, batch_size=BATCH, epochs=3 if RANK == 1 else 5, verbose=0))
    fewer = x[:TRAIN_PER_RANK - 2 * BATCH] if RANK == 1 else x
    batches = _report.refusal(lambda: model.fit(fewer, y[:len(fewer)], batch_size=BATCH, epochs=1, verbose=0))
    refused_in = time.perf_counter() - started
    started = time.perf_counter()
    nudged = _report.refusal(lambda: model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                                               callbacks=[Nudge()]))
    nudge_found_in = time.perf_counter() - started
    hvdp.broadcast_state(model, model.optimizer)  # equal again: the job goes on
    return {"epochs": epochs, "batches": batches, "refused_in": refused_in, "nudged": nudged,
            "nudge_found_in": nudge_found_in, "digest": digest(flat(model))}


def main() -> None:
    train, validation = data()
    record: Dict[str, Any] = {"rank": RANK, "backend": keras.backend.backend()}
    record["peers"] = peers_callbacks(train, validation)
    record["rank_local"] = rank_local(train)
    record["refusals"] = refusals(train)
    _report.write(RANK, record)


main()
