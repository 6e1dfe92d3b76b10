"""hvdp's modules import on their own, without cycles, and the tools import no framework.

* Each module imports in a fresh interpreter by itself: none relies on another having
  been imported first.
* The graph of hvdp's imports (every import statement, at the top or inside a function, and
  every module named in a string: what ``importlib.import_module`` loads, a table of modules)
  has no cycle, so any module can be read knowing only those below it.
* The modules stand in the layers declared in :data:`LAYERS`, and none imports a module of a
  higher layer: the tools over the library, the facade over the runtime over the backends.
* ``hvdp build``, ``hvdp doctor`` and the CLI learn what they need of torch and TensorFlow
  from :mod:`hvdp.frameworks`, without importing either.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Set

import pytest

REPO = Path(__file__).resolve().parents[2]
#: files `hvdp build` puts into Horovod's source: importable only from inside Horovod
NOT_MODULES = REPO / "hvdp" / "horovod_build" / "inserted"


def hvdp_modules() -> Dict[str, Path]:
    """Every module of hvdp by dotted name."""
    found = {}
    for path in sorted((REPO / "hvdp").rglob("*.py")):
        if not path.is_relative_to(NOT_MODULES):
            found[".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")] = path
    return found


def imports_of(name: str, path: Path, modules: Dict[str, Path]) -> Set[str]:
    """The hvdp modules that ``name`` imports anywhere in its file (``from hvdp import x``: x if a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    for node in ast.walk(ast.parse(path.read_text())):  # a module named in a string is imported by name
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value:
            found.add(node.value)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
            found.add(str(node.args[0].value))
    return {module for module in found if module in modules and module != name}


#: hvdp's layers, top first: a module imports only modules of its own layer and of layers below it.
#: A name ending in ``.*`` takes the package's modules; the longest match places a module.
LAYERS = (
    ("tools", "the commands, above the library they run: hvdp run, build, doctor, bench, report, and hvdp.ray (Ray "
     "Train's backend: a launcher too)",
     ("hvdp.cli", "hvdp.launch", "hvdp.launch.*", "hvdp.horovod_build", "hvdp.horovod_build.*",
      "hvdp.doctor", "hvdp.bench", "hvdp.bench.*", "hvdp.report", "hvdp.ray", "hvdp.ray.*")),
    ("facade", "the public API and the modules that implement its calls (hvdp.keras: the Keras callbacks)",
     ("hvdp", "hvdp.keras", "hvdp._keras_callbacks", "hvdp._keras_fit", "hvdp._keras_layers", "hvdp.validate",
      "hvdp.collectives",
      "hvdp.process_sets", "hvdp.communicators", "hvdp.joining", "hvdp.elastic", "hvdp.checkpoint", "hvdp.data",
      "hvdp.grouped")),
    ("runtime", "the job's state: the framework chosen once, its backend loaded, its variables checked at start, "
     "checks at shutdown",
     ("hvdp._runtime", "hvdp.consistency", "hvdp.failures", "hvdp.environment")),
    ("frameworks", "what hvdp knows of each framework without importing it: names, pins, probes, its backend",
     ("hvdp.frameworks", "hvdp.frameworks.*")),
    ("backends", "one adapter per framework over Horovod, a package each with the same module names",
     ("hvdp.backends.torch", "hvdp.backends.torch.*", "hvdp.backends.tensorflow", "hvdp.backends.tensorflow.*")),
    ("backends' common", "what the framework packages share: the contract, the direct path's common part, the "
     "Keras adapter",
     ("hvdp.backends", "hvdp.backends.*")),
    ("foundation", "what every layer may use, importing nothing of hvdp above it",
     ("hvdp.errors", "hvdp.profiler", "hvdp._keras_jobs", "hvdp._state")),
)


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` (0 at the top) of ``module``'s layer, by the longest name that matches."""
    best, found = -1, -1
    for index, (_, _, names) in enumerate(LAYERS):
        for pattern in names:
            matches = module.startswith(pattern[:-1]) if pattern.endswith(".*") else module == pattern
            if matches and len(pattern) > best:
                best, found = len(pattern), index
    if found < 0:
        raise KeyError(f"{module} is in no layer of LAYERS: add it to the layer it belongs to")
    return found


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = [stack.pop()]
            while group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph() -> Dict[str, Set[str]]:
    modules = hvdp_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_the_module_graph_has_no_cycle():
    graph = import_graph()
    # the parser sees imports
    assert graph["hvdp.horovod_build.build"] >= {"hvdp.horovod_build.patches", "hvdp.frameworks"}
    assert graph["hvdp.frameworks.torch"] >= {"hvdp.backends.torch"}  # and modules named in strings
    assert graph["hvdp.cli"] >= {"hvdp.launch", "hvdp.bench", "hvdp.doctor"}  # imported by importlib
    assert cycles(graph) == []


def test_every_module_stands_in_one_declared_layer():
    graph = import_graph()
    assert sorted(m for m in graph if not _placed(m)) == []
    assert [layer_of(m) for m in ("hvdp.cli", "hvdp.keras", "hvdp", "hvdp._runtime", "hvdp.backends.torch",
                                  "hvdp.backends.torch.direct.calls", "hvdp.backends.keras.sharded",
                                  "hvdp.errors")] == [0, 1, 1, 2, 4, 4, 5, 6]


def _placed(module: str) -> bool:
    try:
        layer_of(module)
    except KeyError:
        return False
    return True


def test_no_module_imports_one_of_a_higher_layer():
    graph = import_graph()
    upward = [f"{name} ({LAYERS[layer_of(name)][0]}) imports {other} ({LAYERS[layer_of(other)][0]})"
              for name, targets in sorted(graph.items()) for other in sorted(targets)
              if layer_of(other) < layer_of(name)]
    assert upward == []


def test_the_layer_check_finds_an_upward_import(tmp_path):
    lower = tmp_path / "errors.py"
    lower.write_text("import importlib\nCOMMAND = importlib.import_module('hvdp.cli')\n")
    found = imports_of("hvdp.errors", lower, {"hvdp.errors": lower, "hvdp.cli": lower})
    assert found == {"hvdp.cli"} and layer_of("hvdp.cli") < layer_of("hvdp.errors")


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.slow
def test_every_module_imports_alone_in_a_fresh_interpreter():
    def alone(name: str) -> str:
        proc = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=REPO, capture_output=True,
                              text=True, timeout=300, check=False)
        return "" if proc.returncode == 0 else f"{name}: {proc.stderr.strip()[-800:]}"

    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [line for line in pool.map(alone, hvdp_modules()) if line]
    assert failures == []


def test_the_tools_import_no_framework():
    code = ("import sys, hvdp, hvdp.horovod_build.build, hvdp.doctor, hvdp.cli, hvdp.bench, hvdp.frameworks\n"
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'horovod') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


#: A module longer than this holds more than one idea: split it where the ideas part.
MOST_LINES = 400


def test_no_module_is_longer_than_one_reading():
    lengths = {name: len(path.read_text().splitlines()) for name, path in hvdp_modules().items()}
    assert {name: n for name, n in lengths.items() if n > MOST_LINES} == {}
    assert lengths["hvdp"] > 100  # the count reads the files
