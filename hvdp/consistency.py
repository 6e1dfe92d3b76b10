"""``hvdp.check_consistency``: do all replicas hold exactly the same trainable parameters?

Each rank digests every parameter; the digests (not the tensors) are gathered, and
each rank that differs from the first member is named with its first differing
parameters. Framework-neutral: the backend lists the parameters and gathers.

The drift guard (:class:`DriftGuard`) runs the same check by itself: after the first
step of every :func:`hvdp.DistributedOptimizer` and every ``HVDP_CHECK_EVERY`` steps
after it (100 unless set; 0 turns it off), so replicas that part for any reason stop
the job with the step, the ranks, the first differing parameter and the likely causes.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from hvdp._state import job
from hvdp.errors import ReplicaMismatchError

Digest = Tuple[str, List[int], str]


def digests(parameters: List[Tuple[str, np.ndarray]]) -> List[Digest]:
    """(name, shape, digest of the exact bits) of each parameter.

    Example:
        >>> digests([("w", np.zeros(2, dtype=np.float32))])[0][:2]
        ('w', [2])
    """
    return [(name, list(array.shape), hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=16)
             .hexdigest()) for name, array in parameters]


def _shapes(theirs: List[Digest]) -> List[List[int]]:
    return [shape for _, shape, _ in theirs]


def problems(everyone: List[List[Digest]], ranks: List[int]) -> List[str]:
    """One line for each rank whose digests differ from the first rank's (none when all agree).

    Example:
        >>> problems([[("w", [2], "a")], [("w", [2], "b")]], [0, 1])
        ['rank 1 (1 of 1 parameters differ, e.g. w)']
    """
    reference = everyone[0]
    found = []
    for rank, theirs in zip(ranks, everyone):
        if [(s, d) for _, s, d in theirs] == [(s, d) for _, s, d in reference]:
            continue
        # By position and shape: Keras's automatic layer names may differ between processes.
        if _shapes(theirs) != _shapes(reference):
            found.append(f"rank {rank} has a different architecture ({len(theirs)} parameters vs "
                         f"{len(reference)} on rank {ranks[0]})")
            continue
        differing = [n for (_, _, d), (n, _, d0) in zip(theirs, reference) if d != d0]  # rank 0's names
        found.append(f"rank {rank} ({len(differing)} of {len(reference)} parameters differ, e.g. "
                     f"{', '.join(differing[:3])})")
    return found


def check(backend: Any, model: Any, handle: Any, ranks: List[int]) -> None:
    """Raise ReplicaMismatchError unless every rank in ``ranks`` holds the first one's parameters."""
    parameters = backend.named_parameters(model)
    everyone = backend.allgather_object(digests(parameters), handle)
    found = problems(everyone, ranks)
    if found:
        differing_ranks = [p.split(" ", 2)[1] for p in found]
        detail = how_far(lambda obj: backend.allgather_object(obj, handle), parameters, everyone, ranks)
        raise ReplicaMismatchError(
            f"Replicas differ from rank {ranks[0]} on rank(s) {', '.join(differing_ranks)}: {'; '.join(found)}."
            f"{detail} Start every replica with hvdp.broadcast_state(model, optimizer) and step with "
            "hvdp.DistributedOptimizer."
        )


#: Elements of the first differing parameter gathered to say how far the replicas are apart.
COMPARED_ELEMENTS = 1 << 20

#: Up to this many units in the last place, a difference is one of rounding, not of a missed update.
ROUNDING_ULPS = 64


def how_far(gather: Callable[[Any], List[Any]], parameters: List[Tuple[str, np.ndarray]],
            everyone: List[List[Digest]], ranks: List[int]) -> str:
    """How far the first parameter that differs is from the first rank's, on each rank (a collective).

    Every rank calls it with the same gathered ``everyone`` (so all take part, or none);
    ``gather`` returns None for a rank waiting in ``hvdp.join``. The first
    :data:`COMPARED_ELEMENTS` elements are compared; tells rounding-size differences
    (a computation whose result depends on the rank) from a missed or different update.
    """
    reference = everyone[0]
    if any(_shapes(theirs) != _shapes(reference) for theirs in everyone):
        return ""
    position = next((i for i in range(len(reference)) if any(t[i][2] != reference[i][2] for t in everyone)), None)
    if position is None:
        return ""
    name, array = parameters[position]
    values = [v for v in gather(np.ravel(array)[:COMPARED_ELEMENTS]) if v is not None]
    try:
        return _gaps(name, np.size(array), values, ranks)
    except Exception:  # the mismatch itself is the error to raise, whatever the detail does
        return ""


def _gaps(name: str, size: int, values: List[Any], ranks: List[int]) -> str:
    base = np.asarray(values[0])
    lines, worst = [], 0.0
    for rank, theirs in zip(ranks[1:], values[1:]):
        theirs = np.asarray(theirs)
        if theirs.shape != base.shape:
            continue
        if not np.issubdtype(base.dtype, np.floating):
            count = int(np.count_nonzero(theirs != base))
            lines.append(f"rank {rank}: {count} of {base.size} elements")
            continue
        gap = np.abs(theirs.astype(np.float64) - base.astype(np.float64))
        count = int(np.count_nonzero(gap > 0)) + int(np.count_nonzero(np.isnan(theirs) != np.isnan(base)))
        if count == 0:
            continue
        at = int(np.nanargmax(gap)) if np.any(np.isfinite(gap)) else 0
        ulps = float(gap[at] / np.spacing(np.abs(base[at]).astype(base.dtype)))
        worst = max(worst, ulps)
        lines.append(f"rank {rank}: {count} of {base.size} elements, by at most {gap[at]:.3g} "
                     f"({ulps:.0f} unit{'' if round(ulps) == 1 else 's'} in the last place of {float(base[at]):.6g})")
    if not lines:
        return ""
    shown = f" (of its first {base.size})" if size > base.size else ""
    kind = (" Differences of rounding size: the same update computed differently on some ranks "
            "(a kernel whose result depends on the thread count or the process, or a reduction that "
            "did not give every rank the same bits)." if worst <= ROUNDING_ULPS else "")
    return f" On {name}{shown}, against rank {ranks[0]}: {'; '.join(lines)}.{kind}"


#: Steps between two drift checks unless ``HVDP_CHECK_EVERY`` says otherwise.
DEFAULT_CHECK_EVERY = 100

#: What makes replicas part, and the fix of each, in the order they are met in practice.
LIKELY_CAUSES = (
    "replicas not started from one state: call hvdp.broadcast_state(model, optimizer) before the first step",
    "parameters changed outside the optimizer on some ranks only (a rank-dependent update or random draw)",
    "an optimizer that does not average: a Keras model loaded with keras.models.load_model gets a plain "
    "optimizer back, wrap it again with hvdp.DistributedOptimizer",
    "ranks that took different numbers of steps (uneven data): give every rank the same number of batches "
    "(hvdp.shard), or train inside hvdp.join(model, optimizer)",
)


def check_every(value: Optional[int]) -> int:
    """The drift guard's interval in steps: ``value``, else ``HVDP_CHECK_EVERY``, else 100 (0: off).

    Always 0 in an elastic job: its state is synced at every reset, and a worker added
    later counts its steps from 0 while the others are further on.

    Example:
        >>> check_every(10)
        10
    """
    source, shown = "check_every", repr(value)
    if value is None:
        raw = os.environ.get("HVDP_CHECK_EVERY")
        source, shown = "HVDP_CHECK_EVERY", repr(raw)
        try:
            value = DEFAULT_CHECK_EVERY if raw is None else int(raw)
        except ValueError:
            value = -1
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{source}={shown}: expected a whole number of steps >= 0 "
                         f"(0 turns the drift check off; default {DEFAULT_CHECK_EVERY}).")
    return 0 if os.environ.get("HOROVOD_ELASTIC") == "1" else value


class DriftGuard:
    """Compares every replica's parameters after step 1 and every ``every`` steps (a collective).

    ``gather`` is an ``allgather_object`` over the optimizer's ranks (None for a rank that
    waits in ``hvdp.join``); each rank calls :meth:`after_step` once per update, so all
    ranks check at the same steps.
    """

    def __init__(self, gather: Callable[[Any], List[Any]], ranks: List[int], every: int, whole_job: bool) -> None:
        self.gather, self.ranks, self.every, self.steps, self.whole_job = gather, ranks, every, 0, whole_job
        #: How to list the parameters of the last update (the check at the job's end uses it).
        self.latest: Optional[Callable[[], List[Tuple[str, np.ndarray]]]] = None
        if whole_job and every:  # the newest KEPT_AT_END, kept (with their models) for the check at the end
            state = job()
            state.guards = [*state.guards[1 - KEPT_AT_END:], self]

    def after_step(self, parameters: Callable[[], List[Tuple[str, np.ndarray]]]) -> None:
        self.steps += 1
        self.latest = parameters
        if self.whole_job:
            job().job_steps += 1
        if self.every and (self.steps == 1 or self.steps % self.every == 0):
            self.check(parameters())

    def check(self, parameters: List[Tuple[str, np.ndarray]], when: str = "") -> None:
        """Compare the replicas now (a collective): ReplicaMismatchError on every rank when they differ.

        ``when`` says where a check outside the interval runs ("at the end of epoch 2")."""
        # None for a rank waiting in hvdp.join: only the ranks still stepping are compared.
        stepping = [(rank, theirs) for rank, theirs in zip(self.ranks, self.gather(digests(parameters)))
                    if theirs is not None]
        everyone, ranks = [theirs for _, theirs in stepping], [rank for rank, _ in stepping]
        found = problems(everyone, ranks)
        if found:
            detail = how_far(self.gather, parameters, everyone, ranks)
            causes = "; ".join(f"({i}) {cause}" for i, cause in enumerate(LIKELY_CAUSES, 1))
            where = f" ({when})" if when else ""
            raise ReplicaMismatchError(
                f"Replicas drifted apart by step {self.steps}{where}: compared with rank {stepping[0][0]}, "
                f"{'; '.join(found)}.{detail} Likely causes: {causes}. This check runs after step 1 and every "
                f"{self.every} steps (HVDP_CHECK_EVERY=N to change, 0 to turn it off)."
            )


# Updates taken by this rank's whole-job DistributedOptimizers are counted by their drift guards in the job
# state (hvdp._state.JobState.job_steps), and the guards kept there in the order they were made (the same on
# every rank): the newest KEPT_AT_END of them, whose models are compared once more at the job's end.

#: How many of the newest whole-job optimizers the check at the job's end covers (each keeps its model alive
#: until then: a script that makes many, one after another, keeps only these).
KEPT_AT_END = 8


def final_check(backend: Any) -> None:
    """At shutdown, once every rank has joined: compare the replicas of every whole-job optimizer that
    stepped, whatever its interval, so no job ends as a success with its replicas apart.

    Every rank calls it (a collective); raises ReplicaMismatchError on every rank when they differ.
    """
    state = job()
    live = [guard for guard in state.guards if guard.latest is not None]
    state.guards = []
    if len(set(backend.allgather_object(len(live), None))) > 1:
        return  # the ranks made different optimizers: their step counts already say so
    for guard in live:
        latest = guard.latest
        if latest is not None:
            guard.check(latest(), "at the end of the job")


def step_counts(guard: Optional[DriftGuard]) -> List[int]:
    """This rank's step counters: ``guard``'s (0 without one) and the whole job's."""
    return [0 if guard is None else guard.steps, job().job_steps]


def adopt_step_counts(guard: Optional[DriftGuard], counts: List[int]) -> None:
    """Take another rank's :func:`step_counts` (after ``hvdp.join``, the state this rank now holds is its)."""
    if guard is not None:
        guard.steps = counts[0]
    job().job_steps = counts[1]


def uneven_steps(backend: Any) -> List[str]:
    """At shutdown, once every rank has joined: a line naming each rank's step count if they differ.

    A rank that ran out of data first waited in Horovod's join while the others
    stepped without it: their last updates averaged fewer replicas, and the model
    is no longer the same on every rank.
    """
    state = job()
    counts = backend.allgather_object(state.job_steps, None)
    state.job_steps = 0
    if len(set(counts)) <= 1:
        return []
    shown = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(counts))
    return [f"The ranks took different numbers of optimizer steps ({shown}), so their models differ. "
            "Give every rank the same number of batches (hvdp.shard(..., drop_remainder=True), or a "
            "DistributedSampler with drop_last=True), or train inside hvdp.join(model, optimizer)."]
