"""Every backend implements the written contract in hvdp/backends/base.py, with the same signatures."""

from __future__ import annotations

import importlib
import inspect

import pytest

from hvdp import _framework
from hvdp.backends.base import Backend


def contract_methods():
    return {name: inspect.signature(member) for name, member in vars(Backend).items()
            if callable(member) and not name.startswith("_")}


@pytest.mark.parametrize("framework", _framework.FRAMEWORKS)
def test_backend_matches_protocol(framework):
    module = importlib.import_module(_framework.SPECS[framework].backend_module)
    backend = module.Backend()
    assert isinstance(backend, Backend)
    assert backend.name == framework
    for name, signature in contract_methods().items():
        assert inspect.signature(getattr(module.Backend, name)) == signature, name
