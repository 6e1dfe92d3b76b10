"""The job's state lives in one object (hvdp._state.JobState), not in module globals.

Every module of the library (the tools above it aside: they are their own processes' programs) binds at its
top level only constants, functions and classes: a mutable container there (``_FLAG = [False]``, a dict that
fills while the job runs, a WeakSet of live objects) is job state hidden from the one object, and from a test
that wants a fresh one. The few that are not job state are listed here with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List

import pytest
from test_imports import hvdp_modules, layer_of

pytestmark = pytest.mark.unit

HVDP = Path(__file__).resolve().parents[2] / "hvdp"
#: Calls that make a container that fills at run time.
MAKERS = {"WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "dict", "list", "set", "defaultdict",
          "OrderedDict", "count", "deque"}
#: Module-level containers that are not the job's state, by module and name: why each may stay.
ALLOWED = {
    ("_keras_jobs.py", "epoch_join"): "a hook the facade registers at import (the layers below call up through it)",
    ("_keras_jobs.py", "agree_in_fit"): "a hook the facade registers at import",
    ("_runtime.py", "_optimizer_wrapper"): "a hook the facade registers at import",
    ("_runtime.py", "_keras_semantics"): "a hook the facade registers at import",
    ("_keras_layers.py", "_NUMBERS"): "names of the process's SyncBatchNormalization layers, in the order made",
    ("backends/keras/__init__.py", "_SHARDED"): "names of the process's sharded optimizers, in the order made",
    ("backends/tensorflow/__init__.py", "_OPTIMIZER_NUMBERS"): "names of the process's optimizers, in the order made",
}


def module_containers() -> Dict[str, List[str]]:
    """Each library module's top-level names bound to a mutable container, ``{path: [name (line)]}``."""
    found: Dict[str, List[str]] = {}
    # the commands above the library (test_imports.py's top layer) each run in a process of their own
    tools = {path.resolve() for name, path in hvdp_modules().items() if layer_of(name) == 0}
    for path in sorted(HVDP.rglob("*.py")):
        relative = path.relative_to(HVDP).as_posix()
        if path.resolve() in tools or "/inserted/" in relative:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            call = value.func if isinstance(value, ast.Call) else None
            made = getattr(call, "attr", None) or getattr(call, "id", None)
            if not isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)) \
                    and made not in MAKERS:
                continue
            filled = bool(getattr(value, "keys", None) or getattr(value, "elts", None))
            table = isinstance(value, (ast.DictComp, ast.SetComp)) or isinstance(value, (ast.Dict, ast.Set)) and filled
            for target in targets:
                name = ast.unparse(target)
                if table and name.isupper() or name == "__all__":  # a filled table named as a constant (CHANNELS)
                    continue
                if (relative, name) not in ALLOWED:
                    found.setdefault(relative, []).append(f"{name} (line {node.lineno})")
    return found


def test_no_module_keeps_job_state_outside_the_one_object():
    found = module_containers()
    assert not found, (
        f"module-level containers outside hvdp._state.JobState: {found}. Keep the job's facts in a JobState "
        f"field (hvdp._state.job()), or, for what is not job state, add it to ALLOWED with the reason.")


def test_the_check_sees_the_old_pattern(tmp_path, monkeypatch):
    """The check is not blind: a flag in a list of one, a dict and a WeakSet at a module's top are each found."""
    package = tmp_path / "hvdp"
    (package / "backends").mkdir(parents=True)
    (package / "backends" / "flags.py").write_text(
        "import weakref\nTABLE = {'a': 1}\n_SAID = [False]\n_STATE: dict = {}\nLIVE = weakref.WeakSet()\n")
    monkeypatch.setitem(globals(), "HVDP", package)
    assert module_containers() == {"backends/flags.py": ["_SAID (line 3)", "_STATE (line 4)", "LIVE (line 5)"]}


def test_every_allowed_name_still_exists():
    """An entry of ALLOWED whose name is gone is removed with it."""
    for relative, name in ALLOWED:
        text = (HVDP / relative).read_text()
        assert f"\n{name} " in text or f"\n{name}:" in text, (relative, name)
