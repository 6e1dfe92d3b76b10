"""Every rank's output and failure, received on one socket and shown as a person wants to see it.

``hvdp run`` listens on a TCP port (loopback for a local job; the address the hosts reach
it by for ``-H`` hosts) and gives each rank its address in :data:`worker.ADDRESS_VAR`; the
rank's bootstrap (:mod:`hvdp.launch.worker`) sends what it writes, its failure record and
its exit. :class:`Display` shows it:

- ``--output all`` (default): rank 0's bytes reach the terminal unchanged (a tqdm bar
  redraws in place, colours and carriage returns kept); other ranks' lines appear, prefixed
  ``[N]``, only when they print, each whole, after rank 0's current line (:class:`Terminal`);
- ``--output rank0``: rank 0 only; ``--output prefixed``: every rank's lines, prefixed.

``--log-dir DIR`` keeps each rank's complete output in ``DIR/rankN.log``. The frameworks'
start-up lines that say nothing to the user (TensorFlow, absl, oneDNN) are left out of the
terminal unless ``--startup-logs`` is given; the logs keep them.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import secrets
import socket
import struct
import threading
import time
import unicodedata
from pathlib import Path
from typing import IO, Callable, Dict, List, Optional, Sequence, Tuple

from hvdp.failures import Failure
from hvdp.launch import worker
from hvdp.launch.args import OUTPUT_MODES

#: Start-up lines of TensorFlow, absl and oneDNN (as TensorFlow 2.16-2.20 print them on every rank).
NOISE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:.]+ +\d+ (?:port|cpu_feature_guard|cpu_utils)\.cc:\d+\] .*"
    r"|E\d{4} [\d:.]+ +\d+ cuda_(?:dnn|fft|blas)\.cc:\d+\] Unable to register .*factory.*"
    r"|W\d{4} [\d:.]+ +\d+ computation_placer\.cc:\d+\] .*already registered.*"
    r"|To enable the following instructions: .*rebuild TensorFlow with the appropriate compiler flags\.")
#: How a noise line may start: output that could still become one is held until its line ends.
_NOISE_HEAD = re.compile(r"(?:W(?:A(?:R(?:N(?:I(?:N(?:G(?::.*)?)?)?)?)?)?)?|[IWE](?:\d{1,4}(?: .*)?)?|T(?:o(?: .*)?)?)")
_HEADER = struct.Struct("!cI")


def is_noise(line: str) -> bool:
    """Whether a whole line (without its newline) is a framework's start-up noise.

    Example:
        >>> is_noise("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR")
        True
        >>> is_noise("epoch 1/20  loss 1.6479")
        False
    """
    return NOISE.fullmatch(line.rstrip("\r")) is not None


#: Seconds another rank's line waits at most for rank 0's unfinished line to end (a prompt, a
#: progress bar left unfinished, a line written slowly); then it is written on a line of its own.
HOLD_S = 0.5
#: An escape sequence (CSI, OSC, or a two-byte one): it takes no column of the terminal.
_ESCAPE = re.compile(rb"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
#: Back to the start of the line, and the line cleared.
_CLEAR = b"\r\x1b[K"
#: The most of an unfinished line kept to redraw it (a longer one is wider than any terminal).
_KEPT = 65536


def _width(data: bytes) -> int:
    """The columns ``data`` takes on a terminal: escape sequences none, wide characters two."""
    text = _ESCAPE.sub(b"", data).decode("utf-8", "replace")
    return sum(0 if not char.isprintable() or unicodedata.combining(char)
               else 2 if unicodedata.east_asian_width(char) in "WF" else 1 for char in text)


def _same_file(out: IO[str], err: IO[str]) -> bool:
    try:
        return out is err or os.path.samestat(os.fstat(out.fileno()), os.fstat(err.fileno()))
    except (OSError, ValueError, AttributeError):
        return False


class Terminal:
    """The launcher's stdout and stderr, written from several threads, every line whole.

    Rank 0's bytes (:meth:`write`) pass as they come. Every other line (:meth:`line`: the other
    ranks', horovodrun's, hvdp run's own) waits while rank 0's current line is unfinished and
    follows its newline, so that neither is cut. On a terminal, a line rank 0 redraws in place
    with carriage returns (a progress bar) lets it through at once, as ``tqdm.write`` does: the
    bar cleared, the line, the bar redrawn. A line of rank 0 that does not end holds the others
    for at most ``hold_s`` seconds (:data:`HOLD_S`).

    When stdout and stderr are the same terminal, pipe or file, a line for either waits for
    rank 0's line in both.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> terminal = Terminal(out, out)
        >>> terminal.write("stdout", b"acc ")
        >>> terminal.line("stdout", b"[1] acc 1 0.93\\n")
        >>> terminal.write("stdout", b"0 0.94\\n")
        >>> print(out.getvalue(), end="")
        acc 0 0.94
        [1] acc 1 0.93
    """

    def __init__(self, out: IO[str], err: IO[str], hold_s: float = HOLD_S) -> None:
        self.streams = {"stdout": out, "stderr": err}
        self.decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in self.streams}
        self.hold_s = hold_s
        #: Where each stream's bytes land: one place when stdout and stderr are the same.
        self.place = {"stdout": "stdout", "stderr": "stdout" if _same_file(out, err) else "stderr"}
        self.tty = {name: bool(getattr(stream, "isatty", lambda: False)()) for name, stream in self.streams.items()}
        #: Rank 0's unfinished line in each place: its bytes since the last newline or carriage
        #: return (what a redraw shows), and whether a carriage return came since the newline.
        self.unfinished = {name: b"" for name in self.streams}
        self.redrawn = {name: False for name in self.streams}
        #: The lines waiting for it to end, in order, and when they go regardless.
        self.waiting: Dict[str, List[Tuple[str, bytes]]] = {name: [] for name in self.streams}
        self.due = {name: 0.0 for name in self.streams}
        self.lock = threading.Lock()
        self._wake = threading.Condition(self.lock)
        self._timer: Optional[threading.Thread] = None

    def write(self, stream: str, data: bytes) -> None:
        """Rank 0's ``data`` to ``stream`` ("stdout" or "stderr") as it is; the lines waiting go after its newline."""
        if not data:
            return
        with self.lock:
            place = self.place[stream]
            while self.waiting[place] and b"\n" in data:
                cut = data.index(b"\n") + 1
                self._rank0(stream, data[:cut])
                self._release(place)
                data = data[cut:]
            self._rank0(stream, data)
            if self.waiting[place] and self.redrawn[place] and self.tty[place]:  # a bar began: between redraws
                self._give_way(place)

    def line(self, stream: str, data: bytes, final: bool = False) -> None:
        """Write whole lines (``data`` ends with a newline) on a line of their own, after rank 0's current line.

        ``final``: hvdp run's own last word, not to wait; rank 0's unfinished line is ended first.
        """
        with self.lock:
            place = self.place[stream]
            if final:
                self._end(place)
                self._write(stream, data)
            elif not (self.unfinished[place] or self.redrawn[place]):
                self._write(stream, data)
            else:
                self.waiting[place].append((stream, data))
                if self.redrawn[place] and self.tty[place]:
                    self._give_way(place)
                elif len(self.waiting[place]) == 1:
                    self.due[place] = time.monotonic() + self.hold_s
                    if self._timer is None:
                        self._timer = threading.Thread(target=self._watch, daemon=True)
                        self._timer.start()
                    self._wake.notify()

    def ended(self, stream: str) -> None:
        """Rank 0 writes no more to ``stream``: the lines waiting for its line go now, on a line of their own."""
        with self.lock:
            place = self.place[stream]
            if self.waiting[place]:
                self._end(place)

    def finish(self) -> None:
        """Write every line still waiting (the job's output has ended)."""
        with self.lock:
            for place, waiting in self.waiting.items():
                if waiting:
                    self._end(place)

    def _rank0(self, stream: str, data: bytes) -> None:
        self._write(stream, data)
        place = self.place[stream]
        line = data.rsplit(b"\n", 1)[-1]
        if len(line) < len(data):  # a newline: a new line begins
            self.unfinished[place], self.redrawn[place] = b"", False
        if b"\r" in line:
            self.unfinished[place], self.redrawn[place] = line.rsplit(b"\r", 1)[-1], True
        else:
            self.unfinished[place] = (self.unfinished[place] + line)[-_KEPT:]

    def _release(self, place: str) -> None:
        """The waiting lines, at the start of a line."""
        lines, self.waiting[place] = self.waiting[place], []
        for stream, data in lines:
            self._write(stream, data)

    def _end(self, place: str) -> None:
        """Rank 0's unfinished line ended where it is, then the waiting lines."""
        if self.unfinished[place] or self.redrawn[place]:
            self._write(place, b"\n")
            self.unfinished[place], self.redrawn[place] = b"", False
        self._release(place)

    def _give_way(self, place: str) -> None:
        """The waiting lines before rank 0's unfinished one: on a terminal, where it fits on one row, that
        line cleared and redrawn after them (nothing of it lost); else it is ended where it is."""
        if self.tty[place] and _width(self.unfinished[place]) <= self._columns(place):
            lines, self.waiting[place] = self.waiting[place], []
            self._write(place, _CLEAR)
            for stream, data in lines:
                self._write(stream, data)
            self._write(place, self.unfinished[place])
        else:
            self._end(place)

    def _columns(self, place: str) -> int:
        try:
            return os.get_terminal_size(self.streams[place].fileno()).columns
        except (OSError, ValueError, AttributeError):
            return 80

    def _watch(self) -> None:
        """Lets the lines through that waited ``hold_s`` for rank 0's line to end (a thread while any wait)."""
        with self._wake:
            try:
                while True:
                    now = time.monotonic()
                    for place, waiting in self.waiting.items():
                        if waiting and self.due[place] <= now:
                            self._give_way(place)
                    due = [self.due[place] for place, waiting in self.waiting.items() if waiting]
                    if not due:
                        return
                    self._wake.wait(min(due) - now)
            finally:
                self._timer = None

    def _write(self, stream: str, data: bytes) -> None:
        target = self.streams[stream]
        raw = getattr(target, "buffer", None)
        if raw is not None:
            target.flush()
            raw.write(data)
            raw.flush()
        else:
            target.write(self.decoders[stream].decode(data))
            target.flush()


class RankOutput:
    """One stream of one rank: its bytes on their way to the terminal and to its log."""

    def __init__(self, rank: int, stream: str, display: "Display") -> None:
        self.rank, self.stream, self.display = rank, stream, display
        self.held = b""  # the start of a line that may be noise, or a prefixed rank's unfinished line
        self.unlogged = b""  # the unfinished line, kept from the log until it ends (stdout and stderr share it)

    def log(self, data: bytes) -> None:
        """Into the rank's log, whole lines at a time, so that its stdout and stderr lines stay whole."""
        data, self.unlogged = self.unlogged + data, b""
        cut = data.rfind(b"\n") + 1
        self.display.log(self.rank, data[:cut])
        self.unlogged = data[cut:]

    def raw(self, data: bytes) -> None:
        """Rank 0's way: bytes as written, whole noise lines left out."""
        data, self.held = self.held + data, b""
        if not self.display.quiet:
            self.display.terminal.write(self.stream, data)
            return
        *lines, last = data.split(b"\n")
        shown = b"".join(line + b"\n" for line in lines if not is_noise(line.decode("utf-8", "replace")))
        if _NOISE_HEAD.fullmatch(last.decode("utf-8", "replace")):
            self.held = last
        else:
            shown += last
        self.display.terminal.write(self.stream, shown)

    def prefixed(self, data: bytes) -> None:
        """Other ranks' way: each whole line once, ``[N] `` in front (of a redrawn line, its last state)."""
        *lines, self.held = (self.held + data).split(b"\n")
        for line in lines:
            self.show_line(line)

    def show_line(self, line: bytes) -> None:
        text = line.split(b"\r")[-1] if line.rstrip(b"\r") else line
        if self.display.quiet and is_noise(text.decode("utf-8", "replace")):
            return
        self.display.terminal.line(self.stream, f"[{self.rank}] ".encode() + text + b"\n")

    def flush(self) -> None:
        self.display.log(self.rank, self.unlogged)
        self.unlogged = b""
        if self.display.shows(self.rank) and self.display.is_raw(self.rank):
            self.display.terminal.write(self.stream, self.held)
            self.display.terminal.ended(self.stream)
        elif self.held and self.display.shows(self.rank):
            self.show_line(self.held)
        self.held = b""


class Display:
    """What reaches the terminal and the logs (``--output``, ``--log-dir``, ``--startup-logs``)."""

    def __init__(self, terminal: Terminal, mode: str = "all", log_dir: Optional[str] = None,
                 quiet: bool = True) -> None:
        if mode not in OUTPUT_MODES:
            raise ValueError(f"--output {mode!r}: expected one of {', '.join(OUTPUT_MODES)}.")
        self.terminal, self.mode, self.quiet = terminal, mode, quiet
        self.log_dir = Path(log_dir) if log_dir else None
        self.logs: Dict[int, IO[bytes]] = {}
        self.lock = threading.Lock()
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)

    def shows(self, rank: int) -> bool:
        return rank <= 0 or self.mode != "rank0"

    def is_raw(self, rank: int) -> bool:
        return rank <= 0 and self.mode != "prefixed"

    def log(self, rank: int, data: bytes) -> None:
        """Append to ``DIR/rankN.log`` (``DIR/launcher.log`` for horovodrun's own output, rank -1)."""
        if self.log_dir is None or not data:
            return
        with self.lock:
            if rank not in self.logs:
                name = "launcher.log" if rank < 0 else f"rank{rank}.log"
                self.logs[rank] = open(self.log_dir / name, "ab")
            self.logs[rank].write(data)
            self.logs[rank].flush()

    def close(self) -> None:
        self.terminal.finish()
        with self.lock:
            for log in self.logs.values():
                log.close()
            self.logs.clear()


#: A running rank whose last frame is older than this has gone silent (its heartbeat stopped).
SILENT_S = 3 * worker.HEARTBEAT_S


class Relay:
    """The listener every rank sends its output, failure record, heartbeat and exit to.

    A rank whose connection closes without an exit frame was lost (its bootstrap was killed
    with it, or its host or container went away): ``on_lost(rank, host, when)``. A running
    rank whose frames stopped (:meth:`silent`) is paused or cut off from the network.
    """

    def __init__(self, display: Display, on_line: Callable[[int, str, str], None],
                 on_failure: Callable[[Failure], None], on_exit: Callable[[int, int, float], None],
                 on_lost: Optional[Callable[[int, str, float], None]] = None) -> None:
        self.display, self.on_line, self.on_failure, self.on_exit = display, on_line, on_failure, on_exit
        self.on_lost = on_lost
        self.token = secrets.token_hex(16)
        self.server: Optional[socket.socket] = None
        self.threads: List[threading.Thread] = []
        #: Running ranks by connection: [rank, host, time of the last frame].
        self.running: Dict[int, List] = {}
        self._lock = threading.Lock()

    def silent(self, seconds: float, now: Optional[float] = None) -> List[Tuple[int, str, float]]:
        """(rank, host, time of its last frame) of each running rank that sent nothing for ``seconds``."""
        now = time.time() if now is None else now
        with self._lock:
            return sorted((rank, host, last) for rank, host, last in self.running.values() if now - last > seconds)

    def start(self, bind: str = "127.0.0.1") -> int:
        """Listen (on ``bind``, any free port); the port."""
        self.server = socket.create_server((bind, 0), backlog=128)
        threading.Thread(target=self._accept, daemon=True).start()
        return int(self.server.getsockname()[1])

    def address(self, host: str) -> str:
        """The value of :data:`worker.ADDRESS_VAR` for ranks that reach this machine as ``host``."""
        assert self.server is not None, "start() first"
        return f"{host}:{self.server.getsockname()[1]}:{self.token}"

    def _accept(self) -> None:
        assert self.server is not None
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as stream:
            try:
                hello = json.loads(stream.readline(4096) or b"{}")
            except ValueError:
                return
            if not isinstance(hello, dict) or hello.get("token") != self.token:
                return
            rank = int(hello.get("rank", -1))
            host = str(hello.get("host", ""))
            key = id(conn)
            with self._lock:
                self.running[key] = [rank, host, time.time()]
            outputs = {kind: RankOutput(rank, name, self.display)
                       for kind, name in ((b"o", "stdout"), (b"e", "stderr"))}
            lines = {kind: b"" for kind in outputs}
            ended = False
            while True:
                try:
                    header = stream.read(_HEADER.size)
                    if len(header) < _HEADER.size:
                        break
                    kind, length = _HEADER.unpack(header)
                    payload = stream.read(length)
                except OSError:  # reset by the peer: as lost as a closed connection
                    break
                with self._lock:
                    if key in self.running:
                        self.running[key][2] = time.time()
                if kind == b"h":
                    continue
                if kind in outputs:
                    self._output(rank, outputs[kind], payload)
                    *whole, lines[kind] = (lines[kind] + payload).split(b"\n")
                    for line in whole:
                        self.on_line(rank, outputs[kind].stream, line.decode("utf-8", "replace"))
                elif kind == b"r":
                    self._failure(rank, payload)
                elif kind == b"x":
                    ended = True
                    with self._lock:
                        self.running.pop(key, None)
                    exit_ = json.loads(payload)
                    self.on_exit(rank, int(exit_.get("code", 0)), float(exit_.get("time", time.time())))
            with self._lock:
                self.running.pop(key, None)
            if not ended and self.on_lost is not None:
                self.on_lost(rank, host, time.time())
            for kind, output in outputs.items():
                output.flush()
                if lines[kind]:
                    self.on_line(rank, output.stream, lines[kind].decode("utf-8", "replace"))

    def _output(self, rank: int, output: RankOutput, data: bytes) -> None:
        output.log(data)
        if not self.display.shows(rank):
            return
        if self.display.is_raw(rank):
            output.raw(data)
        else:
            output.prefixed(data)

    def _failure(self, rank: int, payload: bytes) -> None:
        try:
            failure = Failure.from_json(json.loads(payload))
        except (ValueError, TypeError, AttributeError):
            return
        if failure.rank < 0:
            failure.rank = rank
        self.display.log(rank, failure.traceback.encode())
        self.on_failure(failure)

    def wait(self, timeout_s: float, cancel: Optional[threading.Event] = None) -> None:
        """Wait for the ranks' connections to end (their last output), up to ``timeout_s`` or until ``cancel``."""
        deadline = time.monotonic() + timeout_s
        for thread in list(self.threads):
            while thread.is_alive() and time.monotonic() < deadline and not (cancel is not None and cancel.is_set()):
                thread.join(min(0.05, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.display.close()


def reachable_address(hosts: Sequence[str]) -> Tuple[str, str]:
    """(the address to listen on, the address remote ``hosts`` reach this machine by).

    The second is the source address of this machine's route to the first host (no packet
    is sent); for a local job both are the loopback address.
    """
    if not hosts:
        return "127.0.0.1", "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((hosts[0], 9))
        return "0.0.0.0", str(probe.getsockname()[0])
    except OSError:
        return "0.0.0.0", socket.gethostname()
    finally:
        probe.close()


def stream_env(out: IO[str], err: IO[str], mode: str) -> Dict[str, str]:
    """What rank 0's bootstrap needs to know of ``hvdp run``'s stdout and stderr.

    :data:`worker.TTY_VAR`: the terminal's size when ``out`` is one (rank 0 then writes to a
    pseudo-terminal); :data:`worker.SHARED_VAR`: set when ``out`` and ``err`` are the same
    terminal, pipe or file (rank 0 then writes both to one, so their order is kept).
    """
    if mode == "prefixed":
        return {}
    env: Dict[str, str] = {}
    try:
        if out.isatty():
            size = os.get_terminal_size(out.fileno())
            env[worker.TTY_VAR] = f"{size.columns}x{size.lines}"
        if os.path.samestat(os.fstat(out.fileno()), os.fstat(err.fileno())):
            env[worker.SHARED_VAR] = "1"
    except (OSError, ValueError, AttributeError):
        pass
    return env
