"""hvdp's modules import on their own, without cycles, and the tools import no framework.

* Each module imports in a fresh interpreter by itself: none relies on another having
  been imported first.
* The graph of hvdp's imports (every import statement, at the top or inside a function)
  has no cycle, so any module can be read knowing only those below it.
* ``hvdp build``, ``hvdp doctor`` and the CLI learn what they need of torch and TensorFlow
  from :mod:`hvdp.backends.registry`, without importing either.
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
NOT_MODULES = REPO / "hvdp" / "horovod_patches"


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
    return {module for module in found if module in modules and module != name}


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


def test_the_module_graph_has_no_cycle():
    modules = hvdp_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert graph["hvdp.build"] >= {"hvdp.horovod_build.patches", "hvdp.backends.registry"}  # the parser sees imports
    assert cycles(graph) == []


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
    code = ("import sys, hvdp, hvdp.build, hvdp.doctor, hvdp.cli, hvdp.bench, hvdp.backends.registry\n"
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'horovod') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"
