"""The launcher's terminal: stdout and stderr written from several threads, every line whole.

Rank 0's bytes pass as they come; every other line (another rank's, horovodrun's, hvdp run's
own) waits for rank 0's unfinished line to end, so that neither is cut (:class:`Terminal`).
:mod:`hvdp.launch.relay` writes through it.
"""

from __future__ import annotations

import codecs
import os
import re
import threading
import time
import unicodedata
from typing import IO, Dict, List, Optional, Tuple

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
