"""Keras inside a running job: what hvdp adds to Keras itself, once Keras is imported.

- ``keras.models.load_model`` (every loader that compiles a model from its saved config)
  gives back an optimizer that still averages (:func:`rewrap_loaded_optimizers`);
- ``model.fit`` runs the drift guard of an hvdp optimizer after each batch, joins the
  ranks at each epoch's end inside ``hvdp.join``, and runs the ranks' agreement of
  :mod:`hvdp._keras_fit` around the user's callbacks (:func:`guard_fits`).

Installed by ``hvdp.init()`` through :func:`when_imported`, so a script that imports Keras
after ``hvdp.init()`` (as it must, for ``KERAS_BACKEND``) gets them too. Nothing here imports
Keras, or any other part of hvdp, at import time.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Callable, List, Optional, Tuple


def is_distributed(optimizer: object) -> bool:
    """True for a Keras optimizer already wrapped by :func:`wrap_optimizer`."""
    return bool(getattr(type(optimizer), "_hvdp_distributed", False))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` right after module ``name`` is first imported (one shot)."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_call(module: Any) -> None:
            exec_module(module)
            self.callback()

        loader.exec_module = exec_then_call  # type: ignore[method-assign]
        return spec


def when_imported(callback: Callable[[], None]) -> None:
    """Run ``callback`` once Keras is imported: now if it is, else right after ``import keras``."""
    if "keras" in sys.modules:
        callback()
    elif not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport("keras", callback))


def rewrap_loaded_optimizers(wrap: Callable[[Any], Any], distributed_job: Callable[[], bool]) -> None:
    """Make ``keras.models.load_model`` (and every loader that compiles from a saved config) keep the job distributed.

    A saved hvdp optimizer keeps its class name, so Keras loads it back as the plain
    optimizer, which would train each replica on its own data alone. While a job of
    more than one process runs, the optimizer a loaded model is compiled with is wrapped
    again (``wrap``: :func:`hvdp.DistributedOptimizer` with its defaults) before its saved
    state is loaded into it.
    """
    from keras.src.trainers.trainer import Trainer

    original = Trainer.compile_from_config
    if getattr(original, "_hvdp_rewraps", False):
        return

    def compile_from_config(self: Any, config: Any) -> None:
        original(self, config)
        optimizer = getattr(self, "optimizer", None)
        if optimizer is not None and is_keras_optimizer(optimizer) and not is_distributed(optimizer) \
                and distributed_job():
            wrap(optimizer)

    compile_from_config._hvdp_rewraps = True  # type: ignore[attr-defined]
    Trainer.compile_from_config = compile_from_config


def attach_guard(optimizer: Any, after_step: Callable[[Callable[[], List[Tuple[str, Any]]]], None],
                 parameters_of: Callable[[Any], List[Tuple[str, Any]]]) -> None:
    """Give a wrapped Keras optimizer the drift guard that ``model.fit`` calls after each batch.

    Keras runs the update inside a compiled train step, where no Python runs; ``fit``'s
    callbacks run between steps, so :func:`guard_fits` adds one that calls ``after_step``
    with the model's parameters (listed by ``parameters_of(model)`` only on checked steps).
    """
    optimizer._hvdp_after_step = after_step
    optimizer._hvdp_parameters_of = parameters_of


#: While an ``hvdp.join`` block is open: the call that joins every rank and syncs their state.
epoch_join: List[Optional[Callable[[], Any]]] = [None]
#: In a job: given (model, the user's callbacks, (epochs, initial epoch), inside hvdp.join), the callbacks
#: ``fit`` runs instead, with the ranks' agreement around them, or None where the model needs none
#: (:func:`hvdp._keras_fit.agreeing_callbacks`).
agree_in_fit: List[Optional[Callable[[Any, List[Any], Tuple[int, int], bool], Optional[List[Any]]]]] = [None]


def guard_fits() -> None:
    """Make ``model.fit`` run the drift guard of a model whose optimizer has one (:func:`attach_guard`),
    and, inside an ``hvdp.join`` block, join the ranks at each epoch's end (:data:`epoch_join`)."""
    import inspect

    import keras

    # Each Keras backend's trainer defines its own fit; keras.Model is the class they all share.
    original = keras.Model.fit
    if getattr(original, "_hvdp_guards", False):
        return
    signature = inspect.signature(original)

    class DriftCheck(keras.callbacks.Callback):
        """hvdp's drift guard, after each training batch of ``fit``."""

        def __init__(self, optimizer: Any) -> None:
            super().__init__()
            self.optimizer_checked = optimizer

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            optimizer = self.optimizer_checked
            optimizer._hvdp_after_step(lambda: optimizer._hvdp_parameters_of(self.model))

    class EpochJoin(keras.callbacks.Callback):
        """Ranks with fewer batches wait here for the others; then all hold the last one's state."""

        def __init__(self, sync: Callable[[], Any]) -> None:
            super().__init__()
            self.sync = sync

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.sync()

    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        optimizer: Any = getattr(self, "optimizer", None)
        if is_distributed(getattr(optimizer, "inner_optimizer", None)):
            raise ValueError(
                "keras.optimizers.LossScaleOptimizer(hvdp.DistributedOptimizer(opt)): the loss scaler would check "
                "each rank's own gradients for overflow, so one rank could skip a step the others take, and they "
                "would wait for it. Wrap it the other way round: "
                "hvdp.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(opt)).")
        guarded = getattr(optimizer, "_hvdp_after_step", None) is not None
        sync = epoch_join[0]
        bound = signature.bind(self, *args, **kwargs)
        callbacks = list(bound.arguments.get("callbacks") or [])
        epochs = bound.arguments.get("epochs", signature.parameters["epochs"].default)
        first = bound.arguments.get("initial_epoch", signature.parameters["initial_epoch"].default)
        agreeing = None if agree_in_fit[0] is None else agree_in_fit[0](
            self, callbacks, (epochs, getattr(self, "_initial_epoch", None) or first), sync is not None)
        if not guarded and sync is None and agreeing is None:
            return original(self, *args, **kwargs)
        if agreeing is not None:  # the logs are the ranks' already; every rank stops where one asks to
            callbacks = agreeing
        if sync is not None:  # first: the callbacks after it may reduce, and need every rank
            callbacks.insert(0, EpochJoin(sync))
        if guarded:
            callbacks.append(DriftCheck(optimizer))
        bound.arguments["callbacks"] = callbacks
        if guarded:  # its updates are checked by DriftCheck, not by the optimizer's own check
            optimizer._hvdp_in_fit = True
        try:
            history = original(*bound.args, **bound.kwargs)
        finally:
            if guarded:
                optimizer._hvdp_in_fit = False
        guard = getattr(optimizer, "_hvdp_guard", None)
        if guarded and guard is not None and guard.every:  # no fit ends with its replicas apart
            guard.check(optimizer._hvdp_parameters_of(self), "at the end of model.fit")
        return history

    fit._hvdp_guards = True  # type: ignore[attr-defined]
    keras.Model.fit = fit


def is_keras_optimizer(obj: object) -> bool:
    """True for a Keras 3 optimizer (checked without importing Keras)."""
    keras = sys.modules.get("keras")
    optimizers = getattr(keras, "optimizers", None)
    base = getattr(optimizers, "Optimizer", None)
    return base is not None and isinstance(obj, base)
