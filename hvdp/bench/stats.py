"""Statistics of hvdp bench: medians, ratios, bandwidths, scaling efficiency."""

from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Sequence

from hvdp.errors import BenchError


def median(values: Sequence[float]) -> float:
    """The median of ``values``; raises BenchError when there are none.

    Example:
        >>> median([3.0, 1.0, 2.0])
        2.0
    """
    if not values:
        raise BenchError("no measurements to take the median of; did every job fail?")
    return float(statistics.median(values))


def quartiles(values: Sequence[float]) -> List[float]:
    """[25th, 75th] percentile of ``values``: the spread of single measurements.

    Example:
        >>> quartiles([1.0, 2.0, 3.0, 4.0, 5.0])
        [2.0, 4.0]
    """
    if not values:
        raise BenchError("no measurements to take the quartiles of; did every job fail?")
    cuts = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return [float(cuts[0]), float(cuts[2])]


def ratio(a: float, b: float) -> float:
    """``a / b``, the step-time ratio of two contenders (below 1: ``a`` is faster).

    Example:
        >>> ratio(0.09, 0.1)
        0.9
    """
    if not (b > 0 and math.isfinite(a) and math.isfinite(b)):
        raise BenchError(f"cannot divide {a} by {b}: a step time must be a positive finite number.")
    return round(a / b, 12)


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth of an allreduce, bytes per second.

    Example:
        >>> algbw(1_000_000, 0.001)
        1000000000.0
    """
    if seconds <= 0:
        raise BenchError(f"allreduce time {seconds} must be positive.")
    return nbytes / seconds


def busbw(algbw_value: float, size: int) -> float:
    """Bus bandwidth: ``algbw * 2 (n - 1) / n`` (what each rank's link carries in a ring allreduce).

    Example:
        >>> busbw(1.0e9, 2)
        1000000000.0
    """
    if size < 1:
        raise BenchError(f"process count {size} must be at least 1.")
    return algbw_value * 2 * (size - 1) / size


def efficiency(throughput_1: float, throughput_n: float, n: int = 2) -> float:
    """Scaling efficiency ``T_n / (n T_1)``.

    Example:
        >>> efficiency(100.0, 190.0)
        0.95
    """
    if throughput_1 <= 0 or n < 1:
        raise BenchError(f"efficiency needs a positive np=1 throughput and n >= 1, got {throughput_1}, {n}.")
    return throughput_n / (n * throughput_1)


def mean_step(record: dict) -> float:
    """A training job's seconds per step: the mean over its measured steps, so that work done every N steps
    (hvdp's drift guard) counts once per N steps, as in a long job (a median would leave it out).

    Example:
        >>> mean_step({"step_seconds": [0.1, 0.1, 0.1, 0.5]})
        0.2
    """
    steps = record.get("step_seconds") or []
    if not steps:
        raise BenchError("a training record without measured steps; did the job fail?")
    return float(sum(steps) / len(steps))


def spread(values: Sequence[float]) -> Dict[str, Any]:
    """The median of per-round ``values`` and their range: ``{"median", "low", "high", "rounds"}``.

    Example:
        >>> spread([0.3, 0.1, 0.2])
        {'median': 0.2, 'low': 0.1, 'high': 0.3, 'rounds': 3}
    """
    return {"median": median(values), "low": float(min(values)), "high": float(max(values)), "rounds": len(values)}


def ratio_spread(mine: Sequence[float], theirs: Sequence[float]) -> Dict[str, Any]:
    """The ratio of two contenders round by round (both ran in each round), its median and range.

    Example:
        >>> ratio_spread([0.9, 1.0, 1.2], [1.0, 1.0, 1.0])["per_round"]
        [0.9, 1.0, 1.2]
    """
    if len(mine) != len(theirs) or not mine:
        raise BenchError(f"a ratio per round needs both contenders in every round: {len(mine)} and {len(theirs)} "
                         f"rounds.")
    per_round = [ratio(a, b) for a, b in zip(mine, theirs)]
    return {"per_round": per_round, **spread(per_round)}
