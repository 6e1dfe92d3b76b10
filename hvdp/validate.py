"""The checks the facade (:mod:`hvdp`) makes on its arguments before dispatching to the backend.

Each raises ValueError saying what was received, what is allowed and how to fix it.
"""

from __future__ import annotations

import numbers
from typing import Any, List, Optional

from hvdp import process_sets as _process_sets
from hvdp.backends.base import ALLREDUCE_OPS, REDUCE_OPS
from hvdp.process_sets import ProcessSet


def check_choice(what: str, value: object, choices: tuple) -> str:
    """``value`` if it is one of ``choices``.

    Example:
        >>> check_choice("compression", "fp8", ("none", "fp16"))
        Traceback (most recent call last):
        ...
        ValueError: Unknown compression 'fp8'. Expected one of: none, fp16.
    """
    if value not in choices:
        raise ValueError(f"Unknown {what} {value!r}. Expected one of: {', '.join(choices)}.")
    return str(value)


def check_op(op: object, backend: Any, process_set: Optional[ProcessSet] = None, caller: str = "") -> str:
    """``op`` if it is a reduction this job can run (Adasum: under MPI, on the whole job).

    ``caller`` names a call that reduces gradients (they take :data:`REDUCE_OPS` only); without
    it, ``op`` is an allreduce's (:data:`ALLREDUCE_OPS`).
    """
    if caller and op in ALLREDUCE_OPS and op not in REDUCE_OPS:
        raise ValueError(
            f"{caller}(op={op!r}): gradients are averaged, summed or combined with Adasum; {op!r} reduces "
            f"values elementwise (hvdp.allreduce(x, op={op!r}) takes it). Use op='average', 'sum' or 'adasum'."
        )
    check_choice("op", op, REDUCE_OPS if caller else ALLREDUCE_OPS)
    if op == "adasum" and backend.controller() != "mpi":
        raise ValueError(
            "op='adasum' needs Horovod's MPI controller (Horovod runs Adasum on CPUs over MPI), but this "
            f"job runs on {backend.controller()}. Launch with hvdp run --mpi, or use op='average'."
        )
    if op == "adasum" and process_set is not None:
        raise ValueError(
            f"op='adasum' runs on the whole job only (Horovod 0.28.1 has no Adasum on process sets), "
            f"got process_set={process_set!r}. Use op='average' or 'sum' within a process set."
        )
    return str(op)


def check_root(root_rank: object, caller: str, process_set: Optional[ProcessSet] = None) -> int:
    """``root_rank`` as a rank of the whole job (inside a process set, it counts in the set)."""
    ranks = _process_sets.members(process_set, caller)
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < len(ranks):
        if process_set is None:
            raise ValueError(f"root_rank={root_rank!r} is not a rank of this job; expected 0..{len(ranks) - 1}.")
        raise ValueError(
            f"root_rank={root_rank!r} is not a rank of {process_set!r}: inside a process set, root_rank counts "
            f"in the set, 0..{len(ranks) - 1} (root_rank=0 is its first member, rank {ranks[0]})."
        )
    return ranks[root_rank]


def check_splits(splits: object, rows: int, members: int) -> List[int]:
    """``hvdp.alltoall``'s ``splits``: a count of rows >= 0 for each of the ``members`` ranks, summing to ``rows``.

    Example:
        >>> check_splits((1, 2), 3, 2)
        [1, 2]
    """
    if isinstance(splits, (str, bytes)) or not hasattr(splits, "__iter__"):
        raise TypeError(f"hvdp.alltoall(splits=...) takes a list of row counts, one per rank, got {splits!r}.")
    values = list(splits)
    if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0 for v in values):
        raise TypeError(f"hvdp.alltoall(splits={values!r}): each count must be an integer >= 0.")
    counts = [int(v) for v in values]
    if len(counts) != members:
        raise ValueError(f"hvdp.alltoall(splits={counts!r}) has {len(counts)} counts for {members} ranks. "
                         "Give one count per rank (of the process set), in rank order.")
    if sum(counts) != rows:
        raise ValueError(f"hvdp.alltoall(splits={counts!r}) sends {sum(counts)} rows, but the value has {rows}. "
                         "The splits must sum to its first dimension.")
    return counts


def check_optimizer_options(op: str, backward_passes_per_step: Any, gradient_predivide_factor: Any) -> None:
    """The numeric options of ``hvdp.DistributedOptimizer``, checked (``op`` already is)."""
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(
            f"backward_passes_per_step={backward_passes_per_step!r}; expected an integer >= 1."
        )
    if not isinstance(gradient_predivide_factor, numbers.Real) or gradient_predivide_factor <= 0:
        raise ValueError(
            f"gradient_predivide_factor={gradient_predivide_factor!r}; expected a number > 0."
        )
    if gradient_predivide_factor != 1.0 and op != "average":
        raise ValueError(
            f"gradient_predivide_factor={gradient_predivide_factor} only applies to "
            f"op='average' (got op={op!r}); leave it at 1.0."
        )


def check_groups(groups: Any) -> Any:
    """``DistributedOptimizer(groups=...)``: None, a number of requests >= 1, or non-empty lists of parameters."""
    if groups is None:
        return None
    if isinstance(groups, numbers.Integral) and not isinstance(groups, bool):
        if groups < 1:
            raise ValueError(f"groups={groups!r}; give the number of requests to split the gradients into (>= 1), "
                             f"or leave groups out for one request.")
        return int(groups)
    if isinstance(groups, (list, tuple)) and groups and all(isinstance(g, (list, tuple)) and g for g in groups):
        return [list(g) for g in groups]
    raise TypeError(f"groups={groups!r}; give a number of requests (groups=2) or lists of parameters that go "
                    f"together (groups=[[w1, b1], [w2, b2]]).")


def check_sharding(shard_optimizer_state: object, op: str, groups: Any) -> bool:
    """``DistributedOptimizer(shard_optimizer_state=...)``: a bool, with the options a sharded step can honour."""
    if not isinstance(shard_optimizer_state, bool):
        raise TypeError(f"shard_optimizer_state={shard_optimizer_state!r}; give True or False.")
    if shard_optimizer_state and op == "adasum":
        raise ValueError("shard_optimizer_state=True with op='adasum': Adasum combines whole tensors, a sharded step "
                         "reduce-scatters slices of them. Use op='average' (or 'sum'), or shard_optimizer_state=False.")
    if shard_optimizer_state and groups is not None:
        raise ValueError(f"shard_optimizer_state=True with groups={groups!r}: a sharded step reduces each param "
                         f"group's gradients in one reducescatter already. Leave groups out.")
    return shard_optimizer_state


def check_compression(compression: object, choices: tuple) -> str:
    """``compression`` if it is one of ``choices``; bfloat16 is refused with the reason."""
    if compression == "bf16":
        raise ValueError("compression='bf16': Horovod 0.28.1's wire has no bfloat16 type (an allreduce of a bfloat16 "
                         "tensor raises 'Tensor type ... is not supported' under Gloo and MPI), so gradients cannot "
                         "travel as bfloat16. Use compression='fp16' (also 2 bytes a value), or 'none'.")
    return check_choice("compression", compression, choices)
