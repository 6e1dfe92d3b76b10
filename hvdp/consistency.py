"""``hvdp.check_consistency``: do all replicas hold exactly the same trainable parameters?

Each rank digests every parameter; the digests (not the tensors) are gathered, and
each rank that differs from the first member is named with its first differing
parameters. Framework-neutral: the backend lists the parameters and gathers.
"""

from __future__ import annotations

import hashlib
from typing import Any, List, Tuple

import numpy as np

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


def problems(everyone: List[List[Digest]], ranks: List[int]) -> List[str]:
    """One line for each rank whose digests differ from the first rank's (none when all agree).

    Example:
        >>> problems([[("w", [2], "a")], [("w", [2], "b")]], [0, 1])
        ['rank 1 (1 of 1 parameters differ, e.g. w)']
    """
    reference = everyone[0]
    found = []
    for rank, theirs in zip(ranks, everyone):
        if theirs == reference:
            continue
        if [(n, s) for n, s, _ in theirs] != [(n, s) for n, s, _ in reference]:
            found.append(f"rank {rank} has a different architecture ({len(theirs)} parameters vs "
                         f"{len(reference)} on rank {ranks[0]})")
            continue
        differing = [n for (n, _, d), (_, _, d0) in zip(theirs, reference) if d != d0]
        found.append(f"rank {rank} ({len(differing)} of {len(reference)} parameters differ, e.g. "
                     f"{', '.join(differing[:3])})")
    return found


def check(backend: Any, model: Any, handle: Any, ranks: List[int]) -> None:
    """Raise ReplicaMismatchError unless every rank in ``ranks`` holds the first one's parameters."""
    everyone = backend.allgather_object(digests(backend.named_parameters(model)), handle)
    found = problems(everyone, ranks)
    if found:
        differing_ranks = [p.split(" ", 2)[1] for p in found]
        raise ReplicaMismatchError(
            f"Replicas differ from rank {ranks[0]} on rank(s) {', '.join(differing_ranks)}: {'; '.join(found)}. "
            "Start every replica with hvdp.broadcast_state(model, optimizer) and step with "
            "hvdp.DistributedOptimizer."
        )
