"""Every ```python block of README.md and docs/*.md runs, under a real launcher, on every rank.

pytest-markdown-docs turns each fence into a test; readme_blocks.py (the plugin every rank
loads) gives a block the names its section assumes, chosen by the ``fixture:NAME`` in the
fence's info string, and assigns it to a job:

* ``torch``: ``hvdp run -np 2 --framework torch`` (Gloo);
* ``tensorflow``: ``hvdp run -np 2 --framework tensorflow`` (Gloo);
* ``four``: ``hvdp run -np 4 --framework torch`` (the process-set block);
* ``mpirun4``: ``mpirun --allow-run-as-root --oversubscribe -np 4`` (the MPI-communicator block),
  as the README's own command lines start them.

Each rank writes the outcome of every block; the tests require every rank of a job to pass
exactly the blocks assigned to it, and every fence of those files to be run by some job or
marked ``notest`` with the reason in an HTML comment just above it. A block is named by its
file and the line of its fence (``docs/api.md:67``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple

import numpy as np
import pytest
from markdown_it import MarkdownIt

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
README = REPO / "README.md"
#: the Markdown files whose blocks the jobs run and whose commands test_readme_commands.py checks
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests" / "parallel"))
import readme_blocks  # noqa: E402  (beside this file; every rank loads it as a plugin)
from harness import communicate  # noqa: E402

PYTHON_LANGS = ("py", "python", "python3")  # what pytest-markdown-docs collects
NOT_RUN_MARK = "<!-- not run by the tests:"
TIMEOUT_S = 420


class Fence(NamedTuple):
    where: str         # the file and the 1-based line of its opening fence (pytest-markdown-docs'
                       # start line), e.g. "docs/api.md:67"
    lang: str
    options: List[str]
    code: str
    comment_above: str  # an HTML comment right above the fence, if any


def fences_of(path: Path) -> List[Fence]:
    """Every fenced block of a Markdown file, parsed as pytest-markdown-docs parses it."""
    tokens = MarkdownIt("commonmark").parse(path.read_text(encoding="utf-8"))
    name = path.relative_to(REPO).as_posix()
    found = []
    for i, token in enumerate(tokens):
        if token.type != "fence" or not token.map:
            continue
        info = token.info.split()
        above = tokens[i - 1].content.strip() if i and tokens[i - 1].type == "html_block" else ""
        found.append(Fence(f"{name}:{token.map[0] + 1}", info[0] if info else "", info[1:], token.content, above))
    return found


def fences() -> List[Fence]:
    """Every fenced block of README.md and docs/*.md."""
    return [fence for path in DOCS for fence in fences_of(path)]


def python_fences() -> List[Fence]:
    return [f for f in fences() if f.lang in PYTHON_LANGS]


def expected_blocks(job: str) -> List[str]:
    """The fences that `job` runs (file:line), by the scene named in each fence."""
    return [f.where for f in python_fences() if "notest" not in f.options
            and job in readme_blocks.jobs_of(o[len("fixture:"):] for o in f.options if o.startswith("fixture:"))]


class JobResult(NamedTuple):
    returncode: int
    output: str
    ranks: List[Dict]
    out: Path


def run_job(job: str, out: Path) -> JobResult:
    """Run the blocks of `job` (README.md, docs/*.md) under its launcher; every rank writes out/rank<N>.json."""
    launcher = readme_blocks.LAUNCH[job]
    np_ = readme_blocks.processes(job)
    env = {**os.environ, "HVDP_DOCS_JOB": job, "HVDP_DOCS_OUT": str(out), "PYTHONUNBUFFERED": "1",
           "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("HVDP_FRAMEWORK", None)
    env.pop("KERAS_BACKEND", None)
    if launcher[0] == "hvdp":
        launcher = [sys.executable, "-m", "hvdp.cli", *launcher[1:]]
    else:  # mpirun does not set the threads per process as hvdp run does: 4 processes share 2 cores
        env.update(OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="1")
    command = [*launcher, sys.executable, "-m", "pytest", "-p", "readme_blocks", "-p", "no:cacheprovider",
               "--markdown-docs", *map(str, DOCS), "-q", "--color=no", "--timeout=300"]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    output = communicate(proc, TIMEOUT_S, f"the {job} job")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(np_)
             if (out / f"rank{r}.json").exists()]
    return JobResult(proc.returncode, output, ranks, out)


@pytest.fixture(scope="module", params=sorted(readme_blocks.LAUNCH))
def job(request, tmp_path_factory):
    return request.param, run_job(request.param, tmp_path_factory.mktemp(f"readme-{request.param}"))


def test_every_python_block_is_run_by_a_job_or_says_why_not():
    blocks = python_fences()
    assert len(blocks) >= 13, f"README.md and docs/*.md have only {len(blocks)} python blocks: is the parser right?"
    assert {f.where.partition(":")[0] for f in blocks} >= {"README.md", "docs/api.md"}, "blocks of a file are missing"
    run = {where for job in readme_blocks.LAUNCH for where in expected_blocks(job)}
    for fence in blocks:
        if "notest" in fence.options:
            assert fence.comment_above.startswith(NOT_RUN_MARK) and len(fence.comment_above) > len(NOT_RUN_MARK) + 10, \
                f"{fence.where}: a notest block needs '{NOT_RUN_MARK} REASON -->' right above it"
            assert fence.where not in run
        else:
            assert fence.where in run, f"{fence.where}: no job runs this block"
        scenes = [o[len("fixture:"):] for o in fence.options if o.startswith("fixture:")]
        unknown = [s for s in scenes if s not in readme_blocks.JOBS]
        assert not unknown, f"{fence.where}: unknown scene(s) {unknown}; known: {sorted(readme_blocks.JOBS)}"


def test_every_rank_passes_exactly_the_blocks_of_its_job(job):
    name, result = job
    np_ = readme_blocks.processes(name)
    expected = sorted(expected_blocks(name))
    runnable = [f.where for f in python_fences() if "notest" not in f.options]
    assert expected, f"no docs block is assigned to the {name} job"
    assert [r["rank"] for r in result.ranks] == list(range(np_)), \
        f"{name} job (exit {result.returncode}): missing rank reports:\n{result.output[-6000:]}"
    docstrings = sorted(d for d, (_, scene, _) in readme_blocks.DOCSTRINGS.items()
                        if name in readme_blocks.jobs_of([scene]))
    for record in result.ranks:
        failed = {key: entry.get("error", "")[-1500:] for key, entry in record["blocks"].items()
                  if entry["outcome"] != "passed"}
        assert not failed, f"{name} job, rank {record['rank']}: failed or skipped:\n" + \
            "\n".join(f"{key}:\n{text}" for key, text in failed.items())
        blocks = sorted(key for key in record["blocks"] if ":" in key)
        assert blocks == expected, f"{name} job, rank {record['rank']} ran the blocks {blocks}"
        assert sorted(key for key in record["blocks"] if ":" not in key) == docstrings
        # every runnable fence and docstring was collected (none escapes the count), and the
        # ones of other jobs were deselected
        assert record["collected"] == len(runnable) + len(readme_blocks.DOCSTRINGS)
        assert sorted(k for k in record["deselected"] if ":" in k) == sorted(set(runnable) - set(expected))
    if name == "four":  # the process-set block: each set's replicas equal, the two models different
        weights = [np.load(result.out / f"weights-rank{r}.npy") for r in range(4)]
        assert np.array_equal(weights[0], weights[1]) and np.array_equal(weights[2], weights[3])
        assert weights[0].shape != weights[2].shape
    assert result.returncode == 0, f"{name} job exited {result.returncode}:\n{result.output[-4000:]}"
