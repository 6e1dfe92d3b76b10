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

import json
import os
import re
import secrets
import socket
import struct
import threading
import time
from pathlib import Path
from typing import IO, Callable, Dict, List, Optional, Sequence, Tuple

from hvdp.failures import Failure
from hvdp.launch import worker
from hvdp.launch.args import OUTPUT_MODES
from hvdp.launch.terminal import Terminal

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
