"""hvdp's docstring examples (doctest ``>>>`` lines).

* One process: ``pytest --doctest-modules hvdp`` runs every example not marked ``+SKIP``.
* The examples marked ``+SKIP`` need a started job (a model, an optimizer, other ranks):
  those of the docstrings in ``readme_blocks.DOCSTRINGS`` run, skips lifted, in the docs
  jobs of test_readme.py (2 processes, torch or TensorFlow); the others are listed in
  ``NOT_RUN`` with the reason. A new skipped example must join one or the other.
"""

from __future__ import annotations

import doctest
import functools
import importlib
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, Tuple

import readme_blocks
from test_readme import HERE, REPO

#: files `hvdp build` puts into Horovod's source: importable only from inside Horovod
NOT_MODULES = "hvdp/horovod_build/inserted"
_FOUR = ("needs process sets registered at the start of a 4-process job; the process-set block of "
         "docs/process-sets.md (the four job)")
NOT_RUN: Dict[str, str] = {
    "hvdp.init": "hvdp.init(comm=sub) needs an MPI job split in two; the communicator block of "
                 "docs/process-sets.md runs it under mpirun -np 4",
    "hvdp.add_process_set": _FOUR + " runs the static form",
    "hvdp.process_sets.remove_process_set": "needs process sets added to a running 4-process job; the dynamic "
                                            "process-set jobs of tests/parallel/test_mpi_groups.py run these calls",
    "hvdp.my_process_set": _FOUR + " runs these lines",
    "hvdp.collectives.broadcast_state": "its second line needs a process set " + _FOUR[len("needs process sets"):],
    "hvdp.process_sets.ProcessSet": _FOUR + " runs these lines",
    "hvdp.process_sets.ProcessSet.included": _FOUR,
    "hvdp.horovod_build.build.build": "builds Horovod (about 4 min on 2 cores); scripts/setup.sh runs hvdp build",
    "hvdp.backends.keras.wrap_optimizer": "an internal helper given a reduce function; hvdp.DistributedOptimizer wraps "
                                 "Keras optimizers with it in the docs' Keras blocks",
    "hvdp.profiler.enable": "turns recording on for the rest of the process, into /tmp/profile; "
                            "tests/unit/test_profiler_recording.py covers enable()",
}


@functools.lru_cache(maxsize=None)
def docstrings() -> Dict[str, Tuple[int, int]]:
    """doctest name -> (examples, examples marked +SKIP), for every hvdp docstring with examples."""
    names = [".".join(path.relative_to(REPO).with_suffix("").parts).replace(".__init__", "")
             for path in sorted((REPO / "hvdp").rglob("*.py")) if not path.is_relative_to(REPO / NOT_MODULES)]
    found: Dict[str, Tuple[int, int]] = {}
    for name in names:
        module = importlib.import_module(name)
        for test in doctest.DocTestFinder().find(module, name):
            if test.examples and test.filename and Path(test.filename).is_relative_to(REPO / "hvdp"):
                found[test.name] = (len(test.examples), sum(bool(e.options.get(doctest.SKIP)) for e in test.examples))
    return found


def test_the_patch_files_have_no_examples():
    for path in (REPO / NOT_MODULES).glob("*.py"):
        assert ">>>" not in path.read_text(), f"{path}: its examples would not run (not importable from hvdp)"


def test_every_skipped_example_runs_in_a_job_or_says_why_not():
    with_skips = {name for name, (_, skipped) in docstrings().items() if skipped}
    in_jobs, not_run = set(readme_blocks.DOCSTRINGS), set(NOT_RUN)
    assert not in_jobs & not_run, f"both run in a job and listed as not run: {in_jobs & not_run}"
    assert with_skips == in_jobs | not_run, (
        f"skipped examples neither run in a docs job nor said why: {sorted(with_skips - in_jobs - not_run)}; "
        f"listed but without skipped examples: {sorted((in_jobs | not_run) - with_skips)}")


def test_every_example_not_skipped_runs_in_one_process(tmp_path):
    """pytest's doctest run over hvdp: each docstring with an example not skipped passes; the rest
    are reported skipped (their examples run in the jobs, see above), none fails."""
    xml = tmp_path / "doctest.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    for var in ("HVDP_FRAMEWORK", "KERAS_BACKEND"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--doctest-modules", "hvdp", f"--ignore={NOT_MODULES}",
         "--import-mode=importlib", "-p", "doctest_names", "-p", "no:cacheprovider", "-q", "--color=no",
         f"--junitxml={xml}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    cases = {case.get("name"): [child.tag for child in case] for case in ET.parse(xml).iter("testcase")}
    failed = sorted(name for name, tags in cases.items() if "failure" in tags or "error" in tags)
    assert not failed and proc.returncode == 0, f"docstring examples failed: {failed}\n{proc.stdout[-6000:]}"
    expected = docstrings()
    assert sorted(n for n, tags in cases.items() if not tags) == sorted(n for n, (e, s) in expected.items() if s < e)
    assert sorted(n for n, tags in cases.items() if "skipped" in tags) == \
        sorted(n for n, (e, s) in expected.items() if s == e)
