"""Where ``hvdp bench`` builds and trains its models in each framework: one module per framework.

The modules import their framework; this one imports nothing until asked, so the bench's
planning and reporting stay framework-free.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Dict

from hvdp.errors import BenchError

#: Each framework's bench module, by hvdp's framework name (the keys of hvdp.frameworks.SPECS,
#: checked by tests/unit/test_bench.py): ``build_model(name)`` and ``train(...)`` timing it.
MODULES: Dict[str, str] = {"torch": "hvdp.bench.torch_bench", "tensorflow": "hvdp.bench.tensorflow_bench"}


def load(framework: str) -> ModuleType:
    """The bench module of ``framework`` (imports the framework)."""
    if framework not in MODULES:
        raise BenchError(f"hvdp bench: no framework {framework!r}; expected one of: {', '.join(MODULES)}.")
    return importlib.import_module(MODULES[framework])


def build(framework: str, name: str) -> Any:
    """The model named ``name`` for ``framework`` (a torch module, or a Keras 3 model for TensorFlow)."""
    return load(framework).build_model(name)
