"""Framework selection and the errors of the facade, in one process (no Horovod job)."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace

import pytest

import hvdp
from hvdp import _runtime


def test_import_has_no_side_effects():
    code = ("import os, sys; before = dict(os.environ); import hvdp; "
            "callbacks = hvdp.keras._CALLBACKS; "  # hvdp.keras comes with hvdp, as in the docs' examples
            "heavy = [m for m in ('torch', 'tensorflow', 'keras', 'horovod') if m in sys.modules]; "
            "print(heavy, before == dict(os.environ), len(callbacks))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] True 5"


def test_explicit_choice_wins_and_env_is_used_when_alone():
    assert _runtime.resolve("torch", {}) == "torch"
    assert _runtime.resolve(None, {"HVDP_FRAMEWORK": "tensorflow"}) == "tensorflow"
    assert _runtime.resolve("torch", {"HVDP_FRAMEWORK": "torch"}) == "torch"


def test_script_contradicting_the_launcher_is_refused():
    with pytest.raises(hvdp.FrameworkError) as err:
        _runtime.resolve("tensorflow", {"HVDP_FRAMEWORK": "torch"})
    message = str(err.value)
    assert "'tensorflow'" in message and "HVDP_FRAMEWORK='torch'" in message


@pytest.mark.parametrize("name, hint", [("pytorch", "Did you mean 'torch'"), ("tf", "Did you mean 'tensorflow'"),
                                        ("jax", "Expected one of: torch, tensorflow")])
def test_unknown_framework_names_the_value_and_the_choices(name, hint):
    with pytest.raises(hvdp.FrameworkError) as err:
        _runtime.resolve(name, {})
    assert repr(name) in str(err.value) and hint in str(err.value)
    with pytest.raises(hvdp.FrameworkError):
        _runtime.resolve(None, {"HVDP_FRAMEWORK": name})


def test_both_installed_and_none_chosen_asks_the_user_to_choose():
    assert _runtime.is_installed("torch") and _runtime.is_installed("tensorflow")
    with pytest.raises(hvdp.FrameworkError, match="Both torch and tensorflow are installed"):
        _runtime.resolve(None, {})


def test_framework_not_installed(monkeypatch):
    monkeypatch.setattr(_runtime, "is_installed", lambda name: name == "torch")
    assert _runtime.resolve(None, {}) == "torch"
    with pytest.raises(hvdp.FrameworkError, match="'tensorflow' was chosen but is not installed.*tensorflow-cpu"):
        _runtime.resolve("tensorflow", {})


def test_contradicting_keras_backend_is_refused():
    with pytest.raises(hvdp.FrameworkError, match="KERAS_BACKEND='torch' contradicts framework 'tensorflow'"):
        _runtime.resolve("tensorflow", {"KERAS_BACKEND": "torch"})


def with_backend_module(monkeypatch, module: str) -> None:
    """torch's backend loaded from ``module`` for the test (the registry's entry restored after)."""
    monkeypatch.setitem(_runtime.SPECS, "torch", replace(_runtime.SPECS["torch"], backend_module=module))


def load_raising(monkeypatch, tmp_path, statement: str) -> BaseException:
    """What ``load_backend("torch")`` raises when the backend module's import runs ``statement``."""
    module = f"hvdp_failing_backend_{tmp_path.name}"  # a name of its own: no module cached from another test
    (tmp_path / f"{module}.py").write_text(statement + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with_backend_module(monkeypatch, module)
    with pytest.raises(Exception) as raised:
        _runtime.load_backend("torch")
    return raised.value


def test_horovod_without_the_framework_built_in_gives_the_fix(monkeypatch, tmp_path):
    """Horovod's own error for an extension it did not build becomes the command that fixes it."""
    error = load_raising(monkeypatch, tmp_path, "raise ImportError('Extension horovod.torch has not been built: "
                         "mpi_lib_v2.so not found. If this is not expected, reinstall Horovod with "
                         "HOROVOD_WITH_PYTORCH=1')")
    assert isinstance(error, hvdp.FrameworkError), error
    assert re.search("Horovod is installed but its torch support cannot be loaded.*hvdp build", str(error)), error


def test_missing_horovod_gives_the_fix(monkeypatch, tmp_path):
    # What `import horovod.torch` raises where Horovod is not installed (whatever was imported before).
    error = load_raising(monkeypatch, tmp_path,
                         "raise ModuleNotFoundError(\"No module named 'horovod'\", name='horovod')")
    assert isinstance(error, hvdp.FrameworkError), error
    assert re.search("Horovod is not installed.*hvdp build", str(error)), error


def test_an_import_error_in_hvdps_own_modules_is_not_blamed_on_the_framework(monkeypatch, tmp_path):
    # What a backend module raises when one of hvdp's modules lacks a name it imports (a stale install, a bug).
    error = load_raising(monkeypatch, tmp_path, "raise ImportError(\"cannot import name 'gone' from "
                         "'hvdp.backends.torch.gradients'\", name='hvdp.backends.torch.gradients')")
    assert type(error) is ImportError, error  # not a FrameworkError saying "Reinstall torch": hvdp's own, as it is
    assert "cannot import name 'gone'" in str(error), error


@pytest.mark.parametrize("call", [hvdp.rank, hvdp.size, hvdp.local_rank, hvdp.framework,
                                  lambda: hvdp.allreduce(1.0), lambda: hvdp.shard(10),
                                  lambda: hvdp.DistributedOptimizer(object())])
def test_calls_before_init_say_to_call_init(call):
    with pytest.raises(hvdp.NotInitializedError, match=r"called before hvdp.init\(\)"):
        call()
    assert hvdp.is_initialized() is False


def test_public_names_are_exported():
    for name in ("init", "framework", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
                 "is_initialized", "shutdown", "DistributedOptimizer", "broadcast_state", "allreduce", "shard"):
        assert name in hvdp.__all__ and callable(getattr(hvdp, name))
