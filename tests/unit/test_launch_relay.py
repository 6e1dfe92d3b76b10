"""hvdp run's relay without Horovod: a real rank bootstrap (hvdp/launch/worker.py) sending to a real
listener, the noise filter against TensorFlow's own start-up lines, the display modes, every line
whole when ranks write at once (to a file and to a terminal, a progress bar included), failure
records and the first-failure rule, and the run parser (help and parsing from one source)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from hvdp import failures
from hvdp.failures import Failure
from hvdp.launch import worker
from hvdp.launch.args import run_parser, split_args
from hvdp.launch.relay import Display, RankOutput, Relay, is_noise
from hvdp.launch.terminal import HOLD_S, Terminal
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


class TTY(Screen):
    def isatty(self) -> bool:
        return True


def render(text: str) -> list:
    """The rows a terminal shows for ``text`` (carriage return, newline and erase-line as a terminal does)."""
    rows, row, column, at = [], [], 0, 0
    while at < len(text):
        if text.startswith("\x1b[K", at):
            del row[column:]
            at += 3
            continue
        char = text[at]
        if char == "\r":
            column = 0
        elif char == "\n":
            rows.append("".join(row))
            row, column = [], 0
        else:
            row[column:column + 1] = [char]
            column += 1
        at += 1
    return rows + (["".join(row)] if row else [])


class Ranks:
    """Rank 0 and rank 1 of one job on one display, their frames fed as the relay's connections feed them."""

    def __init__(self, out, err=None, mode="all", hold_s=HOLD_S):
        self.out = out
        self.display = Display(Terminal(out, out if err is None else err, hold_s=hold_s), mode)
        self.relay = Relay(self.display, on_line=lambda *a: None, on_failure=lambda f: None,
                           on_exit=lambda *a: None)
        self.outputs = {(rank, stream): RankOutput(rank, stream, self.display)
                        for rank in (0, 1) for stream in ("stdout", "stderr")}

    def send(self, rank, data, stream="stdout"):
        self.relay._output(rank, self.outputs[rank, stream], data)

    def end(self):
        for output in self.outputs.values():
            output.flush()
        self.display.close()
        return self.out.getvalue()


def test_another_ranks_line_waits_for_rank_0s_line_to_end_in_each_ranks_order():
    # print("PART", "rank=0", "done") unbuffered: one write per argument; rank 1's lines arrive in between.
    ranks = Ranks(Screen())
    ranks.send(0, b"PART")
    ranks.send(1, b"PART rank=1 done\n")
    ranks.send(0, b" rank=0")
    ranks.send(1, b"second of rank 1\n", stream="stderr")  # stdout and stderr are one file: it waits too
    ranks.relay.display.terminal.line("stdout", b"from horovodrun\n")
    ranks.send(0, b" done\nnext of rank 0\n")
    assert ranks.end() == ("PART rank=0 done\n[1] PART rank=1 done\n[1] second of rank 1\nfrom horovodrun\n"
                           "next of rank 0\n")


def test_on_a_terminal_a_line_goes_between_two_redraws_of_a_bar_which_redraws_in_place():
    ranks = Ranks(TTY())
    ranks.send(0, b"\rtraining:  10%|#     | 1/10")
    ranks.send(1, b"warning from rank 1\n")  # at once, tqdm.write's way: bar cleared, line, bar redrawn
    assert ranks.out.getvalue().endswith("\r\x1b[K[1] warning from rank 1\ntraining:  10%|#     | 1/10")
    ranks.send(0, b"\rtraining:  20%|##    | 2/10")
    ranks.send(1, b"again\n")
    ranks.send(0, b"\rtraining: 100%|######| 10/10\ntest accuracy: 0.94\n")
    assert render(ranks.end()) == ["[1] warning from rank 1", "[1] again", "training: 100%|######| 10/10",
                                   "test accuracy: 0.94"]


def test_on_a_terminal_a_plain_unfinished_line_is_not_cleared_but_waited_for():
    ranks = Ranks(TTY())
    ranks.send(0, b"acc")
    ranks.send(1, b"acc 1 0.93\n")
    ranks.send(0, b" 0 0.94\n")
    assert ranks.end() == "acc 0 0.94\n[1] acc 1 0.93\n"


def test_a_line_of_rank_0_that_does_not_end_holds_the_others_at_most_hold_s():
    assert 0.1 <= HOLD_S <= 1.0
    for screen, shown in ((Screen(), ["Password: ", "[1] from rank 1", "typed"]),
                          (TTY(), ["[1] from rank 1", "Password: typed"])):  # a terminal: the prompt redrawn
        ranks = Ranks(screen, hold_s=0.05)
        ranks.send(0, b"Password: ")
        started = time.monotonic()
        ranks.send(1, b"from rank 1\n")
        while "from rank 1" not in screen.getvalue() and time.monotonic() - started < 5:
            time.sleep(0.01)
        assert 0.04 <= time.monotonic() - started < 2, screen.getvalue()
        ranks.send(0, b"typed\n")
        assert render(ranks.end()) == shown


def test_on_a_terminal_an_unfinished_line_wider_than_it_is_ended_where_it_is_not_cleared():
    wide = b"\r" + b"x" * 120  # wrapped over two rows: erasing one row would leave half of it
    ranks = Ranks(TTY(), hold_s=0.05)
    ranks.send(0, wide)
    ranks.send(1, b"from rank 1\n")
    ranks.send(0, b"\rdone\n")
    assert ranks.end() == wide.decode() + "\n[1] from rank 1\n\rdone\n"


def test_lines_on_another_file_do_not_wait_and_rank_0s_end_lets_the_waiting_lines_out():
    out, err = Screen(), Screen()
    ranks = Ranks(out, err)
    ranks.send(0, b"half a line")
    ranks.send(1, b"on stderr\n", stream="stderr")  # stderr is another file: rank 0's stdout line does not matter
    assert err.getvalue() == "[1] on stderr\n"
    ranks.send(1, b"on stdout\n")
    assert out.getvalue() == "half a line"
    assert ranks.end() == "half a line\n[1] on stdout\n"


def test_hvdp_runs_last_line_never_waits_and_comes_after_the_lines_that_did():
    screen = TTY()
    terminal = Terminal(screen, screen)
    terminal.write("stdout", b"PART")
    terminal.line("stdout", b"[1] waiting\n")
    terminal.line("stderr", b"hvdp: the job failed: rank 1 was lost.\n", final=True)
    assert screen.getvalue() == "PART\n[1] waiting\nhvdp: the job failed: rank 1 was lost.\n"
    terminal.write("stdout", b"\rbar 1/2")
    terminal.line("stderr", b"hvdp run: stopped by SIGTERM.\n", final=True)  # the bar's last state kept
    assert render(screen.getvalue())[-2:] == ["bar 1/2", "hvdp run: stopped by SIGTERM."]


def test_two_ranks_writing_at_once_from_two_threads_every_line_whole():
    screen = Screen()
    ranks = Ranks(screen)

    def rank0():
        for i in range(300):
            for piece in (b"PART", b" rank=0", f" i={i}".encode(), b" done", b"\n"):
                ranks.send(0, piece)

    def rank1():
        for i in range(300):
            ranks.send(1, f"PART rank=1 i={i} done\n".encode())

    threads = [threading.Thread(target=rank0), threading.Thread(target=rank1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = ranks.end().splitlines()
    assert [line for line in lines if not line.startswith("[1] ")] == [f"PART rank=0 i={i} done" for i in range(300)]
    assert [line for line in lines if line.startswith("[1] ")] == [f"[1] PART rank=1 i={i} done" for i in range(300)]


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
    proc = subprocess.run(worker.wrap([sys.executable, "-c", script]), env=env, capture_output=True,
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
    proc = subprocess.run(worker.wrap([sys.executable, "-c", "print('plain')"]), env=env, capture_output=True,
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
