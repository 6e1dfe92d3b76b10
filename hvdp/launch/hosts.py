"""Where a job's hosts come from: ``-H``, a hostfile, a Slurm allocation, or a discovery script.

Every source has the same interface (:class:`HostSource`): whether it applies to this
command line and environment, and the hosts and slots it gives. :func:`resolve_hosts`
asks them in order; an elastic job's hosts come from its discovery script while it runs.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
from pathlib import Path
from typing import List, Mapping, Optional, Protocol, Sequence, Set, Tuple

from hvdp.errors import LaunchError

#: Hosts and their slots, e.g. ``[("node1", 2), ("node2", 2)]``.
Hosts = List[Tuple[str, int]]

#: A host name or IPv4 address as horovodrun accepts it.
_HOST = re.compile(r"^[\w.-]+$")


def _host_slots(item: str) -> Optional[Tuple[str, int]]:
    """``HOST`` or ``HOST:SLOTS`` as (host, slots), a host without ``:SLOTS`` having one; None if malformed."""
    name, colon, slots = item.strip().partition(":")
    if not _HOST.match(name) or (colon and not slots.isdigit()):
        return None
    return name, int(slots) if colon else 1


def parse_hosts(hosts: str, origin: str = "-H") -> List[Tuple[str, int]]:
    """``host1:2,host2`` as ``[("host1", 2), ("host2", 1)]``: a host without ``:N`` has one slot.

    Example:
        >>> parse_hosts("node1:2,node2")
        [('node1', 2), ('node2', 1)]
    """
    parsed: List[Tuple[str, int]] = []
    for item in hosts.split(","):
        host = _host_slots(item)
        if host is None:
            raise LaunchError(f"hvdp run: {origin} {hosts!r}: {item.strip()!r} is not HOST or HOST:SLOTS; "
                              f"write e.g. -H host1:2,host2:2.")
        name, count = host
        if count < 1:
            raise LaunchError(f"hvdp run: {origin} {hosts!r}: {name} has {count} slots; give it at least 1.")
        if any(name == seen for seen, _ in parsed):
            raise LaunchError(f"hvdp run: {origin} {hosts!r} names {name} twice; give it once with the "
                              f"sum of its slots.")
        parsed.append((name, count))
    return parsed


def parse_hostfile(text: str, path: str = "hostfile") -> List[Tuple[str, int]]:
    """The hosts of a hostfile: ``host slots=N``, ``host:N`` or ``host`` per line, ``#`` comments.

    This is the format of Open MPI, horovodrun and the Kubeflow MPI Operator's ``/etc/mpi/hostfile``.

    Example:
        >>> parse_hostfile("# two nodes\\nnode1 slots=2\\nnode2:1\\n")
        [('node1', 2), ('node2', 1)]
    """
    items: List[str] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([\w.-]+)(?:\s+slots\s*=\s*(\d+)|:(\d+))?(?:\s+max[-_]slots\s*=\s*\d+)?", line)
        if not match:
            raise LaunchError(f"hvdp run: {path} line {number}: {raw.strip()!r} is not 'host slots=N' "
                              f"(or 'host:N', or 'host').")
        items.append(f"{match.group(1)}:{match.group(2) or match.group(3) or 1}")
    if not items:
        raise LaunchError(f"hvdp run: {path} lists no hosts; write one 'host slots=N' per line.")
    return parse_hosts(",".join(items), origin=f"hostfile {path}:")


def expand_nodelist(nodelist: str) -> List[str]:
    """Expand a Slurm host list (``SLURM_JOB_NODELIST``) into host names, in order.

    Ranges keep the zero padding of their first number; several bracket groups
    in one name expand to every combination.

    Example:
        >>> expand_nodelist("node[01-03,07],gpu5")
        ['node01', 'node02', 'node03', 'node07', 'gpu5']
    """
    items: List[str] = []
    depth, current = 0, ""
    for char in nodelist.strip():
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            break
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    if depth != 0 or not all(items):
        raise LaunchError(f"hvdp run: SLURM_JOB_NODELIST {nodelist!r} is not a Slurm host list "
                          f"(e.g. node[01-03,07],gpu5). Give the hosts with -H instead.")
    return [host for item in items for host in _expand_host(item, nodelist)]


def _expand_host(item: str, nodelist: str) -> List[str]:
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        if not _HOST.match(item):
            raise LaunchError(f"hvdp run: SLURM_JOB_NODELIST {nodelist!r}: {item!r} is not a host name.")
        return [item]
    values: List[str] = []
    for part in match.group(1).split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise LaunchError(f"hvdp run: SLURM_JOB_NODELIST {nodelist!r}: [{match.group(1)}] is not a list "
                              f"of numbers and ranges like [01-03,07].")
        values += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)] if dash else [low]
    head, tail = item[:match.start()], item[match.end():]
    return [host for value in values for host in _expand_host(head + value + tail, nodelist)]


def expand_tasks_per_node(spec: str) -> List[int]:
    """Expand ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) into one task count per node.

    Example:
        >>> expand_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    counts: List[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
            raise LaunchError(f"hvdp run: SLURM_TASKS_PER_NODE {spec!r} is not a Slurm task count list "
                              f"(e.g. 2(x3),1). Give the hosts with -H instead.")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_hosts(environ: Mapping[str, str]) -> Optional[List[Tuple[str, int]]]:
    """The nodes and tasks per node of the Slurm allocation ``environ`` is in, or None outside one.

    Example:
        >>> slurm_hosts({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"})
        [('n1', 2), ('n2', 2)]
    """
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not environ.get("SLURM_JOB_ID") or not nodelist:
        return None
    nodes = expand_nodelist(nodelist)
    tasks = environ.get("SLURM_TASKS_PER_NODE")
    if not tasks:
        raise LaunchError(f"hvdp run: inside Slurm job {environ['SLURM_JOB_ID']} but SLURM_TASKS_PER_NODE is "
                          f"not set; ask Slurm for tasks (#SBATCH --ntasks-per-node=N) or give -H.")
    counts = expand_tasks_per_node(tasks)
    if len(counts) != len(nodes):
        raise LaunchError(f"hvdp run: SLURM_JOB_NODELIST {nodelist!r} has {len(nodes)} nodes but "
                          f"SLURM_TASKS_PER_NODE {tasks!r} gives {len(counts)} counts; give the hosts with -H.")
    return list(zip(nodes, counts))


def discovery_script_path(path: str) -> Path:
    """The absolute path of the host discovery script; LaunchError if it is missing or not executable.

    Example:
        >>> discovery_script_path("/bin/true").name
        'true'
    """
    script = Path(path).expanduser()
    if not script.is_file():
        raise LaunchError(f"hvdp run: --host-discovery-script {path!r} not found (working directory "
                          f"{os.getcwd()}). Give the path of an executable that prints one HOST:SLOTS per line.")
    if not os.access(script, os.X_OK):
        raise LaunchError(f"hvdp run: --host-discovery-script {path!r} is not executable; Horovod runs it "
                          f"directly. Fix: chmod +x {path} (and start it with a #! line, e.g. #!/bin/sh).")
    return script.absolute()


def check_discovery_script(path: str, timeout_s: float = 30.0) -> List[Tuple[str, int]]:
    """Run the host discovery script once and check what it prints: ``HOST`` or ``HOST:SLOTS`` per line.

    A line without slots counts as 1 slot here (``--slots-per-host`` changes that in the job).

    Returns:
        The hosts and slots the script lists now.

    Raises:
        LaunchError: the script is missing, not executable, fails, hangs, or prints a line
            that is not ``HOST`` or ``HOST:SLOTS``; the message names the script and the line.

    Example:
        >>> check_discovery_script("./discover_hosts.sh")  # doctest: +SKIP
        [('localhost', 2)]
    """
    import subprocess

    script = discovery_script_path(path)
    # Through the shell, as Horovod runs it; in its own process group, so a hung script ends with its children.
    with subprocess.Popen(shlex.quote(str(script)), shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, errors="replace", start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise LaunchError(f"hvdp run: --host-discovery-script {path!r} did not finish in {timeout_s:g} s; "
                              f"Horovod runs it every second, so it must print the hosts and exit quickly.") from None
    if process.returncode != 0:
        detail = stderr.strip().splitlines()[-1] if stderr.strip() else "no error output"
        raise LaunchError(f"hvdp run: --host-discovery-script {path!r} exited with status {process.returncode} "
                          f"({detail}); it must exit 0 after printing one HOST:SLOTS per line.")
    found: List[Tuple[str, int]] = []
    for number, raw in enumerate(stdout.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        host = _host_slots(line)
        if host is None:
            raise LaunchError(f"hvdp run: --host-discovery-script {path!r} printed {raw!r} on line {number}, "
                              f"which is not HOST or HOST:SLOTS (e.g. node1:2). Make it print only host lines "
                              f"(send anything else to stderr).")
        found.append(host)
    return found



# ---------------------------------------------------------------- host sources


class HostSource(Protocol):
    """A place hosts come from: whether it applies, and the hosts and slots it gives now."""

    #: How messages name the source (``-H``, ``--hostfile``, ``the Slurm allocation``).
    origin: str

    def applies(self, environ: Mapping[str, str]) -> bool:
        """Whether this source gives the job's hosts."""

    def hosts(self, environ: Mapping[str, str]) -> Hosts:
        """The hosts and slots (LaunchError when the source is malformed)."""


class HostsFlag:
    """``-H host1:2,host2:2``."""

    origin = "-H"

    def __init__(self, spec: Optional[str]) -> None:
        self.spec = spec

    def applies(self, environ: Mapping[str, str]) -> bool:
        return bool(self.spec)

    def hosts(self, environ: Mapping[str, str]) -> Hosts:
        return parse_hosts(self.spec or "")


class Hostfile:
    """``--hostfile FILE``: ``host slots=N`` per line."""

    origin = "--hostfile"

    def __init__(self, path: Optional[str]) -> None:
        self.path = path

    def applies(self, environ: Mapping[str, str]) -> bool:
        return bool(self.path)

    def hosts(self, environ: Mapping[str, str]) -> Hosts:
        path = Path(self.path or "").expanduser()
        if not path.is_file():
            raise LaunchError(f"hvdp run: --hostfile {self.path!r} not found (working directory {os.getcwd()}).")
        return parse_hostfile(path.read_text(), self.path or "")


class SlurmAllocation:
    """The nodes and tasks per node of the Slurm allocation hvdp run is in."""

    origin = "the Slurm allocation"

    def applies(self, environ: Mapping[str, str]) -> bool:
        return bool(environ.get("SLURM_JOB_ID") and (environ.get("SLURM_JOB_NODELIST") or
                                                      environ.get("SLURM_NODELIST")))

    def hosts(self, environ: Mapping[str, str]) -> Hosts:
        return slurm_hosts(environ) or []


class DiscoveryScript:
    """``--host-discovery-script FILE`` (elastic jobs): the hosts it lists now."""

    origin = "--host-discovery-script"

    def __init__(self, path: Optional[str], timeout_s: float = 30.0) -> None:
        self.path = path
        self.timeout_s = timeout_s

    def applies(self, environ: Mapping[str, str]) -> bool:
        return bool(self.path)

    def hosts(self, environ: Mapping[str, str]) -> Hosts:
        return check_discovery_script(self.path or "", self.timeout_s)


def host_sources(hosts: Optional[str], hostfile: Optional[str],
                 discovery_script: Optional[str]) -> List[HostSource]:
    """The sources of a command line, in the order they are asked. An elastic job has only its script.

    Example:
        >>> [source.origin for source in host_sources("n1:2", None, None)]
        ['-H', '--hostfile', 'the Slurm allocation']
    """
    if discovery_script:
        return [DiscoveryScript(discovery_script)]
    return [HostsFlag(hosts), Hostfile(hostfile), SlurmAllocation()]


def find_hosts(sources: Sequence[HostSource], environ: Mapping[str, str]) -> Tuple[Optional[Hosts], str]:
    """The hosts of the first source that applies, and its origin; (None, "") when none does (a local job).

    An elastic job's hosts change while it runs, so its discovery script is not asked here.
    """
    for source in sources:
        if isinstance(source, DiscoveryScript):
            return None, ""
        if source.applies(environ):
            return source.hosts(environ), source.origin
    return None, ""


def hosts_line(found: Sequence[Tuple[str, int]]) -> str:
    """``localhost:1, 127.0.0.1:1`` for the hosts and slots of a discovery script."""
    return ", ".join(f"{host}:{slots}" for host, slots in found)


def local_addresses() -> Set[str]:
    """Names and addresses that mean this machine."""
    import socket

    import psutil  # type: ignore[import-untyped]

    names = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
    try:
        for addresses in psutil.net_if_addrs().values():
            names.update(address.address for address in addresses)
    except Exception:  # best effort
        pass
    return names
