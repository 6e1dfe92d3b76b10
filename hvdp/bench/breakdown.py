"""Where the time of one ``hvdp.allreduce`` goes: the bench's ``breakdown`` section.

Each rank times the Python side of every call with ``time.perf_counter_ns`` at the
points the call passes through (hvdp's checks and conversion, the allocation of the
out-of-place result, the enqueue into Horovod, the wait, the conversion back), and
rank 0 runs with Horovod's timeline on (``HOROVOD_TIMELINE``). The timeline holds,
per tensor and call, the negotiation, the op and its activities (``MPI_ALLREDUCE``,
``GLOO_ALLREDUCE``, ``MEMCPY_IN_FUSION_BUFFER`` ...) in microseconds from its start,
whose wall-clock time it records; so rank 0's wait splits into the time its request
sat in the queue until a background cycle took it up, the negotiation, the op's
phases, and the time from the op's end until the caller saw it done.

The same calls run beside Horovod's own in-place ``allreduce_`` on a tensor of the
same size, under the same settings, alternating call by call.

Pure parts here (timeline parsing, per-call phases, summaries, the table); the
worker side lives in :mod:`hvdp.bench.torch_bench` (``breakdown``).

Example:
    >>> # hvdp bench --only breakdown --breakdown 4K,64M
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from hvdp.errors import BenchError

#: The variants timed side by side, in the order of the table: hvdp's call as it runs (under Gloo by direct
#: calls, :func:`hvdp.backends.torch.direct.calls.direct_call`), the same call on Horovod's path
#: (``HVDP_GRADIENT_PATH=horovod``), and Horovod's own in-place call.
VARIANTS = ("hvdp.allreduce", "hvdp.allreduce, Horovod's path", "Horovod allreduce_ (in place)")
#: The variant whose calls skip Horovod's queue and timeline under Gloo: its phases are Python's only, with
#: ``output allocation`` the packing of a small tensor into the exchange's buffer and ``wait`` the exchange
#: (a large tensor: its header exchange and the ring).
DIRECT = VARIANTS[0]

#: Python marks every rank records per call, in the order a call passes them (perf_counter ns):
#: call start, hvdp's allocation of the result starts, Horovod's enqueue starts, enqueue done,
#: the wait is over (handle synchronized), call returns, its result is freed (as a loop that drops it frees it).
MARKS = ("start", "alloc", "enqueue", "enqueued", "done", "end", "freed")

#: Phases of a call, microseconds, in the order of the table. Rank 0 splits ``wait`` with the timeline.
PYTHON_PHASES = ("python before", "output allocation", "enqueue", "wait", "python after", "free result")
TIMELINE_PHASES = ("cycle wait", "negotiation", "to op start", "untimed copy", "memcpy in fusion buffer",
                   "transport", "memcpy out fusion buffer", "op end", "completion notice")
#: What each phase is, for the table's legend and docs/performance.md.
PHASE_NOTES = {
    "python before": "hvdp's argument checks and conversion to a tensor (in place: Horovod's Python)",
    "output allocation": "the out-of-place result tensor (Horovod's allreduce_async: tensor.new)",
    "enqueue": "Horovod's C++ enqueue of the request",
    "wait": "from the enqueue to the handle reported done (rank 0: split below)",
    "python after": "Horovod's synchronize bookkeeping after the wait and hvdp's conversion back",
    "free result": "the caller dropping the result (freeing the out-of-place tensor)",
    "cycle wait": "queued until a background cycle took the request up (NEGOTIATE_ALLREDUCE began)",
    "negotiation": "NEGOTIATE_ALLREDUCE after this rank's enqueue: waiting for the other ranks, agreeing",
    "to op start": "from the negotiation's end to the op's start (the cycle's other work)",
    "untimed copy": "inside the op, before its first activity (Gloo: the copy of the input into the output)",
    "memcpy in fusion buffer": "MEMCPY_IN_FUSION_BUFFER",
    "transport": "MPI_ALLREDUCE / GLOO_ALLREDUCE",
    "memcpy out fusion buffer": "MEMCPY_OUT_FUSION_BUFFER",
    "op end": "from the last activity to the op's end",
    "completion notice": "from the op's end until the caller's wait returned (polling, callback)",
}
#: Timeline activity names counted as transport.
TRANSPORT = ("MPI_ALLREDUCE", "GLOO_ALLREDUCE", "NCCL_ALLREDUCE", "MPI_ADASUM_ALLREDUCE")


@dataclass
class TimelineCall:
    """One allreduce of one tensor as rank 0's timeline saw it (microseconds since the timeline's start)."""

    negotiate: Optional[Tuple[int, int]]
    op: Tuple[int, int]
    activities: List[Tuple[str, int, int]] = field(default_factory=list)


@dataclass
class Timeline:
    """A parsed Horovod timeline: its start (wall clock, microseconds since the epoch) and calls by tensor."""

    start_epoch_us: int
    calls: Dict[str, List[TimelineCall]]


def _events(text: str) -> List[dict]:
    """The events of a timeline file, also when Horovod has not closed its JSON array (a job still running)."""
    body = text.strip()
    if not body.startswith("["):
        raise BenchError("not a Horovod timeline: it does not start with '['.")
    try:
        events = json.loads(body)
    except json.JSONDecodeError:
        body = body.rstrip(",\n ")
        try:
            events = json.loads(body + "]")
        except json.JSONDecodeError:  # cut inside the last event: keep the whole ones
            cut = body.rfind("}")
            while cut > 0:
                try:
                    events = json.loads(body[:cut + 1] + "]")
                    break
                except json.JSONDecodeError:
                    cut = body.rfind("}", 0, cut)
            else:
                raise BenchError("not a Horovod timeline: no complete event in it.") from None
    if not isinstance(events, list):
        raise BenchError("not a Horovod timeline: its JSON is not an array of events.")
    return events


def parse_timeline(text: str) -> Timeline:
    """Horovod's timeline (Chrome trace JSON) as the calls of each tensor, in order.

    Each tensor is a trace "process" (``pid``) named ``<op>.<tensor name>``; a call is a
    ``NEGOTIATE_<OP>`` span followed by the op's span (``ALLREDUCE``) with its activities
    nested inside. Negotiations without an op (a job that ends in ``join``) are left out.

    Example:
        >>> text = ('[{"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros": 7}},'
        ...         '{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allreduce.x"}},'
        ...         '{"ph": "B", "name": "ALLREDUCE", "ts": 10, "pid": 1},'
        ...         '{"ph": "B", "name": "MPI_ALLREDUCE", "ts": 11, "pid": 1}, {"ph": "E", "ts": 15, "pid": 1},'
        ...         '{"ph": "E", "ts": 16, "pid": 1}]')
        >>> parse_timeline(text).calls["allreduce.x"][0].activities
        [('MPI_ALLREDUCE', 11, 15)]
    """
    events = _events(text)
    start = None
    names: Dict[int, str] = {}
    stacks: Dict[int, List[Tuple[str, int]]] = {}
    pending_negotiation: Dict[int, Tuple[int, int]] = {}
    open_calls: Dict[int, TimelineCall] = {}
    calls: Dict[str, List[TimelineCall]] = {}
    for event in events:
        if not isinstance(event, dict):
            continue
        phase, pid = event.get("ph"), event.get("pid")
        args = event.get("args") or {}
        if phase == "M":
            if event.get("name") == "process_name":
                if "start_time_since_epoch_in_micros" in args:
                    start = int(args["start_time_since_epoch_in_micros"])
                elif "name" in args and isinstance(pid, int):
                    names[pid] = str(args["name"])
            continue
        if not isinstance(pid, int) or "ts" not in event:
            continue
        ts = int(event["ts"])
        stack = stacks.setdefault(pid, [])
        if phase == "B":
            name = str(event.get("name", ""))
            stack.append((name, ts))
            if len(stack) == 1 and not name.startswith("NEGOTIATE_"):
                open_calls[pid] = TimelineCall(pending_negotiation.pop(pid, None), (ts, ts))
        elif phase == "E" and stack:
            name, begun = stack.pop()
            if name.startswith("NEGOTIATE_") and not stack:
                pending_negotiation[pid] = (begun, ts)
            elif not stack and pid in open_calls:
                call = open_calls.pop(pid)
                call.op = (begun, ts)
                calls.setdefault(names.get(pid, str(pid)), []).append(call)
            elif len(stack) == 1 and pid in open_calls:
                open_calls[pid].activities.append((name, begun, ts))
    if start is None:
        raise BenchError("not a Horovod timeline: it has no start_time_since_epoch_in_micros.")
    return Timeline(start, calls)


def python_phases(marks: Sequence[int]) -> Dict[str, float]:
    """A call's Python phases, microseconds, from its :data:`MARKS` (nanoseconds), and its ``call`` time.

    Example:
        >>> python_phases([0, 10_000, 12_000, 20_000, 1_020_000, 1_021_000, 1_022_000])["wait"]
        1000.0
    """
    if len(marks) != len(MARKS):
        raise BenchError(f"a call has {len(marks)} marks, expected {len(MARKS)} ({', '.join(MARKS)}).")
    m = dict(zip(MARKS, marks))
    phases = {"python before": m["alloc"] - m["start"], "output allocation": m["enqueue"] - m["alloc"],
              "enqueue": m["enqueued"] - m["enqueue"], "wait": m["done"] - m["enqueued"],
              "python after": m["end"] - m["done"], "free result": m["freed"] - m["end"],
              "call": m["freed"] - m["start"]}
    return {name: value / 1000.0 for name, value in phases.items()}


def timeline_phases(marks: Sequence[int], call: TimelineCall, offset_ns: int, start_epoch_us: int) -> Dict[str, float]:
    """Rank 0's wait split by the timeline, microseconds.

    ``marks`` are perf_counter nanoseconds, ``offset_ns`` turns them into wall-clock
    nanoseconds (time_ns - perf_counter_ns on that rank); the timeline's times are
    microseconds after ``start_epoch_us``.
    """
    m = dict(zip(MARKS, marks))

    def wall_us(mark: str) -> float:
        return (m[mark] + offset_ns - start_epoch_us * 1000) / 1000.0  # in integers first: no rounding

    op_start, op_end = call.op
    negotiate = call.negotiate or (op_start, op_start)
    acts = sorted(call.activities, key=lambda a: a[1])
    first = acts[0][1] if acts else op_end
    last = acts[-1][2] if acts else op_end
    sums: Dict[str, float] = {"memcpy in fusion buffer": 0.0, "transport": 0.0, "memcpy out fusion buffer": 0.0}
    for name, act_begun, act_ended in acts:
        key = ("transport" if name in TRANSPORT else "memcpy in fusion buffer" if name == "MEMCPY_IN_FUSION_BUFFER"
               else "memcpy out fusion buffer" if name == "MEMCPY_OUT_FUSION_BUFFER" else "transport")
        sums[key] += act_ended - act_begun
    # The coordinator's negotiation may begin before this rank's enqueue (another rank asked first): the
    # boundaries are clamped in order, so the phases of the wait add up to it.
    enqueued = wall_us("enqueued")
    begun = min(max(enqueued, negotiate[0]), op_start)
    agreed = min(max(begun, negotiate[1]), op_start)
    return {"cycle wait": begun - enqueued, "negotiation": agreed - begun,
            "to op start": op_start - agreed, "untimed copy": float(first - op_start), **sums,
            "op end": float(op_end - last), "completion notice": wall_us("done") - op_end}


def call_phases(per_rank: Mapping[int, Mapping[str, object]], timeline: Optional[Timeline], tensor: str,
                warmup: int) -> Dict[int, List[Dict[str, float]]]:
    """Every timed call's phases, per rank: Python phases on every rank, rank 0's wait split by the timeline.

    ``per_rank[r]``: ``{"marks": [[6 ints] per call], "offset_ns": int}``; ``tensor``: the
    timeline's name of the tensor (``allreduce.<name>``); the first ``warmup`` calls are left out.
    A phase, with ``unaccounted`` = the call time less every other phase.
    """
    out: Dict[int, List[Dict[str, float]]] = {}
    tl_calls = timeline.calls.get(tensor, []) if timeline else []
    for rank, record in sorted(per_rank.items()):
        marks_list = list(record["marks"])  # type: ignore[call-overload]
        rows = []
        for i, marks in enumerate(marks_list):
            if i < warmup:
                continue
            phases = python_phases(marks)
            if rank == 0 and timeline is not None:
                if len(tl_calls) != len(marks_list):
                    raise BenchError(f"the timeline has {len(tl_calls)} calls of {tensor}, rank 0 made "
                                     f"{len(marks_list)}; was another job writing the same timeline?")
                split = timeline_phases(marks, tl_calls[i], int(record["offset_ns"]),  # type: ignore[call-overload]
                                        timeline.start_epoch_us)
                phases.pop("wait")
                phases.update(split)
            named = [v for k, v in phases.items() if k != "call"]
            phases["unaccounted"] = phases["call"] - sum(named)
            rows.append(phases)
        out[rank] = rows
    return out


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return float(statistics.fmean(values)) if values else float("nan")


def summarize(records: List[dict]) -> dict:
    """The breakdown figures of the section's runs: per controller, variant, size and rank, each phase's
    mean and median microseconds over the calls, the calls' count and their median page faults.

    ``records``: what the workers wrote (``controller``, ``size``, ``phases`` as
    ``{variant: {bytes: {rank: [phases per call]}}}``, ``faults`` alike).
    """
    figures: dict = {"phase_notes": PHASE_NOTES, "runs": []}
    for record in records:
        run: dict = {"controller": record["controller"], "np": record["size"], "env": record.get("env", {}),
                     "variants": {}}
        for variant, by_size in record["phases"].items():
            sizes: dict = {}
            for nbytes, by_rank in by_size.items():
                ranks: dict = {}
                for rank, rows in by_rank.items():
                    names = [k for k in rows[0]] if rows else []
                    ranks[rank] = {
                        "calls": len(rows),
                        "mean_us": {k: _mean(r[k] for r in rows) for k in names},
                        "median_us": {k: float(statistics.median([r[k] for r in rows])) for k in names},
                        "minor_faults_per_call": float(statistics.median(
                            record.get("faults", {}).get(variant, {}).get(nbytes, {}).get(rank, [0]) or [0])),
                    }
                sizes[nbytes] = ranks
            run["variants"][variant] = sizes
        figures["runs"].append(run)
    return figures


def format_table(figures: dict) -> str:
    """The breakdown as plain text: per controller and size, rank 0's phases (median and mean microseconds)
    of each variant side by side, then the other ranks' Python phases."""
    lines = ["allreduce breakdown, float32, np=2: microseconds per call, median (mean) over the timed calls;",
             "rank 0's wait split with Horovod's timeline"]
    for run in figures.get("runs", []):
        variants = list(run["variants"])
        sizes = sorted({int(n) for v in run["variants"].values() for n in v})
        for nbytes in sizes:
            columns = [run["variants"][v].get(str(nbytes), {}) for v in variants]
            rank0 = [c.get("0") or c.get(0) or {} for c in columns]  # JSON keys are strings
            head = f"{run['controller']}, {_human(nbytes)}"
            lines.append("")
            lines.append(f"  {head:<28}" + "".join(f"  {v[:30]:>30}" for v in variants))
            names = [p for p in (*PYTHON_PHASES, *TIMELINE_PHASES, "unaccounted", "call")
                     if any(p in r.get("median_us", {}) for r in rank0)]
            for phase in names:
                cells = ""
                for r in rank0:
                    med, mean = r.get("median_us", {}).get(phase), r.get("mean_us", {}).get(phase)
                    cells += f"  {_us(med):>14} ({_us(mean)})".rjust(32) if med is not None else " " * 32
                label = "= call (measured)" if phase == "call" else phase
                lines.append(f"    {label:<26}{cells}")
            lines.append(f"    {'minor page faults / call':<26}" + "".join(
                f"  {r.get('minor_faults_per_call', 0):>30.0f}" for r in rank0))
            lines.append(f"    {'calls':<26}" + "".join(f"  {r.get('calls', 0):>30}" for r in rank0))
            for rank in sorted({k for c in columns for k in c if str(k) != "0"}, key=int):
                other = [c.get(rank, {}) for c in columns]
                lines.append(f"    rank {rank}: python before / alloc / enqueue / wait / after / free, call "
                             "(median us)")
                lines.append("    " + " " * 26 + "".join(
                    "  " + " / ".join(_us(o.get("median_us", {}).get(p)) for p in PYTHON_PHASES).rjust(30)
                    + f", {_us(o.get('median_us', {}).get('call'))}" for o in other))
    return "\n".join(lines)


def _us(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}"


def _human(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def parse_sizes(text: str) -> Tuple[int, ...]:
    """``--breakdown 4K,64M`` as bytes; each a positive multiple of 4 (float32).

    Example:
        >>> parse_sizes("4K, 64M,1024")
        (4096, 67108864, 1024)
    """
    sizes = []
    for raw in text.split(","):
        part = raw.strip().upper().removesuffix("B")
        if not part:
            continue
        factor = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(part[-1], 1)
        digits = part[:-1] if factor > 1 else part
        if not digits.isdigit() or int(digits) * factor < 4 or int(digits) * factor % 4:
            raise BenchError(f"--breakdown {text!r}: {raw.strip()!r} is not a size in bytes that is a positive "
                             "multiple of 4 (float32). Give sizes such as 4K,64M or 4096,67108864.")
        sizes.append(int(digits) * factor)
    if not sizes:
        raise BenchError(f"--breakdown {text!r}: no size given; e.g. --breakdown 4K,64M.")
    return tuple(sizes)
