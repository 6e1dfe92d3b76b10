"""Keras 3 callbacks for data-parallel training (imported lazily by :mod:`hvdp.keras`)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import keras

from hvdp import _runtime
from hvdp.collectives import allreduce, broadcast_state
from hvdp.process_sets import ProcessSet


class BroadcastInitialState(keras.callbacks.Callback):
    """At the start of ``fit``, copy weights and optimizer state from ``root_rank``.

    With ``process_set``, only among the set's members (``root_rank`` counts in the set).

    Example:
        >>> model.fit(x, y, callbacks=[hvdp.keras.BroadcastInitialState()])  # doctest: +SKIP
    """

    def __init__(self, root_rank: int = 0, process_set: Optional[ProcessSet] = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self._done = False

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if not self._done:
            broadcast_state(self.model, self.model.optimizer, root_rank=self.root_rank,
                                 process_set=self.process_set)
            self._done = True


class MetricAverage(keras.callbacks.Callback):
    """At the end of each epoch, replace every logged metric with its average over ranks.

    Put it before callbacks that read the metrics (checkpoints, early stopping),
    so that every rank sees, and decides on, the same numbers. With
    ``process_set``, the average is over the set's members.

    Example:
        >>> model.fit(x, y, callbacks=[hvdp.keras.MetricAverage()])  # doctest: +SKIP
    """

    def __init__(self, process_set: Optional[ProcessSet] = None) -> None:
        super().__init__()
        self.process_set = process_set

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if not logs:
            return
        for key in sorted(logs):
            value = logs[key]
            if isinstance(value, (int, float)) or getattr(value, "shape", None) == ():
                logs[key] = allreduce(float(value), name=f"hvdp.metric.{key}", process_set=self.process_set)


class LearningRateWarmup(keras.callbacks.Callback):
    """Linear learning-rate warm-up for the linear scaling rule.

    With ``size()`` replicas the learning rate is usually scaled to
    ``size() * lr``; starting there can diverge. This callback starts at
    ``target_lr / size()`` (the single-process rate) and rises linearly, batch by
    batch, to ``target_lr`` over ``warmup_epochs`` epochs.

    Args:
        target_lr: the learning rate to reach (default: the optimizer's rate at the start).
        warmup_epochs: epochs the ramp takes.
        verbose: print the rate reached at the end of the warm-up (rank 0).
        process_set: the set training this model: its size replaces ``size()``.

    Example:
        >>> model.fit(x, y, callbacks=[hvdp.keras.LearningRateWarmup(warmup_epochs=3)])  # doctest: +SKIP
    """

    def __init__(self, target_lr: Optional[float] = None, warmup_epochs: float = 5, verbose: int = 0,
                 process_set: Optional[ProcessSet] = None) -> None:
        super().__init__()
        self.process_set = process_set
        if warmup_epochs <= 0:
            raise ValueError(f"warmup_epochs={warmup_epochs!r}; expected a number > 0.")
        self.target_lr = target_lr
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose
        self._epoch = 0
        self._steps: Optional[int] = None

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.target_lr is None:
            self.target_lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        self._steps = self.params.get("steps") if self.params else None

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self._epoch >= self.warmup_epochs or self.target_lr is None:
            return
        progress = (self._epoch + (batch / self._steps if self._steps else 0.0)) / self.warmup_epochs
        size = _runtime.current("keras.LearningRateWarmup").size() if self.process_set is None \
            else self.process_set.size()
        self.model.optimizer.learning_rate = lr_at(self.target_lr, size, min(progress, 1.0))

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if epoch + 1 == self.warmup_epochs and self.target_lr is not None:
            self.model.optimizer.learning_rate = self.target_lr
            backend = _runtime.current("keras.LearningRateWarmup")
            leader = backend.rank() == 0 if self.process_set is None else self.process_set.rank() == 0
            if self.verbose and leader:
                print(f"hvdp: learning-rate warm-up done: {self.target_lr:g}")


def lr_at(target_lr: float, size: int, progress: float) -> float:
    """The warm-up learning rate after ``progress`` (0..1): from ``target_lr / size`` to ``target_lr``."""
    start = target_lr / size
    return start + (target_lr - start) * progress
