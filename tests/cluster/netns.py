"""Several hosts on this machine: network namespaces on one bridge, each worker with its own sshd.

    launcher  10.77.0.1   runs hvdp run (so horovodrun's driver address is on the shared subnet)
    worker1   10.77.0.2   sshd on port 2222
    worker2   10.77.0.3   sshd on port 2222

Every host's interface is called eth0, as on real hosts of one cluster. Only these addresses,
inside namespaces and a bridge this module creates, are used; the bridge itself has no address,
so nothing outside the namespaces can be reached from them or reach them.

The names carry the creating process id, so concurrent runs don't collide and leftovers of a
killed run are recognised and removed by the next one. :meth:`Cluster.stop` removes everything
(processes in the namespaces, namespaces, bridge) and is safe to call after any failure.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Dict, List, Optional, Sequence

SUBNET = "10.77.0"
SSH_PORT = 2222
SSHD = "/usr/sbin/sshd"
#: Names of what a Cluster creates: hvdp<pid><tag>-<host> namespaces, hvbr<pid><tag> bridge,
#: hv<pid><tag>v<i> veths (<tag>: one optional letter, for several clusters in one process).
_NS = re.compile(r"^hvdp(\d+)[a-z]?-\w+$")
_BRIDGE = re.compile(r"^hvbr(\d+)[a-z]?$")


@dataclass
class Host:
    name: str
    netns: str
    address: str
    veth: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {out.stderr.strip()}")
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(netns: str) -> None:
    """End every process inside ``netns`` (all started by a Cluster: sshd, ranks, orted)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [int(p) for p in _ip("netns", "pids", netns, check=False).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while pids and any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)


def namespaces() -> List[str]:
    """Network namespace names on this machine."""
    return [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.strip()]


def links() -> List[str]:
    """Network interface names in this (the root) namespace."""
    return [re.sub(r"@.*$", "", line.split()[0]) for line in _ip("-br", "link", check=False).stdout.splitlines()]


def remove_leftovers() -> List[str]:
    """Remove namespaces and bridges of Clusters whose process is gone; return their names."""
    removed = []
    for netns in namespaces():
        match = _NS.match(netns)
        if match and not _alive(int(match.group(1))):
            _kill_namespace_processes(netns)
            _ip("netns", "del", netns, check=False)
            removed.append(netns)
    for link in links():
        match = _BRIDGE.match(link)
        if match and not _alive(int(match.group(1))):
            _ip("link", "del", link, check=False)
            removed.append(link)
    return removed


class Cluster:
    """A launcher namespace and ``workers`` worker namespaces with sshd, on one bridge."""

    def __init__(self, workdir: Path, workers: int = 2, tag: str = "", subnet: str = SUBNET) -> None:
        if not re.fullmatch(r"[a-z]?", tag) or not re.fullmatch(r"10\.77\.\d{1,3}", subnet):
            raise ValueError(f"tag {tag!r} must be one letter or none, subnet {subnet!r} within 10.77.0.0/16")
        name = f"{os.getpid()}{tag}"
        self.workdir = workdir
        self.bridge = f"hvbr{name}"
        self.launcher = Host("launcher", f"hvdp{name}-launcher", f"{subnet}.1", f"hv{name}v0")
        self.workers = [Host(f"worker{i}", f"hvdp{name}-worker{i}", f"{subnet}.{i + 1}", f"hv{name}v{i}")
                        for i in range(1, workers + 1)]
        self.key = workdir / "id_ed25519"
        self.bin = workdir / "bin"
        self._sshd: Dict[str, subprocess.Popen] = {}
        self._logs: List[IO[str]] = []

    @property
    def hosts(self) -> List[Host]:
        return [self.launcher, *self.workers]

    @property
    def sshd_pids(self) -> Dict[str, int]:
        """Worker name -> process id of its listening sshd."""
        return {name: proc.pid for name, proc in self._sshd.items()}

    # -- set-up -------------------------------------------------------------------------------
    def start(self) -> "Cluster":
        missing = [tool for tool in ("ip", "ssh", "ssh-keygen", SSHD) if not shutil.which(tool)]
        if missing or os.geteuid() != 0:
            raise RuntimeError(f"the multi-host test needs root and {', '.join(missing) or 'nothing else'}: "
                               f"run scripts/setup.sh (apt-get install -y openssh-server iproute2)")
        remove_leftovers()
        try:
            self._network()
            self._ssh_files()
            for worker in self.workers:
                self._start_sshd(worker)
            self._wait_for_ssh()
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts:
            _ip("netns", "add", host.netns)
            _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            _ip("link", "set", host.veth, "master", self.bridge, "up")
            _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.netns, "link", "set", "eth0", "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")

    def _ssh_files(self) -> None:
        """Host and user keys, sshd's config, and an ssh that uses its own client config.

        The client config only turns off host key prompts and the user's known_hosts (the
        workers' host key is new every run); port and key come from hvdp run's options.
        """
        for key in (self.workdir / "host_ed25519", self.key):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hvdp-test", "-f", str(key)],
                           check=True, capture_output=True, timeout=30)
        authorized = self.workdir / "authorized_keys"
        authorized.write_text((self.workdir / "id_ed25519.pub").read_text())
        authorized.chmod(0o600)
        (self.workdir / "sshd_config").write_text(
            f"Port {SSH_PORT}\nHostKey {self.workdir / 'host_ed25519'}\nAuthorizedKeysFile {authorized}\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UsePAM no\nStrictModes no\nPidFile none\nLogLevel VERBOSE\n")
        (self.workdir / "ssh_config").write_text(
            "Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
            "  BatchMode yes\n  ConnectTimeout 10\n")
        self.bin.mkdir(exist_ok=True)
        wrapper = self.bin / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {self.workdir / "ssh_config"} "$@"\n')
        wrapper.chmod(0o755)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory

    def _start_sshd(self, worker: Host) -> None:
        log = (self.workdir / f"sshd-{worker.name}.log").open("w")
        self._logs.append(log)
        self._sshd[worker.name] = subprocess.Popen(
            ["ip", "netns", "exec", worker.netns, SSHD, "-D", "-e", "-f", str(self.workdir / "sshd_config"),
             "-o", f"ListenAddress={worker.address}"], stdout=log, stderr=subprocess.STDOUT)

    def _wait_for_ssh(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            while True:
                probe = self.run(self.launcher, ["ssh", "-p", str(SSH_PORT), "-i", str(self.key), worker.address,
                                                 "echo ok"], timeout=20)
                if probe.returncode == 0 and probe.stdout.strip() == "ok":
                    break
                if time.monotonic() > deadline or self._sshd[worker.name].poll() is not None:
                    raise RuntimeError(f"sshd on {worker.name} ({worker.address}:{SSH_PORT}) is not reachable: "
                                       f"{probe.stdout[-1000:]}\n{self.sshd_log(worker)[-2000:]}")
                time.sleep(0.5)

    # -- use ----------------------------------------------------------------------------------
    def env(self, extra: Optional[Dict[str, Optional[str]]] = None) -> Dict[str, str]:
        """This process's environment with the test's ssh first on PATH, updated by ``extra`` (None: unset)."""
        path = f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        merged: Dict[str, Optional[str]] = {**os.environ, "PATH": path, **(extra or {})}
        return {key: value for key, value in merged.items() if value is not None}

    def run(self, host: Host, argv: Sequence[str], timeout: float, env: Optional[Dict[str, Optional[str]]] = None,
            cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``host``'s namespace; on timeout kill it and return exit code 124."""
        proc = subprocess.Popen(["ip", "netns", "exec", host.netns, *argv], env=self.env(env), cwd=cwd,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return subprocess.CompletedProcess(proc.args, 124, f"{out}\n[timed out after {timeout:.0f} s]", "")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")

    def sshd_log(self, worker: Host) -> str:
        return (self.workdir / f"sshd-{worker.name}.log").read_text(errors="replace")

    # -- tear-down ----------------------------------------------------------------------------
    def stop(self) -> None:
        """Remove every process, namespace and link this cluster made; safe to call twice."""
        for proc in self._sshd.values():
            if proc.poll() is None:
                proc.terminate()
        for host in self.hosts:
            if host.netns in namespaces():
                _kill_namespace_processes(host.netns)
                _ip("netns", "del", host.netns, check=False)
        for proc in self._sshd.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for log in self._logs:
            log.close()
        # A deleted namespace's veth pair goes away asynchronously; delete what is still there.
        ours = [self.bridge] + [host.veth for host in self.hosts]
        deadline = time.monotonic() + 10
        while True:
            present = [link for link in ours if link in links()]
            if not present or time.monotonic() > deadline:
                break
            for link in present:
                _ip("link", "del", link, check=False)
            time.sleep(0.2)

    def leftovers(self) -> List[str]:
        """What of this cluster still exists (empty after :meth:`stop`)."""
        names = set(namespaces()) | set(links())
        left = [n for n in [self.bridge, *(h.netns for h in self.hosts), *(h.veth for h in self.hosts)] if n in names]
        left += [f"sshd pid {p.pid}" for p in self._sshd.values() if p.poll() is None]
        return left

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
