"""``model.fit`` and ``model.evaluate`` in a job, as under MultiWorkerMirroredStrategy.

A Keras script written for one process reads its metrics in callbacks (``EarlyStopping``,
``ReduceLROnPlateau``, ``ModelCheckpoint(save_best_only=True)``) and stops when one of them sets
``model.stop_training``. With each rank training and validating on its own slice, each rank would
read its own numbers, decide on its own, and leave the others waiting. Here, for a model compiled
with an :func:`hvdp.DistributedOptimizer` in a job of more than one process:

- **global metrics**: the metrics' state (each Keras metric keeps sums and counts, each variable
  declaring how replicas combine it: ``aggregation="sum"``, ``"mean"``, ...) is reduced over the
  ranks before ``fit`` or ``evaluate`` reads it, so the logs every callback receives, ``History``
  and ``evaluate``'s result are those of the union of the ranks' examples, weighted by each rank's
  count (one allreduce where Keras reads its metrics: once per epoch, and once per validation);
- **one decision to stop**: after the callbacks of each epoch (and of each batch when a callback
  may stop between batches), the ranks agree on ``model.stop_training``; when any rank's callback
  set it, every rank stops there, and rank 0 says which rank and which callback;
- **the same fit everywhere**: at ``fit``'s start the ranks compare their epochs and batches per
  epoch and refuse at once, on every rank, when they differ (outside ``hvdp.join``);
- **identical replicas where a run ends**: the drift guard compares the replicas at each epoch's
  end (before any callback, so a checkpoint never saves replicas apart) and when ``fit`` returns.

Installed by ``hvdp.init()`` once Keras is imported (:func:`install`, given to the runtime by the facade);
imports Keras only when called.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from hvdp import _keras_jobs, _runtime
from hvdp.collectives import allgather_object, allreduce
from hvdp.errors import TrainingMismatchError

#: Keras's callbacks that read the logs between batches but never set ``model.stop_training``: with
#: only these, the ranks agree on stopping once per epoch, not once per batch.
NEVER_STOP = ("ProgbarLogger", "History", "ModelCheckpoint", "TensorBoard", "CSVLogger", "BackupAndRestore",
              "LearningRateScheduler", "RemoteMonitor", "SwapEMAWeights")


class Job:
    """The ranks a model trains on (its optimizer's process set, or the whole job) and their collectives."""

    def __init__(self, process_set: Any) -> None:
        self.process_set = process_set
        backend = _runtime.current("keras fit")
        self.rank = backend.rank() if process_set is None else process_set.rank()
        self.size = backend.size() if process_set is None else process_set.size()

    def sum(self, values: np.ndarray, name: str) -> np.ndarray:
        return np.asarray(allreduce(values, op="sum", name=name, process_set=self.process_set))

    def gather(self, obj: Any) -> List[Any]:
        return allgather_object(obj, process_set=self.process_set)


def job_of(model: Any) -> Optional[Job]:
    """The :class:`Job` of a model compiled with an hvdp optimizer in a job of more than one process, else None."""
    optimizer = getattr(model, "optimizer", None)
    if not _keras_jobs.is_distributed(optimizer):
        return None
    backend = _runtime.job().backend
    if backend is None or not backend.is_initialized():
        return None
    found = Job(getattr(optimizer, "_hvdp_process_set", None))
    return found if found.size > 1 else None


def _metric_variables(model: Any) -> List[Any]:
    seen, found = set(), []
    for metric in model.metrics:
        for variable in metric.variables:
            if id(variable) not in seen and getattr(variable, "aggregation", "sum") in ("sum", "mean",
                                                                                         "only_first_replica"):
                seen.add(id(variable))
                found.append(variable)
    return found


def reduce_metrics(model: Any, job: Job, logs: Any, state: bool = True) -> Dict[str, float]:
    """Replace every metric's state by its combination over the ranks (one allreduce); return ``logs``'s
    numbers averaged over the ranks too (for a custom step whose logs are not the metrics').

    Each variable is combined as it declares: "sum" (totals, counts: the union's value), "mean", or
    "only_first_replica" (the first rank's). ``state=False``: the logs alone.
    """
    import keras

    variables = _metric_variables(model) if state else []
    values = [np.asarray(keras.ops.convert_to_numpy(v), dtype=np.float64).ravel() for v in variables]
    for variable, value in zip(variables, values):
        if variable.aggregation == "only_first_replica" and job.rank != 0:
            value[:] = 0.0
    numbers = {k: float(v) for k, v in sorted((logs or {}).items())
               if isinstance(v, (int, float)) or getattr(v, "shape", None) == ()}
    flat = np.concatenate([*values, np.asarray(list(numbers.values()), dtype=np.float64)])
    if flat.size == 0:  # nothing to reduce (the same on every rank: their models are one)
        return {}
    total = job.sum(flat, "hvdp.keras.metrics")
    at = 0
    for variable, value in zip(variables, values):
        combined = total[at:at + value.size] / (job.size if variable.aggregation == "mean" else 1)
        variable.assign(combined.reshape(variable.shape).astype(variable.dtype))
        at += value.size
    return {key: float(v) / job.size for key, v in zip(numbers, total[at:])}


def install() -> None:
    """Give ``fit`` and ``evaluate`` the ranks' metrics and agreement (Keras is imported)."""
    global_metrics()
    _keras_jobs.agree_in_fit[0] = agreement


def agreement(model: Any, callbacks: List[Any], epochs: Tuple[int, int], joining: bool) -> Optional[List[Any]]:
    """The callbacks ``fit`` runs for a model in a job of several ranks (None for any other model)."""
    job = job_of(model)
    if job is None:
        return None
    optimizer = model.optimizer
    return agreeing_callbacks(job, [c for c in callbacks if not averages_metrics(c)], optimizer,
                              getattr(optimizer, "_hvdp_parameters_of", None), joining, epochs)


def global_metrics() -> None:
    """Make Keras read its metrics over every rank of the model's job (see the module's text)."""
    from keras.src.trainers.trainer import Trainer

    original = Trainer._get_metrics_result_or_logs
    if getattr(original, "_hvdp_global", False):
        return

    def _get_metrics_result_or_logs(self: Any, logs: Any) -> Any:
        job = job_of(self)
        if job is None or _keras_jobs.epoch_join[0] is not None:  # inside hvdp.join: averaged after the join
            return original(self, logs)
        averaged = reduce_metrics(self, job, logs)
        result = original(self, logs)
        if result is logs and isinstance(logs, dict):  # a custom step's own logs: their average over the ranks
            result = {**logs, **averaged}
        return result

    _get_metrics_result_or_logs._hvdp_global = True  # type: ignore[attr-defined]
    Trainer._get_metrics_result_or_logs = _get_metrics_result_or_logs


#: The hooks between two batches of ``fit``.
BATCH_HOOKS = ("on_train_batch_end", "on_batch_end", "on_train_batch_begin", "on_batch_begin")


def may_stop_between_batches(callback: Any) -> bool:
    """Whether a user's callback may set ``model.stop_training`` between two batches of ``fit``: it, or a
    class of its own above Keras's (other than :data:`NEVER_STOP`'s and hvdp's), has a batch hook."""
    for kind in type(callback).__mro__:
        ours = kind.__module__.startswith("hvdp.")
        if ours or kind is object or (kind.__module__.startswith("keras.") and
                                      (kind.__name__ in NEVER_STOP or kind.__name__ == "Callback")):
            continue
        if any(hook in vars(kind) for hook in BATCH_HOOKS):
            return True
    return any(hook in vars(callback) for hook in BATCH_HOOKS)


def averages_metrics(callback: Any) -> bool:
    """Horovod's ``MetricAverageCallback`` (hvdp's build keeps it): its average is already in the logs."""
    kind = type(callback)
    return kind.__name__ == "MetricAverageCallback" and kind.__module__.startswith("horovod.")


def agreeing_callbacks(job: Job, user: List[Any], optimizer: Any, parameters_of: Optional[Callable[[Any], Any]],
                       joining: bool, epochs: Tuple[int, int]) -> List[Any]:
    """The user's callbacks, with hvdp's around them: the start check and the epoch's drift check first, a
    probe after each (which callback set ``model.stop_training``), the agreement to stop last.

    ``epochs``: fit's (epochs, initial epoch); ``joining``: inside ``hvdp.join`` (batches may differ).
    """
    import keras

    class Watch:
        """Which callback first set ``model.stop_training`` since the last agreement."""

        who: Optional[str] = None
        when: str = ""

    watch = Watch()
    per_batch = any(may_stop_between_batches(c) for c in user)
    guard: Any = getattr(optimizer, "_hvdp_guard", None)
    checking = guard is not None and guard.every > 0 and parameters_of is not None

    class Start(keras.callbacks.Callback):
        """Before the user's callbacks: the ranks' fits compared; each epoch's drift check."""

        def on_train_begin(self, logs: Any = None) -> None:
            steps = None if joining else self.params.get("steps")
            everyone = [tuple(theirs) for theirs in job.gather([*epochs, steps])]
            if len(set(everyone)) > 1:
                shown = "; ".join(f"rank {r}: epochs {first + 1}-{last} of {s if s is not None else 'unknown'} "
                                  f"batches" for r, (last, first, s) in enumerate(everyone))
                raise TrainingMismatchError(
                    f"model.fit differs between the ranks ({shown}). Every rank must take the same steps, or the "
                    f"others wait for it in the gradients' allreduce: give every rank the same epochs and the same "
                    f"number of batches (hvdp.shard(n, drop_remainder=True) for the indices), or fit inside "
                    f"hvdp.join(model, optimizer) for uneven data.")

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if joining and logs:  # the ranks met only now (hvdp.join): each log averaged over them, equally
                logs.update(reduce_metrics(self.model, job, logs, state=False))
            if checking:  # before any callback: a checkpoint saved below holds replicas checked equal
                guard.check(parameters_of(self.model), f"at the end of epoch {epoch + 1}")  # type: ignore[misc]

    class Probe(keras.callbacks.Callback):
        def __init__(self, after: str) -> None:
            super().__init__()
            self.after = after

        def _look(self, when: str) -> None:
            if watch.who is None and self.model.stop_training:
                watch.who, watch.when = self.after, when

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self._look(f"epoch {epoch + 1}")

        if per_batch:
            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                self._look(f"batch {batch + 1}")

    class Agree(keras.callbacks.Callback):
        """After the user's callbacks: every rank stops where any one asked to."""

        epoch, agreed = 0, False

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.epoch = epoch

        def _agree(self, where: str) -> None:
            if self.agreed:  # every rank stopped between batches: they agreed there already
                return
            flags = np.zeros(job.size)
            flags[job.rank] = 1.0 if self.model.stop_training else 0.0
            stopping = job.sum(flags, "hvdp.keras.stop_training")
            if not stopping.any():
                return
            reasons = job.gather(watch.who if self.model.stop_training else None)
            self.model.stop_training = self.agreed = True
            if job.rank == 0:
                by = [f"rank {r} ({reason or 'model.stop_training'})" for r, reason in enumerate(reasons)
                      if stopping[r]]
                everyone = "every rank" if stopping.all() else f"{' and '.join(by)} set model.stop_training, so " \
                                                                "every rank"
                detail = f" ({', '.join(sorted(set(r for r in reasons if r)))})" if stopping.all() else ""
                print(f"hvdp: {everyone} stops training after {where}{detail}.", flush=True)
            watch.who = None

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self._agree(f"epoch {epoch + 1}")

        if per_batch:
            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                self._agree(f"batch {batch + 1} of epoch {self.epoch + 1}")

    everything: List[Any] = [Start(), Probe("model.fit's train step")]
    for callback in user:
        everything += [callback, Probe(type(callback).__name__)]
    return everything + [Agree()]
