"""A `hvdp run` job watched while it runs: its output line by line with the time each arrived,
signals sent to it, and the processes of the job found by their environment."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import List, Optional, Tuple

from harness import HVDP, REPO


def job_processes(out_dir: Path) -> List[int]:
    """Every live process whose environment names ``out_dir`` (so: part of the job writing there)."""
    marker = f"HVDP_TEST_OUT={out_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry.name))
        except OSError:
            pass
    return found


class LiveJob:
    """`hvdp run ARGS` started now, with HVDP_TEST_OUT=out_dir."""

    def __init__(self, args: List[str], out_dir: Path, prefix: Optional[List[str]] = None) -> None:
        env = {**os.environ, "HVDP_TEST_OUT": str(out_dir), "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
        env.pop("HVDP_FRAMEWORK", None)
        env.pop("KERAS_BACKEND", None)
        self.out_dir = out_dir
        self.lines: List[Tuple[float, str]] = []
        self.proc = subprocess.Popen([*(prefix or []), *HVDP, "run", *args], cwd=REPO, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, errors="replace")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float, after: float = 0.0) -> Tuple[float, str]:
        """The first line (and its time) matching ``pattern`` that arrived after ``after``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for when, line in list(self.lines):
                if when >= after and re.search(pattern, line):
                    return when, line
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.1)
        self.kill()
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{self.output[-5000:]}")

    def wait(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"hvdp run still running after {timeout} s:\n{self.output[-5000:]}") from None
        self._reader.join(timeout=5)
        return code

    def kill(self) -> None:
        """After a failed check: leave nothing of the job running."""
        for pid in [self.proc.pid, *job_processes(self.out_dir)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
