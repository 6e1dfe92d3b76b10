"""A real two-node Slurm cluster on this machine, on the network namespaces of netns.py.

    submit host  10.77.2.1   slurmctld, munged; sbatch, squeue, scancel run here
    node n1      10.77.2.2   slurmd -N n1, sshd on port 2222
    node n2      10.77.2.3   slurmd -N n2, sshd on port 2222

Slurm 22.05 from Debian (``slurm-wlm``, ``munge``). Everything it writes (slurm.conf, the munge
key and socket, state, spool, logs) is under the cluster's work directory; clients find the
cluster through ``SLURM_CONF``. Nothing is written to /etc and nothing is mounted outside the
processes' own mount namespaces:

* munged runs in the submit host's namespace; its socket is a file, so every namespace reaches it
  (slurm.conf's ``AuthInfo=socket=...``).
* each slurmd runs in its node's network namespace (``nsenter --net``) but keeps this machine's
  /sys, whose cgroup tree slurmd needs (``ip netns exec`` would mount a /sys without it), and in
  a private mount namespace (``unshare --mount``) whose /etc/hosts also names the nodes, so that
  a job's ``hvdp run`` resolves n1 and n2 as the hosts of ``SLURM_JOB_NODELIST``.

Tear-down ends every process in the namespaces (daemons, job steps, ranks started over ssh) and
removes the namespaces, as netns.py does; a killed run's leftovers are removed by the next one.

As a script, it starts the cluster, runs a command on the submit host (default: a shell) and
tears the cluster down when the command ends::

    .venv/bin/python tests/cluster/slurm.py                      # a shell; try sinfo, sbatch
    .venv/bin/python tests/cluster/slurm.py -- sinfo -N
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Dict, List, Optional, Sequence, Set

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns import SSH_PORT, Cluster, Host

SUBNET = "10.77.2"
TAG = "s"
TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "scontrol", "sinfo",
           "nsenter", "unshare")
#: Seconds slurmd waits between SIGTERM and SIGKILL when a job is cancelled or runs out of time.
KILL_WAIT_S = 10


class SlurmCluster:
    """slurmctld on a submit host and one slurmd per node, each node a network namespace with sshd."""

    def __init__(self, workdir: Path, nodes: int = 2, tag: str = TAG, subnet: str = SUBNET) -> None:
        if not 1 <= nodes <= 9:
            raise ValueError(f"nodes={nodes!r}: a test cluster has 1 to 9 nodes")
        self.workdir = workdir
        self.net = Cluster(workdir, workers=nodes, tag=tag, subnet=subnet)
        self.name = f"hvdp{os.getpid()}{tag}"  # ClusterName: new state for every cluster
        self.conf = workdir / "slurm.conf"
        self.hosts_file = workdir / "hosts"
        self.munge_dir = workdir / "munge"
        self.state = workdir / "state"
        self.tools: Dict[str, str] = {}
        self._daemons: Dict[str, subprocess.Popen] = {}
        self._logs: List[IO[str]] = []

    @property
    def submit(self) -> Host:
        return self.net.launcher

    @property
    def nodes(self) -> Dict[str, Host]:
        """Node name (n1, n2, ...) -> its host."""
        return {f"n{i}": host for i, host in enumerate(self.net.workers, 1)}

    @property
    def key(self) -> Path:
        """The private key that reaches every node's sshd (on port :data:`netns.SSH_PORT`)."""
        return self.net.key

    # -- set-up -------------------------------------------------------------------------------
    def start(self) -> "SlurmCluster":
        search = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin:/usr/bin:/bin"
        self.tools = {tool: shutil.which(tool, path=search) or "" for tool in TOOLS}
        missing = [tool for tool, path in self.tools.items() if not path]
        if missing:
            raise RuntimeError(f"the Slurm test needs {', '.join(missing)}: run scripts/setup.sh "
                               f"(apt-get install -y slurm-wlm munge util-linux)")
        self.net.start()  # checks root, ip, sshd; removes leftovers of killed runs
        try:
            self._files()
            self._start_munged()
            self._start("slurmctld", self.submit,
                        ["ip", "netns", "exec", self.submit.netns, self.tools["slurmctld"], "-D", "-f", str(self.conf)])
            for name, host in self.nodes.items():
                # Own network, this machine's /sys (cgroups), a private /etc/hosts naming the nodes.
                self._start(f"slurmd-{name}", host, [
                    self.tools["nsenter"], f"--net=/run/netns/{host.netns}",
                    self.tools["unshare"], "--mount", "--propagation", "private",
                    "sh", "-c", 'mount --bind "$1" /etc/hosts && shift && exec "$@"', "sh", str(self.hosts_file),
                    self.tools["slurmd"], "-D", "-f", str(self.conf), "-N", name])
            self._wait_until_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def _files(self) -> None:
        nodes = self.nodes
        self.hosts_file.write_text(Path("/etc/hosts").read_text() + "\n# hvdp test Slurm nodes\n"
                                   + "".join(f"{h.address} {n}\n" for n, h in nodes.items()))
        for directory in (self.munge_dir, self.state, *(self.workdir / "spool" / n for n in nodes)):
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        node_lines = "".join(f"NodeName={n} NodeAddr={h.address} CPUs=1 State=UNKNOWN\n" for n, h in nodes.items())
        w = self.workdir
        self.conf.write_text(f"""\
# A test cluster of tests/cluster/slurm.py; everything it writes is under {w}.
ClusterName={self.name}
SlurmctldHost={socket.gethostname().split('.')[0]}({self.submit.address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_dir / 'munge.socket'}
StateSaveLocation={self.state}
SlurmdSpoolDir={w / 'spool'}/%n
SlurmctldPidFile={w / 'slurmctld.pid'}
SlurmdPidFile={w / 'slurmd-%n.pid'}
SlurmctldLogFile={w / 'slurmctld.log'}
SlurmdLogFile={w / 'slurmd-%n.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
ReturnToService=2
KillWait={KILL_WAIT_S}
MinJobAge=3600
{node_lines}PartitionName=test Nodes={','.join(nodes)} Default=YES MaxTime=60 State=UP
""")

    def _start_munged(self) -> None:
        key = self.munge_dir / "munge.key"
        subprocess.run([self.tools["mungekey"], "--create", f"--keyfile={key}"], check=True, capture_output=True,
                       timeout=30)
        self._start("munged", self.submit, [
            "ip", "netns", "exec", self.submit.netns, self.tools["munged"], "--foreground", "--force",
            f"--socket={self.munge_dir / 'munge.socket'}", f"--key-file={key}",
            f"--pid-file={self.munge_dir / 'munged.pid'}", f"--seed-file={self.munge_dir / 'munged.seed'}",
            f"--log-file={self.munge_dir / 'munged.log'}"])
        deadline = time.monotonic() + 20
        while not (self.munge_dir / "munge.socket").exists():
            if time.monotonic() > deadline or self._daemons["munged"].poll() is not None:
                raise RuntimeError(f"munged did not start:\n{self.log('munged')}")
            time.sleep(0.1)

    def _start(self, name: str, host: Host, argv: Sequence[str]) -> None:
        log = (self.workdir / f"{name}.out").open("w")
        self._logs.append(log)
        self._daemons[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _wait_until_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if states and all(state == "idle" for state in states.values()) and set(states) == set(self.nodes):
                return
            dead = [name for name, proc in self._daemons.items() if proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm nodes are not idle ({states}); exited: {dead}\n"
                                   + "\n".join(f"== {n}\n{self.log(n)[-3000:]}" for n in self._daemons))
            time.sleep(0.5)

    # -- use ----------------------------------------------------------------------------------
    def env(self, extra: Optional[Dict[str, Optional[str]]] = None) -> Dict[str, Optional[str]]:
        """What a submitting user's environment adds: the cluster's SLURM_CONF, then ``extra``."""
        return {"SLURM_CONF": str(self.conf), **(extra or {})}

    def run(self, argv: Sequence[str], timeout: float = 60, env: Optional[Dict[str, Optional[str]]] = None,
            cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
        """Run ``argv`` (sbatch, squeue, ...) on the submit host, with the test's ssh first on PATH."""
        return self.net.run(self.submit, argv, timeout=timeout, env=self.env(env), cwd=cwd)

    def slurm(self, *argv: str) -> str:
        """A Slurm command's output; raises if it fails."""
        out = self.run(argv, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {out.returncode}: {out.stdout}")
        return out.stdout

    def node_states(self) -> Dict[str, str]:
        out = self.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], timeout=30)
        if out.returncode != 0:
            return {}
        return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)

    def job(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, NodeList, StdOut, ...)."""
        fields = {}
        for item in self.slurm("scontrol", "--oneliner", "show", "job", job_id).split():
            key, _, value = item.partition("=")
            fields[key] = value
        return fields

    def wait(self, job_id: str, states: Sequence[str], timeout: float) -> Dict[str, str]:
        """The job's fields once its state is one of ``states``; raises after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is {fields.get('JobState')} after {timeout:.0f} s, "
                                   f"not one of {', '.join(states)}")
            time.sleep(0.5)

    def processes(self, name: str) -> Dict[int, str]:
        """pid -> command line of every process in node ``name``'s network namespace."""
        found = {}
        pids = subprocess.run(["ip", "netns", "pids", self.nodes[name].netns], capture_output=True, text=True,
                              timeout=30).stdout.split()
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue  # ended meanwhile
            found[int(pid)] = cmdline.strip()
        return found

    def daemon_pids(self) -> Set[int]:
        """Process ids of the cluster's own daemons: munged, slurmctld, every slurmd and sshd."""
        return {proc.pid for proc in self._daemons.values()} | set(self.net.sshd_pids.values())

    def log(self, name: str) -> str:
        """A daemon's output (munged, slurmctld, slurmd-n1, ...), with its log file when it has one."""
        texts = []
        for path in (self.workdir / f"{name}.out", self.workdir / f"{name}.log", self.munge_dir / f"{name}.log"):
            if path.exists():
                texts.append(path.read_text(errors="replace"))
        return "\n".join(texts)

    # -- tear-down ----------------------------------------------------------------------------
    def stop(self) -> None:
        """End every daemon, job and rank, and remove the namespaces; safe to call twice."""
        for proc in self._daemons.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self._daemons.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.net.stop()  # whatever is still in the namespaces (job steps, ranks, sshd), then them
        for log in self._logs:
            log.close()

    def leftovers(self) -> List[str]:
        """What of this cluster still exists (empty after :meth:`stop`)."""
        return self.net.leftovers() + [f"{n} pid {p.pid}" for n, p in self._daemons.items() if p.poll() is None]

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description="Start a two-node Slurm cluster in network namespaces (root), run COMMAND on its submit "
                    "host with SLURM_CONF set (default: an interactive shell), then tear it all down.")
    parser.add_argument("--workdir", type=Path, help="where its files go (default: a new temporary directory)")
    parser.add_argument("command", nargs="*", help="command to run on the submit host (after --)")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hvdp-slurm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    with SlurmCluster(workdir.resolve()) as cluster:
        nodes = ", ".join(f"{n} {h.address}" for n, h in cluster.nodes.items())
        print(f"slurm.py: cluster {cluster.name} up (nodes {nodes}, one CPU each), SLURM_CONF={cluster.conf}; "
              f"from the repository root, try:\n  sbatch --cpus-per-task=1 docker/slurm/hvdp.sbatch "
              f"-p {SSH_PORT} -i {cluster.key} --network-interface eth0", file=sys.stderr)
        command = args.command or [os.environ.get("SHELL", "/bin/bash")]
        env = cluster.net.env(cluster.env())
        code = subprocess.call(["ip", "netns", "exec", cluster.submit.netns, *command], env=env)
    print(f"slurm.py: cluster {cluster.name} removed; left: {cluster.leftovers() or 'nothing'}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
