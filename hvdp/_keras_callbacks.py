"""Keras 3 callbacks for data-parallel training (imported lazily by :mod:`hvdp.keras`)."""

from __future__ import annotations

from typing import Any, Dict, Optional

import keras

from hvdp import _keras_fit, _runtime
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

    A model compiled with an :func:`hvdp.DistributedOptimizer` needs it no more: ``fit`` and
    ``evaluate`` already read their metrics over the optimizer's ranks, weighted by each rank's
    examples, and this callback then leaves those logs as they are (no second average). It still
    averages the logs of other models, equally per rank. Put it before callbacks that read the
    metrics (checkpoints, early stopping), so that every rank sees, and decides on, the same numbers.
    With ``process_set``, the average is over the set's members.

    Example:
        >>> model.fit(x, y, callbacks=[hvdp.keras.MetricAverage()])  # doctest: +SKIP
    """

    def __init__(self, process_set: Optional[ProcessSet] = None) -> None:
        super().__init__()
        self.process_set = process_set

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        job = _keras_fit.job_of(self.model)
        if not logs or (job is not None and job.process_set is self.process_set):  # over these ranks already
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
        momentum_correction: when the rate changes from ``a`` to ``b``, scale the optimizer's
            momentum buffers by ``b / a`` (Goyal et al.; Horovod's default), so the momentum
            carried from earlier steps moves the weights at the new rate (SGD with momentum; other
            optimizers have no such buffers and are left alone).
        steps_per_epoch: batches per epoch, when ``fit`` cannot tell (a dataset without a length).
        verbose: print the rate reached at the end of the warm-up (rank 0).
        process_set: the set training this model: its size replaces ``size()``.

    Example:
        >>> model.fit(x, y, callbacks=[hvdp.keras.LearningRateWarmup(warmup_epochs=3)])  # doctest: +SKIP
    """

    def __init__(self, target_lr: Optional[float] = None, warmup_epochs: float = 5, verbose: int = 0,
                 process_set: Optional[ProcessSet] = None, *, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None) -> None:
        super().__init__()
        self.process_set = process_set
        if warmup_epochs <= 0:
            raise ValueError(f"warmup_epochs={warmup_epochs!r}; expected a number > 0.")
        self.target_lr = target_lr
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = _check_steps(steps_per_epoch, "LearningRateWarmup")
        self._epoch = 0
        self._steps: Optional[int] = None

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.target_lr is None:
            self.target_lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        self._steps = _steps(self, "LearningRateWarmup")

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self._epoch >= self.warmup_epochs or self.target_lr is None:
            return
        progress = (self._epoch + batch / self._steps) / self.warmup_epochs if self._steps else 1.0
        size = _runtime.current("keras.LearningRateWarmup").size() if self.process_set is None \
            else self.process_set.size()
        set_lr(self.model.optimizer, lr_at(self.target_lr, size, min(progress, 1.0)), self.momentum_correction)

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if epoch + 1 == self.warmup_epochs and self.target_lr is not None:
            set_lr(self.model.optimizer, self.target_lr, self.momentum_correction)
            backend = _runtime.current("keras.LearningRateWarmup")
            leader = backend.rank() == 0 if self.process_set is None else self.process_set.rank() == 0
            if self.verbose and leader:
                print(f"hvdp: learning-rate warm-up done: {self.target_lr:g}")


class LearningRateSchedule(keras.callbacks.Callback):
    """The learning rate ``initial_lr * multiplier(epoch)`` from ``start_epoch`` up to (not including)
    ``end_epoch`` (Horovod's LearningRateScheduleCallback): a step decay after a warm-up, say.

    Args:
        initial_lr: the rate the multiplier scales (default: the optimizer's rate at the start).
        multiplier: a number, or a function of the epoch (a float within the epoch when
            ``staircase=False``).
        start_epoch, end_epoch: the epochs it sets the rate in (``end_epoch=None``: to the end).
        staircase: one rate per epoch (True), or a new one every batch from the fractional epoch.
        momentum_correction: scale the momentum buffers when the rate changes (see
            :class:`LearningRateWarmup`).
        steps_per_epoch: batches per epoch, when ``fit`` cannot tell.

    Example:
        >>> warmup = hvdp.keras.LearningRateWarmup(warmup_epochs=5)                       # doctest: +SKIP
        >>> tenth = lambda epoch: 0.1 ** (epoch // 30)                                    # doctest: +SKIP
        >>> decay = hvdp.keras.LearningRateSchedule(start_epoch=5, multiplier=tenth)     # doctest: +SKIP
        >>> model.fit(x, y, epochs=90, callbacks=[warmup, decay])                          # doctest: +SKIP
    """

    def __init__(self, initial_lr: Optional[float] = None, multiplier: Any = 1.0, start_epoch: int = 0,
                 end_epoch: Optional[int] = None, staircase: bool = True, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None) -> None:
        super().__init__()
        if not callable(multiplier) and not isinstance(multiplier, (int, float)):
            raise TypeError(f"hvdp.keras.LearningRateSchedule: multiplier={multiplier!r}; give a number or a "
                            f"function of the epoch (multiplier=lambda epoch: 0.1 ** (epoch // 30)).")
        if end_epoch is not None and end_epoch <= start_epoch:
            raise ValueError(f"hvdp.keras.LearningRateSchedule: end_epoch={end_epoch!r} is not after "
                             f"start_epoch={start_epoch!r}; the schedule would never apply.")
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch, self.staircase = start_epoch, end_epoch, staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = _check_steps(steps_per_epoch, "LearningRateSchedule")
        self._epoch = 0
        self._steps: Optional[int] = None

    def _applies(self, epoch: int) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.initial_lr is None:
            self.initial_lr = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        if not self.staircase:
            self._steps = _steps(self, "LearningRateSchedule")

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        self._epoch = epoch
        if self.staircase and self._applies(epoch) and self.initial_lr is not None:
            set_lr(self.model.optimizer, self.initial_lr * self.multiplier(epoch), self.momentum_correction)

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.staircase or not self._applies(self._epoch) or self.initial_lr is None or not self._steps:
            return
        rate = self.initial_lr * self.multiplier(self._epoch + batch / self._steps)
        set_lr(self.model.optimizer, rate, self.momentum_correction)


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``keras.callbacks.ModelCheckpoint`` that saves on rank 0 only (of ``process_set``, when given): the
    replicas are equal, and ranks writing one file at once can leave it torn. Put
    :class:`MetricAverage` before it when it monitors a metric. Takes Keras's arguments. With
    ``shard_optimizer_state=True`` every rank gathers the whole optimizer state first, and the
    file holds it as an unsharded optimizer's (``keras.models.load_model`` reads it).

    Example:
        >>> save = hvdp.keras.ModelCheckpoint("best.keras", monitor="loss", save_best_only=True)  # doctest: +SKIP
        >>> model.fit(x, y, callbacks=[hvdp.keras.MetricAverage(), save])                   # doctest: +SKIP
    """

    def __init__(self, *args: Any, process_set: Optional[ProcessSet] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.process_set = process_set

    def _leader(self) -> bool:
        if self.process_set is not None:
            return self.process_set.rank() == 0
        return bool(_runtime.current("keras.ModelCheckpoint").rank() == 0)

    def _prepare(self, saving: bool) -> Any:
        """A sharded optimizer's whole state, gathered on every rank when rank 0 may save: the clean-up after."""
        optimizer = getattr(self.model, "optimizer", None)
        sharding = getattr(optimizer, "_hvdp_shards", None)
        if saving and sharding is not None:
            optimizer._hvdp_prepare_save()  # type: ignore[union-attr]
        return lambda: setattr(sharding, "prepared", None) if sharding is not None else None

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        saving = False
        if isinstance(self.save_freq, int):  # Keras's count, kept on every rank
            self._hvdp_batches = getattr(self, "_hvdp_batches", 0) + 1
            saving = self._hvdp_batches >= self.save_freq
            self._hvdp_batches = 0 if saving else self._hvdp_batches
        optimizer: Any = getattr(self.model, "optimizer", None)
        guard = getattr(optimizer, "_hvdp_guard", None)
        if saving and guard is not None and guard.every:  # (at an epoch's end, fit has compared them already)
            guard.check(optimizer._hvdp_parameters_of(self.model), f"before saving after batch {batch + 1}")
        done = self._prepare(saving)
        if self._leader():
            super().on_train_batch_end(batch, logs)
        done()

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        done = self._prepare(self.save_freq == "epoch")
        if self._leader():
            super().on_epoch_end(epoch, logs)
        done()


def set_lr(optimizer: Any, rate: float, momentum_correction: bool) -> None:
    """Set the optimizer's learning rate; with ``momentum_correction``, scale its momentum buffers by new / old."""
    old = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
    optimizer.learning_rate = rate
    buffers = getattr(optimizer, "momentums", None) if getattr(optimizer, "momentum", 0) else None
    if momentum_correction and buffers and old > 0 and rate != old:
        for buffer in buffers:
            buffer.assign(buffer * (rate / old))


def _check_steps(steps: Optional[int], caller: str) -> Optional[int]:
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"hvdp.keras.{caller}: steps_per_epoch={steps!r}; give the batches per epoch, a whole "
                         f"number >= 1, or leave it out when fit knows them.")
    return steps


def _steps(callback: Any, caller: str) -> int:
    """Batches per epoch: the callback's steps_per_epoch, else fit's; refused when neither is known."""
    steps = callback.steps_per_epoch or (callback.params.get("steps") if callback.params else None)
    if not steps:
        raise ValueError(f"hvdp.keras.{caller} changes the rate batch by batch, but fit does not know the "
                         f"batches per epoch (a dataset without a length). Give steps_per_epoch=N.")
    return int(steps)


def lr_at(target_lr: float, size: int, progress: float) -> float:
    """The warm-up learning rate after ``progress`` (0..1): from ``target_lr / size`` to ``target_lr``."""
    start = target_lr / size
    return start + (target_lr - start) * progress
