"""hvdp run's relay without Horovod: a real rank bootstrap (hvdp/launch/worker.py) sending to a real
listener, the noise filter against TensorFlow's own start-up lines, the display modes, failure records
and the first-failure rule, and the run parser (help and parsing from one source)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from hvdp import failures
from hvdp.failures import Failure
from hvdp.launch import worker
from hvdp.launch.args import run_parser, split_args
from hvdp.launch.relay import Display, Relay, Terminal, is_noise, worker_command
from hvdp.launch.watch import JobWatcher

#: As TensorFlow 2.21 printed them at import, on this machine (tmux capture of hvdp run before the relay).
TF_STARTUP = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1796116386.949396   26735 port.cc:153] oneDNN custom operations are on. You may see slightly "
    "different numerical results due to floating-point round-off errors from different computation orders. To turn "
    "them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.",
    "I0000 00:00:1796116386.988055   26735 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use "
    "available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 FMA, in other operations, rebuild "
    "TensorFlow with the appropriate compiler flags.",
]


def test_startup_noise_is_recognised_and_nothing_else():
    assert all(is_noise(line) for line in TF_STARTUP)
    for line in ["epoch   1/20  loss 1.6479  (0.1 s)", "I am rank 0", "WARNING: disk almost full",
                 "Traceback (most recent call last):", "E0000 something failed"]:
        assert not is_noise(line), line


class Screen(io.StringIO):
    def isatty(self) -> bool:
        return False


def display(mode="all", quiet=True, log_dir=None):
    out, err = Screen(), Screen()
    return Display(Terminal(out, err), mode, log_dir=log_dir, quiet=quiet), out, err


def feed(relay_display, rank, stream, *chunks):
    relay = Relay(relay_display, on_line=lambda *a: None, on_failure=lambda f: None, on_exit=lambda *a: None)
    from hvdp.launch.relay import RankOutput

    output = RankOutput(rank, stream, relay_display)
    for chunk in chunks:
        relay._output(rank, output, chunk)
    output.flush()


def test_rank_0_passes_as_written_with_noise_lines_left_out_even_when_cut_into_pieces():
    shown, out, err = display()
    noise = TF_STARTUP[0].encode() + b"\n"
    feed(shown, 0, "stderr", noise[:7], noise[7:] + b"\rbar 1/2", b"\rbar 2/2\n", b"\x1b[31mred\x1b[0m\n")
    assert err.getvalue() == "\rbar 1/2\rbar 2/2\n\x1b[31mred\x1b[0m\n"
    loud, _, err = display(quiet=False)
    feed(loud, 0, "stderr", noise)
    assert err.getvalue() == noise.decode()


def test_other_ranks_lines_are_prefixed_once_and_rank0_mode_leaves_them_out(tmp_path):
    shown, out, _ = display(log_dir=str(tmp_path))
    feed(shown, 1, "stdout", b"hel", b"lo\n\rstep 1\rstep 2\n", b"last words")
    assert out.getvalue() == "[1] hello\n[1] step 2\n[1] last words\n"
    assert (tmp_path / "rank1.log").read_bytes() == b"hello\n\rstep 1\rstep 2\nlast words"
    quiet, out, _ = display(mode="rank0")
    feed(quiet, 1, "stdout", b"hello\n")
    assert out.getvalue() == ""
    every, out, _ = display(mode="prefixed")
    feed(every, 0, "stdout", b"from rank 0\n")
    assert out.getvalue() == "[0] from rank 0\n"


def record(rank, message, when, kind="RuntimeError"):
    return Failure(rank=rank, host="h", type=kind, message=message, traceback=f"{kind}: {message}\n", time=when)


def test_the_first_failure_is_the_cause_and_consequences_never_are():
    watcher = JobWatcher()
    watcher.failure(record(0, "Horovod has been shut down. This was caused by an exception on one of the ranks",
                           100.0, "HorovodInternalError"))
    watcher.exit(0, 1, 100.1)
    watcher.failure(record(1, "injected failure at step 5", 100.5))  # arrived later, happened first of the causes
    watcher.exit(1, 1, 100.6)
    watcher.failure(record(2, "later failure", 101.0))
    rank, why, failure = watcher.cause()
    assert (rank, why) == (1, "raised RuntimeError: injected failure at step 5") and failure is not None
    assert watcher.summary(1).startswith("hvdp: the job failed: rank 1 raised RuntimeError: injected failure")
    killed = JobWatcher()
    killed.exit(0, -15, 5.0)  # stopped by its launcher
    killed.exit(1, -9, 4.0)
    assert killed.summary(137).startswith("hvdp: the job failed: rank 1 was killed by SIGKILL.")


def test_hvdp_init_hook_records_an_uncaught_exception_only_under_hvdp_run(tmp_path):
    script = textwrap.dedent("""
        from hvdp import failures
        failures.install()
        def fail():
            raise ValueError("no good")
        fail()
    """)
    path = tmp_path / "record.json"
    env = {**os.environ, failures.FILE_VAR: str(path), "HOROVOD_RANK": "3"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr  # hvdp run prints it, once
    found = Failure.from_json(json.loads(path.read_text()))
    assert (found.rank, found.type, found.message) == (3, "ValueError", "no good")
    assert 'line 5, in fail' in found.traceback and abs(found.time - time.time()) < 60
    env.pop(failures.FILE_VAR)
    plain = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False)
    assert plain.returncode == 1 and "ValueError: no good" in plain.stderr  # outside hvdp run: as usual


def test_the_rank_bootstrap_sends_output_record_and_exit_and_ends_as_its_command_did(tmp_path):
    shown, out, err = display(log_dir=str(tmp_path))
    got = {"lines": [], "failures": [], "exits": []}
    relay = Relay(shown, on_line=lambda *a: got["lines"].append(a), on_failure=got["failures"].append,
                  on_exit=lambda *a: got["exits"].append(a))
    relay.start()
    script = ("import sys; from hvdp import failures; failures.install(); print('to stdout', flush=True); "
              "sys.stderr.write('partial'); raise KeyError('k')")
    env = {**os.environ, worker.ADDRESS_VAR: relay.address("127.0.0.1"), "HOROVOD_RANK": "1"}
    proc = subprocess.run(worker_command([sys.executable, "-c", script]), env=env, capture_output=True,
                          timeout=60, check=False)
    relay.wait(10)
    relay.close()
    assert proc.returncode == 1 and proc.stdout == b"" and proc.stderr == b""  # all of it went to the relay
    assert out.getvalue() == "[1] to stdout\n" and err.getvalue() == "[1] partial\n"
    assert (1, "stdout", "to stdout") in got["lines"]
    (failure,) = got["failures"]
    assert (failure.rank, failure.type, failure.message) == (1, "KeyError", "'k'")
    assert [(rank, code) for rank, code, _ in got["exits"]] == [(1, 1)]
    log = (tmp_path / "rank1.log").read_text()
    assert "to stdout" in log and "KeyError: 'k'" in log  # the record's traceback is kept in the log


def test_without_a_listener_the_command_runs_in_the_bootstraps_place():
    env = {**os.environ, worker.ADDRESS_VAR: "127.0.0.1:9:nobody"}
    proc = subprocess.run(worker_command([sys.executable, "-c", "print('plain')"]), env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0 and proc.stdout == "plain\n"


def test_help_and_parsing_come_from_one_parser():
    parser = run_parser()
    text = parser.format_help()
    options = [option for action in parser._actions for option in action.option_strings]
    assert all(option in text for option in options)
    for group in ("processes and hosts", "framework and controller", "output", "elastic training"):
        assert group in text
    own = {option: 0 if action.nargs == 0 else 1 for action in parser._actions for option in action.option_strings}
    assert split_args(["--output", "rank0", "--verbose", "--", "-weird"], own, {"--verbose": 0}) == \
        (["--output", "rank0"], ["--verbose"], ["-weird"])
    with pytest.raises(ValueError, match="--log-dir needs a value"):
        split_args(["--log-dir", "--verbose", "t.py"], own, {})


def test_run_help_prints_the_parsers_help():
    proc = subprocess.run([sys.executable, "-m", "hvdp.cli", "run", "--help"], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: hvdp run")
    assert "--output all|rank0|prefixed" in proc.stdout and "--log-dir DIR" in proc.stdout
