"""hvdp build, doctor, bench and report as commands: each --help says what it does, how long it takes and
shows examples; each expected failure is one clear line and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvdp import bench, doctor, report
from hvdp.errors import BuildError
from hvdp.horovod_build import command as build_command
from hvdp.horovod_build import steps

REPO = Path(__file__).resolve().parents[2]
HVDP = [sys.executable, "-m", "hvdp.cli"]


def _help(name: str, add_arguments) -> str:
    parser = argparse.ArgumentParser(prog=f"hvdp {name}")
    add_arguments(parser)
    return parser.format_help()


@pytest.mark.parametrize("name, add_arguments, says, takes", [
    ("build", build_command.add_arguments, "Build Horovod 0.28.1 from its PyPI source", "about 4-5 min on 2 cores"),
    ("doctor", doctor.add_arguments, "Show the versions", "a few seconds"),
    ("bench", bench.add_arguments, "Measure hvdp side by side", "about 40 min (--quick)"),
    ("report", report.add_arguments, "Read the per-rank records", "Takes a second"),
])
def test_each_help_says_what_it_does_how_long_and_shows_examples(name, add_arguments, says, takes):
    text = _help(name, add_arguments)
    assert says in text and takes in text
    examples = text[text.index("examples:"):].splitlines()[1:]
    assert examples and all(line.strip().startswith(f"hvdp {name}") for line in examples)
    assert max(len(line) for line in text.splitlines()) <= 100


def test_bench_help_through_the_cli():
    proc = subprocess.run([*HVDP, "bench", "--help"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "Measure hvdp side by side" in proc.stdout and "hvdp bench --quick" in proc.stdout


@pytest.mark.parametrize("argv, message", [
    (["bench", "--only", "foo"], "hvdp: error: --only 'foo': unknown section 'foo'."),
    (["bench", "--rounds", "0"], "hvdp: error: --rounds 0 must be at least 1; e.g. --rounds 3."),
    (["bench", "--json", "/nonexistent/dir/b.json"], "hvdp: error: --json '/nonexistent/dir/b.json' cannot be written"),
    (["build", "--frameworks", "pytorch"],
     "hvdp: error: Unknown framework 'pytorch' for --frameworks. Expected: torch, tensorflow."),
    (["build", "-j", "many"], "hvdp build: error: argument -j/--jobs: invalid int value: 'many'"),
])
def test_bad_options_are_one_line_and_exit_2(argv, message):
    proc = subprocess.run([*HVDP, *argv], capture_output=True, text=True, check=False, cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(("hvdp: error:", "hvdp build: error:"))


def test_an_unwritable_build_cache_is_named_before_anything_runs(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {**os.environ, "HVDP_CACHE_DIR": str(blocker / "cache")}
    proc = subprocess.run([*HVDP, "build"], capture_output=True, text=True, check=False, cwd=REPO, env=env,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.strip() == (f"hvdp: error: The build cache {blocker / 'cache'} cannot be created (Not a "
                                   "directory). Set HVDP_CACHE_DIR to a writable folder.")


def test_build_options_from_the_command_line():
    args = argparse.ArgumentParser()
    build_command.add_arguments(args)
    options = build_command.options_from(args.parse_args(["--frameworks", "tensorflow", "--no-mpi", "-j", "3"]))
    assert (options.frameworks, options.mpi, options.jobs, options.gpu) == (["tensorflow"], False, 3, False)
    with pytest.raises(BuildError, match="--jobs 0 must be at least 1"):
        build_command.options_from(args.parse_args(["-j", "0"]))


def test_a_failed_compile_is_a_build_error_with_the_log_tail(tmp_path):
    log = tmp_path / "build.log"
    argv = [sys.executable, "-c", "import sys; print('error: nccl.h: No such file'); sys.exit(3)"]
    with pytest.raises(BuildError) as err:
        steps.run_logged(argv, dict(os.environ), log, progress=lambda line: None)
    first, *rest = str(err.value).splitlines()
    assert first == f"Building Horovod failed (exit 3). Last lines of {log}:"
    assert rest == ["error: nccl.h: No such file"]
