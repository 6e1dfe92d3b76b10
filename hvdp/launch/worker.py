"""The start of every rank under ``hvdp run``: its output and its failure go to the launcher.

horovodrun (or mpirun, or the elastic driver) starts ``python .../hvdp/launch/worker.py
COMMAND...`` as each rank. This connects to the address ``hvdp run`` listens on
(:data:`ADDRESS_VAR`: ``host:port:token``), starts COMMAND with its stdout and stderr on
pipes (on pseudo-terminals for rank 0 when ``hvdp run`` writes to a terminal, so libraries
such as tqdm still see one: :data:`TTY_VAR` gives its size), and sends everything COMMAND
writes, from its first byte, to ``hvdp run`` with the rank attached. When COMMAND ends it
sends the failure record COMMAND wrote (:mod:`hvdp.failures`) and how it ended, then ends
the same way (the same exit code, or killed by the same signal).

If ``hvdp run`` cannot be reached, COMMAND runs in this process's place and its output takes
horovodrun's own way. Only the standard library is used, and the file runs by its path, so
a rank starts without importing hvdp twice.

Frames on the connection: a JSON hello line, then ``kind (1 byte) + length (4 bytes) +
payload``: ``o``/``e`` output of stdout/stderr, ``r`` a failure record, ``x`` the exit, and
``h`` (empty) every :data:`HEARTBEAT_S` seconds while COMMAND runs, so that ``hvdp run`` can
tell a rank that went silent (its host paused, or cut off from the network) from a busy one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

#: ``host:port:token`` of ``hvdp run``'s output listener.
ADDRESS_VAR = "HVDP_OUTPUT_ADDRESS"
#: ``COLUMNSxLINES`` when ``hvdp run`` writes to a terminal (rank 0 then writes to pseudo-terminals).
TTY_VAR = "HVDP_OUTPUT_TTY"
#: Set when ``hvdp run``'s stdout and stderr are the same terminal, pipe or file: rank 0 then writes
#: both to one, so that their order is kept (a progress bar on stderr, lines on stdout).
SHARED_VAR = "HVDP_OUTPUT_SHARED"
#: The file COMMAND writes its failure record to (:data:`hvdp.failures.FILE_VAR`).
FAILURE_VAR = "HVDP_FAILURE_FILE"
#: Seconds between two heartbeats of a running rank.
HEARTBEAT_S = 2.0
_HEADER = struct.Struct("!cI")
_PR_SET_PDEATHSIG = 1


def wrap(command: List[str], python: str = sys.executable) -> List[str]:
    """``command`` started through this bootstrap (run by its path).

    Example:
        >>> wrap(["python", "train.py"], python="python")[1].endswith("worker.py")
        True
    """
    return [python, os.path.abspath(__file__), *command]


def _rank() -> int:
    for var in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return -1


def _connect(address: str) -> Optional[socket.socket]:
    parts = address.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    host, port, token = parts
    try:
        conn = socket.create_connection((host, int(port)), timeout=10)
    except OSError:
        return None
    conn.settimeout(None)
    hello = {"token": token, "rank": _rank(), "host": socket.gethostname(), "pid": os.getpid()}
    conn.sendall((json.dumps(hello) + "\n").encode())
    return conn


class _Sender:
    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.broken = False

    def send(self, kind: bytes, payload: bytes) -> None:
        if self.broken:
            return
        with self.lock:
            try:
                self.conn.sendall(_HEADER.pack(kind, len(payload)) + payload)
            except OSError:
                self.broken = True  # hvdp run has gone: COMMAND goes on, its output is lost


def _terminal(size: str) -> "tuple[int, int]":
    """A pseudo-terminal of ``COLUMNSxLINES`` that passes bytes unchanged (no \\n to \\r\\n)."""
    import fcntl
    import pty
    import termios

    master, slave = pty.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST  # output as written: carriage returns and colours pass untouched
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    columns, _, lines = size.partition("x")
    if columns.isdigit() and lines.isdigit():
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", int(lines), int(columns), 0, 0))
    return master, slave


def _pump(fd: int, kind: bytes, sender: _Sender) -> None:
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: every writer of a pseudo-terminal has closed it
            data = b""
        if not data:
            break
        sender.send(kind, data)
    os.close(fd)


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main(command: List[str]) -> int:
    """Run COMMAND as this rank, its output and failure sent to ``hvdp run``; its exit code."""
    conn = _connect(os.environ.pop(ADDRESS_VAR, ""))
    size = os.environ.pop(TTY_VAR, "")
    shared = os.environ.pop(SHARED_VAR, "")
    if conn is None:
        os.execvp(command[0], command)  # no launcher to talk to: the output takes horovodrun's way
    sender = _Sender(conn)
    fd, failure_file = tempfile.mkstemp(prefix="hvdp-failure-", suffix=".json")
    os.close(fd)
    os.unlink(failure_file)
    env: Dict[str, str] = {**os.environ, FAILURE_VAR: failure_file}
    if _rank() == 0 and shared:  # one channel for both, in the order they were written
        pipes = [_terminal(size) if size else os.pipe()]
    else:
        pipes = [_terminal(size) if size and _rank() == 0 else os.pipe() for _ in ("stdout", "stderr")]
    child = subprocess.Popen(command, stdout=pipes[0][1], stderr=pipes[-1][1], env=env,
                             preexec_fn=_die_with_parent)
    for _, write_end in pipes:
        os.close(write_end)

    def forward(signum: int, _frame: object) -> None:
        try:
            child.send_signal(signum)
        except OSError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    pumps = [threading.Thread(target=_pump, args=(read_end, kind, sender), daemon=True)
             for (read_end, _), kind in zip(pipes, (b"o", b"e"))]
    for pump in pumps:
        pump.start()
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(HEARTBEAT_S):
            sender.send(b"h", b"")

    threading.Thread(target=heartbeat, daemon=True).start()
    while True:
        try:
            code = child.wait()
            ended = time.time()
            break
        except InterruptedError:
            continue
    done.set()
    for pump in pumps:  # the rest of the output (a process COMMAND left running may hold the pipe)
        pump.join(timeout=2)
    try:
        with open(failure_file) as found:
            sender.send(b"r", found.read().encode())
        os.unlink(failure_file)
    except OSError:
        pass
    sender.send(b"x", json.dumps({"code": code, "time": ended}).encode())
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()
    if code < 0:  # killed by a signal: end the same way, so horovodrun and mpirun see what happened
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
