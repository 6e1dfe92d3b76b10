"""Picks the framework once, loads its backend, and holds it for the process (in :mod:`hvdp._state`'s job state).

Order of precedence: ``hvdp.init(framework=...)`` > ``HVDP_FRAMEWORK`` (set by
``hvdp run --framework``) > the only framework that is importable. A script
that asks for one framework while the launcher said another is an error, never
a guess. The frameworks, their pins and their backends come from one table,
:mod:`hvdp.frameworks`.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence

from hvdp import _keras_jobs, consistency, failures, profiler
from hvdp._state import job
from hvdp.backends import direct, openmpi
from hvdp.errors import (
    FrameworkError,
    NotInitializedError,
    ProcessSetError,
    ReplicaMismatchError,
    TrainingMismatchError,
)
from hvdp.frameworks import SPECS

if TYPE_CHECKING:
    from hvdp.backends.base import Backend

#: The frameworks hvdp supports, by the name used everywhere in hvdp (the registry's order).
FRAMEWORKS = tuple(SPECS)
#: The environment variable ``hvdp run --framework`` sets for every process.
ENV_VAR = "HVDP_FRAMEWORK"
#: How each framework is installed when it is missing.
INSTALL_HINT = {name: f"pip install {spec.requirement}" for name, spec in SPECS.items()}


def _running_rank() -> Optional[int]:
    backend = job().backend
    return backend.rank() if backend is not None and backend.is_initialized() else None


profiler.rank_from(_running_rank)

#: How an optimizer is made to average, given by the facade (hvdp.DistributedOptimizer): Keras
#: optimizers loaded inside a job are wrapped with it again.
_optimizer_wrapper: List[Callable[[Any], Any]] = []


def wrap_optimizers_with(wrap: Callable[[Any], Any]) -> None:
    """Let the runtime re-wrap Keras optimizers that ``load_model`` gives back, with ``wrap``."""
    _optimizer_wrapper[:] = [wrap]


#: What the facade adds to Keras's ``fit`` and ``evaluate`` in a job (hvdp._keras_fit.install), run once
#: Keras is imported.
_keras_semantics: List[Callable[[], None]] = []


def keras_semantics_from(install: Callable[[], None]) -> None:
    """Let the runtime give ``fit`` and ``evaluate`` the ranks' metrics and agreement, by ``install``."""
    _keras_semantics[:] = [install]


def check_name(name: object, source: str) -> str:
    """Return ``name`` if it is a supported framework, else raise FrameworkError."""
    if not isinstance(name, str) or name not in FRAMEWORKS:
        hint = ""
        if name in ("pytorch", "pt"):
            hint = " Did you mean 'torch'?"
        elif name in ("tf", "keras"):
            hint = " Did you mean 'tensorflow'?"
        raise FrameworkError(
            f"Unknown framework {name!r} (from {source}). "
            f"Expected one of: {', '.join(FRAMEWORKS)}.{hint}"
        )
    return name


def is_installed(name: str) -> bool:
    """True when the framework's package can be imported (without importing it)."""
    return importlib.util.find_spec(name) is not None


def resolve(requested: Optional[str], environ: Optional[dict] = None) -> str:
    """Decide which framework this process uses, refusing contradictions.

    Args:
        requested: what the script passed to ``hvdp.init(framework=...)``, or None.
        environ: the environment to read (default ``os.environ``).

    Example:
        >>> resolve("torch", {})
        'torch'
    """
    env = os.environ if environ is None else environ
    from_env = env.get(ENV_VAR) or None
    if requested is not None:
        check_name(requested, "hvdp.init(framework=...)")
    if from_env is not None:
        check_name(from_env, f"the environment variable {ENV_VAR}")
    if requested is not None and from_env is not None and requested != from_env:
        raise FrameworkError(
            f"The script asks for framework {requested!r} but the launcher set "
            f"{ENV_VAR}={from_env!r} (hvdp run --framework {from_env}). "
            f"Use the same framework in both places, or drop one of them."
        )
    chosen = requested or from_env
    if chosen is None:
        available = [name for name in FRAMEWORKS if is_installed(name)]
        if len(available) == 1:
            chosen = available[0]
        elif not available:
            raise FrameworkError(
                "Neither torch nor tensorflow is installed. Install one: "
                f"{INSTALL_HINT['torch']} or {INSTALL_HINT['tensorflow']}."
            )
        else:
            raise FrameworkError(
                "Both torch and tensorflow are installed, so hvdp cannot guess. "
                "Say which: hvdp.init(framework='torch'), or "
                "hvdp run --framework torch|tensorflow, or HVDP_FRAMEWORK=torch."
            )
    if not is_installed(chosen):
        raise FrameworkError(
            f"Framework {chosen!r} was chosen but is not installed. "
            f"Install it ({INSTALL_HINT[chosen]}), then rebuild Horovod for it: hvdp build."
        )
    _check_keras_backend(chosen, env)
    return chosen


def _check_keras_backend(framework: str, env: "os._Environ[str] | dict") -> None:
    keras_backend = env.get("KERAS_BACKEND")
    if keras_backend and keras_backend != framework:
        raise FrameworkError(
            f"KERAS_BACKEND={keras_backend!r} contradicts framework {framework!r}: "
            f"Keras models would run on {keras_backend} while hvdp reduces "
            f"gradients with {framework}. Unset KERAS_BACKEND or set it to {framework!r}."
        )


def _check_loaded_keras(framework: str) -> None:
    """Keras picks its backend when first imported: refuse one imported on another backend."""
    keras = sys.modules.get("keras")
    backend = getattr(getattr(keras, "backend", None), "backend", None)
    if backend is not None and backend() != framework:
        raise FrameworkError(
            f"Keras was imported before hvdp.init() and runs on {backend()!r}, not {framework!r}. "
            f"Import keras after hvdp.init(), or set KERAS_BACKEND={framework} before starting Python."
        )


def load_backend(name: str) -> "Backend":
    """Import the backend for ``name``; turn Horovod import failures into fixes."""
    try:
        module = importlib.import_module(SPECS[name].backend_module)
    except ImportError as exc:
        if getattr(exc, "name", None) == "horovod":
            raise FrameworkError(
                "Horovod is not installed in this environment. "
                "Build and install it for the installed frameworks: hvdp build."
            ) from exc
        if (getattr(exc, "name", None) or "").split(".")[0] == "hvdp":
            raise  # one of hvdp's own modules: its error as it is, not a fault of the framework's install
        if "horovod" in str(exc):
            raise FrameworkError(
                f"Horovod is installed but its {name} support cannot be loaded ({exc}). "
                f"Rebuild Horovod for the frameworks installed now: hvdp build."
            ) from exc
        raise FrameworkError(
            f"Importing {name} failed ({exc}). Reinstall it: {INSTALL_HINT[name]}."
        ) from exc
    backend: Backend = module.Backend()
    return backend


#: Seconds Horovod's initialization may take beyond the stall timeout before the rank ends itself
#: (:func:`hvdp.failures.ended_if_stuck`): the ranks reach ``hvdp.init()`` apart by their imports' times
#: (TensorFlow's took 20-30 s here on a loaded machine), and each waits there for the last.
INIT_SLACK_S = 60.0


def activate(
    requested: Optional[str],
    comm: Any = None,
    process_sets: Sequence[List[int]] = (),
    dynamic: bool = False,
) -> Optional[List[Any]]:
    """Choose and initialize the backend (idempotent for the same framework and no new groups).

    Args:
        requested: the framework the script asked for, or None.
        comm: None, an mpi4py communicator or a list of MPI ranks (validated).
        process_sets: the ranks of each process set to register at start.
        dynamic: whether process sets may be added later.

    Returns:
        The backend's handle of each process set, or None when hvdp was already running.
    """
    failures.install()  # under hvdp run, an uncaught exception of this rank becomes a record
    state = job()
    name = resolve(requested)
    if state.backend is not None:
        if state.backend.name != name:
            raise FrameworkError(
                f"hvdp is already initialized with {state.backend.name!r}; cannot switch "
                f"to {name!r} in the same process. Call hvdp.shutdown() first."
            )
        if state.backend.is_initialized():
            if comm is not None or process_sets or dynamic:
                raise ProcessSetError(
                    "hvdp is already initialized, and comm= and process_sets= only apply when it starts. "
                    "Pass them to the first hvdp.init(), or call hvdp.shutdown() first."
                )
            return None
    else:
        os.environ.setdefault("KERAS_BACKEND", name)
        _check_loaded_keras(name)
        state.backend = load_backend(name)
    openmpi.avoid_ofi_deadlock(os.environ)  # a rank Open MPI started: before Horovod's MPI_Init
    with failures.ended_if_stuck(
            "Horovod's initialization (hvdp.init)",
            "It waits for every rank of the job: under MPI in MPI_Init, under Gloo in the rendezvous. A rank that "
            "has not reached hvdp.init() (see its output), or an MPI that hangs in MPI_Init, keeps it waiting.",
            direct.stall_timeout_s(), slack=INIT_SLACK_S):
        handles = state.backend.init(comm, [list(ranks) for ranks in process_sets], dynamic)
    state.generation += 1
    _keras_jobs.when_imported(_keras_in_jobs)
    if not state.exit_handler:  # after Horovod's own exit handler, so that it runs before it
        atexit.register(_at_exit)
        state.exit_handler = True
    return handles


def _keras_in_jobs() -> None:
    """Inside a job, ``keras.models.load_model`` gives back an optimizer that still averages, ``fit`` runs
    the drift guard, and ``fit`` and ``evaluate`` read their metrics over the ranks (:mod:`hvdp._keras_fit`)."""

    def wrap(optimizer: Any) -> Any:
        return _optimizer_wrapper[0](optimizer)

    def distributed_job() -> bool:
        backend = job().backend
        return backend is not None and backend.is_initialized() and backend.size() > 1

    _keras_jobs.rewrap_loaded_optimizers(wrap, distributed_job)
    _keras_jobs.guard_fits()
    for install in _keras_semantics:
        install()


def _at_exit() -> None:
    """At interpreter exit: shut down, waiting for every rank unless this one dies of an exception."""
    failed = getattr(sys, "last_value", None) is not None
    try:
        deactivate(join=not failed)
    except (ReplicaMismatchError, TrainingMismatchError) as exc:  # ranks took different steps, their replicas
        # differ, or this rank left while others still train: say so, and fail
        if not failures.write(exc):  # under hvdp run, its summary names it
            print(f"hvdp: {exc}", file=sys.stderr, flush=True)
        os._exit(1)


def generation() -> int:
    """A number that changes at every start and shutdown: process sets registered earlier are stale."""
    return job().generation


def current(caller: str) -> "Backend":
    """The active backend, or NotInitializedError naming the call that needed it."""
    backend = job().backend
    if backend is None or not backend.is_initialized():
        raise NotInitializedError(
            f"hvdp.{caller}() was called before hvdp.init(). "
            f"Call hvdp.init() (or hvdp.init(framework='torch'|'tensorflow')) first."
        )
    return backend


def chosen() -> Optional[str]:
    """The name of the loaded framework, or None."""
    return None if job().backend is None else job().backend.name


def deactivate(join: bool = True) -> None:
    """Shut Horovod down (with ``join``: once every rank gets here); the backend stays loaded for init()."""
    state = job()
    if state.backend is not None and state.backend.is_initialized():
        backend, uneven = state.backend, []

        def compare_steps() -> None:  # every rank has joined: collectives are safe here
            uneven.extend(consistency.uneven_steps(backend))
            if not uneven:  # the same steps everywhere: the replicas must be identical too
                consistency.final_check(backend)

        try:
            backend.shutdown(join, on_joined=compare_steps)
        finally:
            state.generation += 1
        if uneven:
            raise ReplicaMismatchError(uneven[0])
