"""Reading a job's text: why ranks failed, and Open MPI's tagged pieces put back into lines.

Failures travel as records (:mod:`hvdp.failures`, :mod:`hvdp.launch.relay`); :class:`JobWatcher`
matches Horovod's and Open MPI's text only where no record can exist: a rank ended by a signal
with nothing of hvdp around it, a stall (Horovod's stall inspector), a script that never
called ``hvdp.init()``. Each pattern is tested against the text Horovod prints.
"""

from __future__ import annotations

import re
import signal
from typing import Dict, List, Optional, Tuple

from hvdp.failures import Failure

_GLOO_EXIT = re.compile(r"^Process (\d+) exit with status code (-?\d+)\.")
_MPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
_MPI_STATUS = re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]")
_MPI_CODE = re.compile(r"Exit code:\s+(\d+)")
_RAISED = re.compile(r"^\[(?:\d+,)?(\d+)\]<stderr>:([\w.]*(?:Error|Exception|Interrupt)): (.*)$")
#: A rank of a stall report's "Missing ranks:" list and its tensors; "!" marks one stalled past the limit.
_MISSING = re.compile(r"(?:^|<std(?:out|err)>:|\] )(\d+)(!?): \[(.*?)\]", re.MULTILINE)
#: A Keras optimizer's gradient list (hvdp.gradients.N, grouped by Horovod as _KofM).
_KERAS_LIST = re.compile(r"hvdp\.gradients(?:\.\d+)?(?:\.g\d+)?_\d+of(\d+)")
#: A gradient's collective: a Keras optimizer's list (TensorFlow, torch) or a torch parameter's allreduce.
_GRADIENT = re.compile(r"(?:grouped_allreduce\.)?hvdp\.gradients|allreduce\.")


def describe_exit(code: int) -> str:
    """``exited with status 3`` or ``was killed by SIGKILL`` for a process exit code.

    Example:
        >>> describe_exit(-9)
        'was killed by SIGKILL'
    """
    if code < 0 or 128 < code <= 128 + 64:  # -N from Python, 128+N from a shell; 255 is ssh's own failure
        number = -code if code < 0 else code - 128
        try:
            return f"was killed by {signal.Signals(number).name}"
        except ValueError:
            return f"was killed by signal {number}"
    return f"exited with status {code}"


#: Exit codes of a rank stopped by its launcher (SIGTERM, SIGINT): a consequence, not a cause.
_STOPPED = (-15, -2, 143, 130)


#: What leaves a rank waiting in a collective the others never make, in the order they are met in practice.
STALL_CAUSES = ("Likely causes: (1) a rank left its training loop early (its data ran out first, a break or "
                "a condition on its rank); (2) a collective called on some ranks only, or in another order (an "
                "evaluation or a metric on rank 0 alone, a name that differs); (3) a rank blocked outside hvdp "
                "(reading input, a lock, a debugger).")


class JobWatcher:
    """Remembers which ranks failed and why: from their records, else from the job's text.

    Records (:meth:`failure`, :meth:`exit`) come from the ranks themselves through
    :mod:`hvdp.launch.relay`; :meth:`feed` reads horovodrun's and the ranks' lines for what
    no record says (a stall, a rank with nothing of hvdp around it).
    """

    def __init__(self) -> None:
        self.failed: Dict[int, str] = {}
        self.stalled: Dict[int, str] = {}
        self.missing: Dict[int, str] = {}
        self.raised: Dict[int, str] = {}
        self.records: List[Failure] = []
        self.exits: List[Tuple[float, int, int]] = []
        self.losses: List[Tuple[float, int, str]] = []
        self.silences: List[Tuple[float, int, str, float]] = []
        self._mpi_rank: Optional[int] = None

    def failure(self, failure: Failure) -> None:
        """A rank's failure record (an exception it did not catch)."""
        self.records.append(failure)
        if not failure.consequence:
            self.raised[failure.rank] = f"{failure.type}: {failure.message}"

    def exit(self, rank: int, code: int, when: float) -> None:
        """A rank's process ended with ``code`` (negative: killed by that signal) at ``when``."""
        self.exits.append((when, rank, code))

    def lost(self, rank: int, host: str, when: float) -> None:
        """A rank's connection to ``hvdp run`` closed at ``when`` with no exit status: it was killed with its
        bootstrap, or its host or container went away."""
        self.losses.append((when, rank, host))

    def silent(self, rank: int, host: str, last: float, seconds: float) -> None:
        """A running rank sent nothing (not even its heartbeat) after ``last``, for ``seconds``: its host
        or container is paused, or cut off from the network."""
        self.silences.append((last, rank, host, seconds))

    def cause(self, before: Optional[float] = None) -> Optional[Tuple[int, str, Optional[Failure]]]:
        """The first failure of the job by its records: (rank, what happened, its record); None if none
        (with ``before``: none of those that happened before that time).

        An exception that only says another rank failed first (Horovod shut down), a rank
        its launcher stopped, and the exit of a rank whose exception was recorded are not causes.
        """
        recorded = {failure.rank for failure in self.records}
        events: List[Tuple[float, int, str, Optional[Failure]]] = [
            (f.time, f.rank, f.describe(), f) for f in self.records if not f.consequence]
        for when, rank, code in self.exits:
            if code != 0 and code not in _STOPPED and rank not in recorded:
                # No record (a script without hvdp.init()): the exception its traceback named, if any.
                why = f"raised {self.raised[rank]}" if rank in self.raised else describe_exit(code)
                events.append((when, rank, why, None))
        for when, rank, host in self.losses:
            if rank not in recorded:
                events.append((when, rank, f"{_on(host)}was lost: its processes ended without an exit status "
                                           "(killed, or its host or container went away)", None))
        for last, rank, host, seconds in self.silences:
            events.append((last, rank, f"{_on(host)}went silent: nothing from it, not even its heartbeat, for "
                                       f"{seconds:.0f} s (its host or container paused, or cut off from the "
                                       "network)", None))
        if before is not None:
            events = [event for event in events if event[0] < before]
        if not events:
            return None
        _, rank, why, failure = min(events, key=lambda event: event[0])
        return rank, why, failure

    def feed(self, line: str) -> None:
        """Look at one line of the job's output."""
        found = _GLOO_EXIT.search(line)
        if found and found.group(2) not in ("0", "143", "-15"):  # SIGTERM: stopped by the launcher
            self.failed.setdefault(int(found.group(1)), describe_exit(int(found.group(2))))
        found = _MPI_SIGNAL.search(line)
        if found:
            self.failed.setdefault(int(found.group(1)), describe_exit(-int(found.group(2))))
        found = _MPI_STATUS.search(line)
        if found:
            self._mpi_rank = int(found.group(1))
        found = _MPI_CODE.search(line)
        if found and self._mpi_rank is not None:
            self.failed.setdefault(self._mpi_rank, describe_exit(int(found.group(1))))
            self._mpi_rank = None
        for rank, past_limit, tensors in _MISSING.findall(line):
            self.missing[int(rank)] = tensors
            if past_limit:
                self.stalled[int(rank)] = tensors
        found = _RAISED.search(line.rstrip("\n"))
        if found and "Horovod has been shut down" not in found.group(3):  # a consequence, not a cause
            self.raised[int(found.group(1))] = f"{found.group(2).rsplit('.', 1)[-1]}: {found.group(3)}"

    def summary(self, returncode: int) -> str:
        """One line for the user: which ranks failed or stalled, and that the job was ended."""
        gone = {rank for _, rank, _, _ in self.silences} | {rank for _, rank, _ in self.losses}
        if self.stalled and not set(self.stalled) <= gone:  # a rank that went silent or was lost: that is why
            ranks = "; ".join(f"rank {r} never submitted {t}" for r, t in sorted(self.stalled.items()))
            return (f"hvdp: the job was ended: {ranks} (stalled longer than --stall-timeout). "
                    + (models_differ(self.missing) or
                       "Every rank must make the same collective calls in the same order. " + STALL_CAUSES))
        first = self.cause()
        if first is not None:
            rank, why, _ = first
            return f"hvdp: the job failed: rank {rank} {why}. The other ranks were stopped (exit code {returncode})."
        causes = {r: f"raised {why}" for r, why in self.raised.items()}
        for r, why in self.failed.items():
            causes.setdefault(r, why)
        if self.raised:  # ranks that exited only because another one failed are not causes
            causes = {r: why for r, why in causes.items() if r in self.raised or "killed" in why}
        if causes:
            ranks = "; ".join(f"rank {r} {why}" for r, why in sorted(causes.items()))
            return f"hvdp: the job failed: {ranks}. The other ranks were stopped (exit code {returncode})."
        return f"hvdp: the job failed with exit code {returncode}; see the output above."


def models_differ(missing: Dict[int, str]) -> Optional[str]:
    """Why, when each of two ranks waits for gradients only the other submitted: their models differ.

    (One rank alone missing names is a rank that is slow or stuck elsewhere: nothing is said.)

    Example:
        >>> models_differ({0: "hvdp.gradients.0.g0_1of5, hvdp.gradients.0.g0_2of5", 1: "hvdp.gradients.0.g0_1of4"})[:60]
        'The ranks reduce different gradients, so their models differ'
    """
    gradients = {rank: [n.strip() for n in names.split(",") if _GRADIENT.match(n.strip())]
                 for rank, names in missing.items()}
    gradients = {rank: names for rank, names in gradients.items() if names}
    if len(gradients) < 2:
        return None
    lists = {rank: {int(m) for m in _KERAS_LIST.findall(", ".join(names))} for rank, names in gradients.items()}
    every = set().union(*lists.values())
    shown = []
    for rank, names in sorted(gradients.items()):
        own = sorted(every - lists[rank])  # a Keras optimizer's list: the lengths only the others wait for
        shown.append(f"rank {rank} reduces {' or '.join(map(str, own))} gradients" if lists[rank] and own else
                     f"rank {rank} has no " + ", ".join(n.removeprefix("allreduce.") for n in names[:3]) +
                     (" ..." if len(names) > 3 else ""))
    return ("The ranks reduce different gradients, so their models differ: " + "; ".join(shown) +
            ". A layer or parameter exists, or is trainable, on some ranks only (built on one rank, frozen "
            "on one rank, a different architecture). Build the same model on every rank; "
            "hvdp.check_consistency(model) names the ranks that differ.")


def _on(host: str) -> str:
    return f"on {host} " if host else ""


_TAG = re.compile(r"\[\d+,\d+\]<std(?:out|err)>:")


class TagJoiner:
    """Puts back together the lines of ranks under Open MPI's ``--tag-output``.

    Open MPI tags every piece a rank writes, not every line: a rank writing unbuffered
    (``PYTHONUNBUFFERED=1``) prints a traceback's ``~~~^^^`` markers one write at a time,
    which reaches the terminal as ``[1,1]<stderr>:~[1,1]<stderr>:^...``, and pieces of
    several ranks can share one line. The joiner keeps each rank's pieces until that
    rank's newline and gives back whole lines, each with its tag once.

    Example:
        >>> TagJoiner().feed("[1,1]<stderr>: [1,1]<stderr>:~[1,0]<stdout>:ok\\n")
        ['[1,0]<stdout>:ok\\n']
    """

    def __init__(self) -> None:
        self._pending: Dict[str, str] = {}

    def feed(self, line: str) -> List[str]:
        """One line of mpirun's output; the whole lines it completes, in order."""
        tags = list(_TAG.finditer(line))
        if not tags:
            return [line]
        out: List[str] = []
        if tags[0].start() > 0:  # mpirun's own text before the first tag
            out.append(line[:tags[0].start()] + "\n")
        for index, tag in enumerate(tags):
            end = tags[index + 1].start() if index + 1 < len(tags) else len(line)
            piece = line[tag.end():end]
            if piece.endswith("\n"):
                out.append(tag.group(0) + self._pending.pop(tag.group(0), "") + piece)
            else:
                self._pending[tag.group(0)] = self._pending.get(tag.group(0), "") + piece
        return out

    def flush(self) -> List[str]:
        """What is left when the output ends: each rank's unfinished line."""
        left = [tag + text + "\n" for tag, text in self._pending.items()]
        self._pending.clear()
        return left
