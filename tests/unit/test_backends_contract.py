"""Every backend implements the written contract in hvdp/backends/base.py, with the same signatures."""

from __future__ import annotations

import importlib
import inspect

import pytest

from hvdp import _runtime
from hvdp.backends.base import Backend, Extras


def contract_methods():
    return {name: inspect.signature(member) for name, member in vars(Backend).items()
            if callable(member) and not name.startswith("_")}


@pytest.mark.parametrize("framework", _runtime.FRAMEWORKS)
def test_backend_matches_protocol(framework):
    module = importlib.import_module(_runtime.SPECS[framework].backend_module)
    backend = module.Backend()
    assert isinstance(backend, Backend)
    assert backend.name == framework
    for name, signature in contract_methods().items():
        assert inspect.signature(getattr(module.Backend, name)) == signature, name


def parameters(function) -> list:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


def extras_declared() -> dict:
    return {name: member for name, member in vars(Extras).items() if callable(member) and not name.startswith("_")}


@pytest.mark.parametrize("framework", _runtime.FRAMEWORKS)
def test_backend_has_exactly_the_extras_it_declares(framework):
    module = importlib.import_module(_runtime.SPECS[framework].backend_module)
    offered = module.Backend.extras
    assert offered and set(offered) <= set(extras_declared()), offered
    for name, declared in extras_declared().items():
        assert hasattr(module.Backend, name) == (name in offered), f"{framework}: {name} has it, or lists it, not both"
        if name in offered:
            assert parameters(getattr(module.Backend, name)) == parameters(declared), name


def test_every_extra_is_offered_by_some_framework():
    offered = set()
    for framework in _runtime.FRAMEWORKS:
        offered.update(importlib.import_module(_runtime.SPECS[framework].backend_module).Backend.extras)
    assert offered == set(extras_declared()) == {"sync_batch_norm", "convert_sync_batchnorm",
                                                 "distributed_gradient_tape"}


def test_a_direct_calls_failure_is_one_error_a_stall_when_it_timed_out(capsys, monkeypatch):
    """Every direct module raises what backends.direct.failure returns: on Gloo's timeout a StallError that is
    also Horovod's HorovodInternalError (an elastic job resets), after the stall report's lines naming the
    call and every other rank; on any other failure a plain HorovodInternalError, and no report."""
    from horovod.common.exceptions import HorovodInternalError

    import hvdp
    from hvdp.backends import direct

    monkeypatch.delenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", raising=False)
    stalled = direct.failure(b"Timed out waiting 10000ms for recv operation", "the bucket failed", "bucket1of2", 0, 3)
    assert isinstance(stalled, hvdp.StallError) and isinstance(stalled, HorovodInternalError)
    assert str(stalled) == "the bucket failed"
    report = capsys.readouterr().err
    assert "stalled for 300 s in a direct allreduce (bucket1of2)" in report
    assert "1!: [allreduce.bucket1of2]" in report and "2!: [allreduce.bucket1of2]" in report
    assert "0!:" not in report
    other = direct.failure(RuntimeError("Connection reset by peer"), "the call failed", "x", 1, 2)
    assert type(other) is HorovodInternalError and not isinstance(other, hvdp.StallError)
    assert capsys.readouterr().err == ""


def test_both_gradient_paths_implement_the_one_contract_with_its_signatures():
    """Horovod's path and the direct path are peers behind GradientPath: the same methods, the same signatures,
    and the optimizer wrapper takes either."""
    from hvdp.backends.paths import GradientPath
    from hvdp.backends.torch.direct.gradients import DirectGradients
    from hvdp.backends.torch.gradients import HorovodPath, reduce_at_backward_end

    wanted = {name: inspect.signature(member) for name, member in vars(GradientPath).items()
              if callable(member) and not name.startswith("_")}
    assert set(wanted) == {"reduces", "watch", "synchronize", "hold", "release"}
    for peer, name in ((HorovodPath, "horovod"), (DirectGradients, "direct")):
        assert peer.name == name
        for method, signature in wanted.items():
            assert inspect.signature(getattr(peer, method)) == signature, (peer.__name__, method)
    assert inspect.signature(reduce_at_backward_end).parameters["path"].annotation == "GradientPath"
