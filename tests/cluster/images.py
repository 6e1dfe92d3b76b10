"""Podman for the image and Compose tests: the image built by scripts/podman-build.sh, and
docker/compose.yml brought up with podman-compose under a project name of the test's own.

Everything a test starts is named after its project (PROJECT_worker1_1, PROJECT_cluster,
PROJECT_ssh); clean-up removes those containers, networks and volumes only, and keeps the
images (the layer cache that makes the next build warm).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker" / "compose.yml"
STATE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hvdp" / "podman"
CONTAINERS_CONF = STATE / "containers.conf"  # written by scripts/podman-build.sh (runc, ulimits)
#: podman-compose, in a tool environment of its own (it is not one of hvdp's dependencies).
PODMAN_COMPOSE_VERSION = "1.6.0"
COMPOSE_VENV = STATE / "compose-venv"


def skip_reason() -> Optional[str]:
    """Why the image tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "podman runs containers here only as root (runc, no user namespaces): run as root"
    if not shutil.which("podman") and not shutil.which("apt-get"):
        return "no podman, and no apt-get to install it (scripts/podman-build.sh installs podman on Debian)"
    return None


def environment(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ, CONTAINERS_CONF=str(CONTAINERS_CONF))
    env.update(extra or {})
    return env


def podman(*argv: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["podman", *argv], capture_output=True, text=True, timeout=timeout,
                         env=environment(), check=False)
    if check and out.returncode != 0:
        raise RuntimeError(f"podman {' '.join(argv)} exited {out.returncode}: {out.stderr.strip()}")
    return out


def pause(container: str, tries: int = 5) -> None:
    """`podman pause CONTAINER`, tried again when the freeze fails. Under cgroup v1 runc freezes a
    container by retrying for about 2 s and then thaws it and says "unable to freeze" (runc calls this a
    game of chances); measured here once in a CI run, on 2 cores busy with three Compose jobs. After that
    error the container runs on, so trying again is safe."""
    failures = []
    for _ in range(tries):
        out = podman("pause", container, check=False)
        if out.returncode == 0:
            return
        failures.append(out.stderr.strip())
        if "unable to freeze" not in out.stderr:
            break
        time.sleep(1)
    raise RuntimeError(f"podman pause {container} failed {len(failures)} time(s): " + " | ".join(failures))


@dataclass
class Built:
    tag: str
    seconds: float
    log: str


def build_image(tag: str, log: Path, timeout: float = 3600) -> Built:
    """scripts/podman-build.sh TAG (nice 10: a cold build compiles for minutes on every core)."""
    started = time.monotonic()
    with log.open("w") as out:
        done = subprocess.run(["nice", "-n", "10", str(REPO / "scripts" / "podman-build.sh"), tag],
                              stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False)
    text = log.read_text()
    if done.returncode != 0:
        raise RuntimeError(f"scripts/podman-build.sh {tag} exited {done.returncode}:\n{text[-4000:]}")
    return Built(tag, time.monotonic() - started, text)


def podman_compose() -> List[str]:
    """The podman-compose command, installed into its tool environment when missing."""
    binary = COMPOSE_VENV / "bin" / "podman-compose"
    if not binary.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(COMPOSE_VENV)], check=True)
        subprocess.run([str(COMPOSE_VENV / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                        f"podman-compose=={PODMAN_COMPOSE_VERSION}"], check=True, capture_output=True)
    return [str(binary)]


@dataclass
class Project:
    """docker/compose.yml under the project name ``name``, with the image ``image``."""

    name: str
    image: str
    log: Path
    settings: Dict[str, str] = field(default_factory=dict)
    process: Optional[subprocess.Popen] = None
    started: float = 0.0

    def compose(self, *argv: str) -> List[str]:
        return [*podman_compose(), "-p", self.name, "-f", str(COMPOSE_FILE), *argv]

    def env(self) -> Dict[str, str]:
        return environment({"HVDP_IMAGE": self.image, **self.settings})

    def up(self) -> None:
        """``up --abort-on-container-exit --exit-code-from launcher``, in the background."""
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            self.compose("up", "--abort-on-container-exit", "--exit-code-from", "launcher"),
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=self.env(), start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float) -> float:
        """Seconds since ``up`` until ``text`` appears in the output; raises if it does not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output():
                return time.monotonic() - self.started
            if self.process is not None and self.process.poll() is not None:
                break
            time.sleep(0.5)
        raise AssertionError(f"{text!r} not seen in {timeout:.0f} s:\n{self.output()[-4000:]}")

    def wait(self, timeout: float) -> int:
        """The exit code of ``up`` (the launcher's); ends its process group if it outlives ``timeout``."""
        assert self.process is not None
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise AssertionError(f"compose up still running after {timeout:.0f} s:\n{self.output()[-4000:]}") from None

    def container(self, service: str) -> str:
        return f"{self.name}_{service}_1"

    def logs(self, service: str) -> str:
        """The whole output of ``service``'s container (``up`` stops streaming it when it aborts)."""
        out = podman("logs", self.container(service), check=False)
        return out.stdout + out.stderr

    def network(self) -> str:
        return f"{self.name}_cluster"

    def down(self) -> subprocess.CompletedProcess:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        return subprocess.run(self.compose("down", "-v", "-t", "5"), capture_output=True, text=True,
                              env=self.env(), timeout=180, check=False)

    def leftovers(self) -> Dict[str, List[str]]:
        """The project's containers, networks and volumes that still exist (named PROJECT_...)."""
        found = {}
        for kind, argv in (("containers", ["ps", "-a"]), ("networks", ["network", "ls"]),
                           ("volumes", ["volume", "ls"])):
            names = podman(*argv, "--format", "{{.Name}}" if kind == "volumes" else "{{.Names}}"
                           if kind == "containers" else "{{.Name}}", check=False).stdout.split()
            found[kind] = [name for name in names if name.startswith(f"{self.name}_")]
        return found

    def prune(self) -> None:
        """Remove whatever of the project is left (containers, then networks and volumes); images stay."""
        left = self.leftovers()
        for name in left["containers"]:
            podman("rm", "-f", "-t", "0", name, check=False)
        for name in left["networks"]:
            podman("network", "rm", "-f", name, check=False)
        for name in left["volumes"]:
            podman("volume", "rm", "-f", name, check=False)


def image_history(tag: str) -> List[str]:
    """The command of every layer of ``tag`` (``podman history``), oldest last."""
    out = podman("history", "--no-trunc", "--format", "{{.CreatedBy}}", tag)
    return out.stdout.splitlines()


def image_config(tag: str) -> dict:
    return json.loads(podman("image", "inspect", tag).stdout)[0]
