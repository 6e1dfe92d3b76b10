"""What a person sees of a job under hvdp run: rank 0's output as it writes it, the other ranks'
lines prefixed [N] when they print, the frameworks' start-up lines hidden, every rank's complete
output in --log-dir; every line whole while both ranks write lines in pieces at the same moments,
to a file and in a real terminal (tmux); and the screen of tmux while the example trains."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import pytest
from harness import HVDP, REPO, TIMEOUT_S, WORKERS

NOISE = ("absl::InitializeLog", "oneDNN custom operations")
#: A line output_ranks.py writes in pieces, as it must reach the output: whole, prefixed or not.
PIECE = re.compile(r"(?:\[(\d)\] )?(PART|TWO) rank=(\d) i=(\d+)(?: a b c)? END")
PIECES = 20


class Output:
    """hvdp run's stdout and stderr together, as bytes became text without newline translation."""

    def __init__(self, stdout: bytes, stderr: bytes) -> None:
        self.output = (stdout + stderr).decode()


def output_job(tmp_path, *options, controller="gloo", to_file=False):
    """hvdp run of output_ranks.py, its stdout and stderr on two pipes (``to_file``: both in one file)."""
    env = {**os.environ, "HVDP_TEST_OUT": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    for var in ("HVDP_FRAMEWORK", "KERAS_BACKEND", "TF_CPP_MIN_LOG_LEVEL"):
        env.pop(var, None)
    argv = [*HVDP, "run", "-np", "2", f"--{controller}", "--framework", "torch", *options,
            str(WORKERS / "output_ranks.py")]
    if to_file:
        log = tmp_path / "output.log"
        with log.open("wb") as out:
            proc = subprocess.run(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=TIMEOUT_S, check=False)
        job = Output(log.read_bytes(), b"")
    else:
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, timeout=TIMEOUT_S, check=False)
        job = Output(proc.stdout, proc.stderr)
    assert proc.returncode == 0, job.output[-4000:]
    return job


def assert_whole(lines, shown=(0, 1), prefixed=()):
    """Every line output_ranks.py wrote in pieces is there once, whole, for each rank in ``shown``, with
    ``[N] `` in front for rank 1 and the ranks in ``prefixed``; no piece of one is anywhere else."""
    text = "\n".join(lines)
    pieces = [line for line in lines if "PART" in line or "TWO" in line or "END" in line]
    matches = [PIECE.fullmatch(line) for line in pieces]
    cut = [line for line, match in zip(pieces, matches)
           if match is None or (match.group(2) == "PART") != line.endswith(" a b c END")
           or match.group(1) not in (None, match.group(3))]
    assert not cut, f"{len(cut)} of {len(pieces)} lines cut, e.g. {cut[:4]}\n{text[-3000:]}"
    found = sorted((int(rank), kind, int(i), prefix is not None)
                   for prefix, kind, rank, i in (match.groups() for match in matches if match is not None))
    expected = sorted((rank, kind, i, rank == 1 or rank in prefixed)
                      for rank in shown for kind in ("PART", "TWO") for i in range(PIECES))
    assert found == expected, text[-3000:]


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_rank_0_as_written_other_ranks_prefixed_every_line_whole_and_no_startup_noise(controller, tmp_path):
    job = output_job(tmp_path, controller=controller, to_file=True)  # hvdp run ... > train.log 2>&1
    lines = job.output.splitlines()
    assert "hello from rank 0 (stdout a terminal: False)" in lines, job.output[-3000:]
    # carriage returns kept, and rank 1's lines, written meanwhile, after the progress line's end
    assert "\rprogress 1/3\rprogress 2/3\rprogress 3/3\n" in job.output, job.output[-3000:]
    assert "[1] hello from rank 1" in lines and "[1] warning from rank 1" in lines, job.output[-3000:]
    assert_whole(lines)
    assert "<stdout>:" not in job.output and "<stderr>:" not in job.output, job.output[-3000:]
    assert not any(noise in job.output for noise in NOISE), job.output[-3000:]


def test_log_dir_keeps_every_ranks_complete_output_and_rank0_shows_only_rank_0(tmp_path):
    logs = tmp_path / "logs"
    job = output_job(tmp_path, "--output", "rank0", "--log-dir", str(logs))
    assert "hello from rank 0" in job.output and "[1]" not in job.output, job.output[-3000:]
    assert_whole(job.output.splitlines(), shown=(0,))
    rank0, rank1 = ((logs / f"rank{rank}.log").read_bytes().decode() for rank in (0, 1))
    assert "hello from rank 0" in rank0 and "\rprogress 1/3\rprogress 2/3\rprogress 3/3\n" in rank0
    assert "hello from rank 1\n" in rank1 and "warning from rank 1\n" in rank1
    assert_whole(rank0.splitlines(), shown=(0,))
    assert_whole([f"[1] {line}" for line in rank1.splitlines()], shown=(1,))
    assert all(noise in rank0 and noise in rank1 for noise in NOISE)  # the logs are complete
    assert "hello from rank 1" not in rank0


def test_prefixed_prefixes_every_rank_and_startup_logs_shows_the_noise(tmp_path):
    job = output_job(tmp_path, "--output", "prefixed", "--startup-logs")
    lines = job.output.splitlines()
    assert "[0] hello from rank 0 (stdout a terminal: False)" in lines, job.output[-3000:]
    assert "[0] progress 3/3" in lines  # a redrawn line: its last state, once
    assert "[1] hello from rank 1" in lines
    assert_whole(lines, prefixed=(0,))
    for rank in (0, 1):
        assert sum(line.startswith(f"[{rank}] WARNING: All log messages before absl::InitializeLog")
                   for line in lines) == 1, job.output[-3000:]


def screen(command: str, timeout_s: float = 240) -> str:
    """Run ``command`` in a 100x40 tmux terminal and return what the screen (and its scrollback) shows."""
    socket, session = f"hvdp-test-{uuid.uuid4().hex[:8]}", "job"
    tmux = ["tmux", "-L", socket]
    subprocess.run([*tmux, "new-session", "-d", "-s", session, "-x", "100", "-y", "40",
                    f"cd {REPO} && {command}; echo EXIT=$?; sleep 600"], check=True)
    try:
        deadline = time.monotonic() + timeout_s
        shown = ""
        while time.monotonic() < deadline:
            time.sleep(1)
            shown = subprocess.run([*tmux, "capture-pane", "-p", "-S", "-500", "-t", session],
                                   capture_output=True, text=True, check=True).stdout
            if "EXIT=" in shown:
                return shown
        raise AssertionError(f"{command} did not finish in {timeout_s} s:\n{shown}")
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)


def hvdp_run_line(args: str, settings: str = "") -> str:
    """The shell line of `hvdp run ARGS` as typed in the terminal, the framework left to --framework."""
    env = " ".join(f"{var}=" for var in ("HVDP_FRAMEWORK", "KERAS_BACKEND") if var in os.environ)
    return f"env {env} {settings} {sys.executable} -m hvdp.cli run {args}"


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_a_terminal_shows_every_line_whole_and_rank_0s_progress_line_redrawn_in_place(controller):
    shown = screen(hvdp_run_line(f"-np 2 --{controller} --framework torch {WORKERS / 'output_ranks.py'}",
                                 "PYTHONUNBUFFERED=1"))
    lines = shown.splitlines()
    assert "EXIT=0" in lines, shown
    assert "hello from rank 0 (stdout a terminal: True)" in lines, shown
    # rank 1's lines went between two redraws: one progress line, in its last state
    assert [line for line in lines if "progress" in line] == ["progress 3/3"], shown
    assert "[1] hello from rank 1" in lines and "[1] warning from rank 1" in lines, shown
    assert_whole(lines)
    assert not any(noise in shown for noise in NOISE), shown


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_a_terminal_shows_one_progress_bar_redrawn_in_place(framework):
    shown = screen(hvdp_run_line(f"-np 2 --framework {framework} examples/train_digits.py --epochs 3"))
    lines = [line for line in shown.splitlines() if line.strip()]
    assert "EXIT=0" in lines, shown
    bars = [line for line in lines if line.startswith("training:")]
    assert len(bars) == 1 and "100%" in bars[0], shown  # redrawn in place: one bar, not dozens
    assert [line.split()[1] for line in lines if line.startswith("epoch")] == ["1/3", "2/3", "3/3"], shown
    assert any(line.startswith("test accuracy: ") for line in lines), shown
    assert not any("<stderr>:" in line or "<stdout>:" in line or line.startswith("[") for line in lines), shown
    assert not any(noise in shown for noise in NOISE), shown
    print(f"\n{framework}, the screen:\n{shown.strip()}")
