"""hvdp bench's results: figures per comparison, targets, the printed table and the plot."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

from hvdp.bench import breakdown
from hvdp.bench.plan import Group, Settings
from hvdp.bench.stats import algbw, busbw, efficiency, mean_step, median, quartiles, ratio, ratio_spread
from hvdp.frameworks import SPECS


@dataclass
class Target:
    """One target of the issue, with its measured value."""

    name: str
    value: Optional[float]
    op: str  # "<=" | "<" | ">="
    threshold: float
    note: str = ""
    spread: Optional[List[float]] = None  # [low, high] of the ratio's rounds

    @property
    def status(self) -> str:
        """PASS, MISS, or n/a (not measured in this run)."""
        if self.value is None:
            return "n/a"
        passed = {"<=": self.value <= self.threshold, "<": self.value < self.threshold,
                  ">=": self.value >= self.threshold}[self.op]
        return "PASS" if passed else "MISS"


def summarize(groups: List[Group], settings: Settings) -> dict:
    """Every figure of the run as one JSON-ready dict (medians, ratios, bandwidths, targets)."""
    results: dict = {"groups": [], "allreduce": {}, "scaling": {}, "targets": []}
    for group in groups:
        if group.name == "allreduce":
            results["allreduce"] = _allreduce_figures(group)
            continue
        if group.name == "breakdown":
            results["breakdown"] = breakdown.summarize([rec for c in group.contenders
                                                        for rec in group.runs.get(c.label, [])])
            continue
        figures: dict = {"name": group.name, "contenders": {}}
        for contender in group.contenders:
            records = group.runs.get(contender.label, [])
            per_run = [mean_step(rec) for rec in records]  # each round's mean step: periodic work included
            step = median(per_run)
            cpu = [rec["cpu_seconds_per_step"] for rec in records if "cpu_seconds_per_step" in rec]
            figures["contenders"][contender.label] = {
                "impl": contender.impl, "framework": contender.framework, "model": contender.model,
                "np": contender.np, "controller": contender.controller, "knobs": contender.knobs,
                "settings": contender.settings, "run_step_seconds": per_run, "step_seconds": step,
                "step_seconds_range": [min(per_run), max(per_run)],
                "examples_per_second": contender.np * settings.batch / step,
                "cpu_seconds_per_step": median(cpu) if cpu else None,
            }
            memory = [rec["memory"] for rec in records if "memory" in rec]
            if memory:  # state bytes are the same every run; peak RSS per rank, the median of the runs
                figures["contenders"][contender.label].update({
                    "state_bytes_per_rank": memory[-1]["state_bytes"],
                    "peak_rss_bytes_per_rank": [median([m["peak_rss_bytes"][r] for m in memory])
                                                for r in range(len(memory[-1]["peak_rss_bytes"]))],
                    "run_state_bytes_max": [max(m["state_bytes"]) for m in memory],
                    "run_peak_rss_bytes_max": [max(m["peak_rss_bytes"]) for m in memory]})
        spreads = (_sharded if group.name.startswith("sharded") else _ratios)(group, figures["contenders"])
        figures["ratio_spread"] = spreads  # each ratio round by round (both contenders ran in each), with range
        figures["ratios"] = {key: value["median"] for key, value in spreads.items()}
        if group.name.startswith("scaling"):
            results["scaling"] = _scaling(group, figures["contenders"])
        results["groups"].append(figures)
    results["targets"] = [asdict(t) | {"status": t.status} for t in targets(results, settings)]
    return results


def _scaling(group: Group, contenders: Dict[str, dict]) -> dict:
    """hvdp's throughput at np=1 and np=2 and its efficiency; DDP's under "ddp" when it ran too. Round by round
    too: a round's efficiency is its np=1 step over its np=2 step (the same batch per rank), in
    ``efficiency_spread``; and hvdp's efficiency over DDP's, round by round, in ``versus_ddp``."""
    def of(impl: str) -> Optional[dict]:
        ran = {c.np: contenders[c.label] for c in group.contenders if c.impl == impl}
        if set(ran) != {1, 2}:
            return None
        rates = {np_: figures["examples_per_second"] for np_, figures in ran.items()}
        return {"throughput_np1": rates[1], "throughput_np2": rates[2], "efficiency": efficiency(rates[1], rates[2], 2),
                "efficiency_spread": ratio_spread(ran[1]["run_step_seconds"], ran[2]["run_step_seconds"])}

    figures: dict = {"model": group.contenders[0].model, **(of("hvdp") or {})}
    ddp = of("ddp")
    if ddp:
        figures["ddp"] = ddp
        if "efficiency_spread" in figures:
            figures["versus_ddp"] = ratio_spread(figures["efficiency_spread"]["per_round"],
                                                 ddp["efficiency_spread"]["per_round"])
    return figures


def _sharded(group: Group, contenders: Dict[str, dict]) -> Dict[str, dict]:
    """Per np, round by round: hvdp sharded's step time over hvdp unsharded's and ZeroRedundancyOptimizer's
    (as shipped and like for like), and its largest state and peak RSS per rank over unsharded's."""
    out: Dict[str, dict] = {}
    for np_ in sorted({c.np for c in group.contenders}):
        role = {("hvdp" if c.impl == "hvdp" else f"zero {c.settings}") + (" sharded" if c.shard and c.impl == "hvdp"
                                                                          else ""): contenders[c.label]
                for c in group.contenders if c.np == np_}
        sharded, whole = role.get("hvdp sharded"), role.get("hvdp")
        if not (sharded and whole):
            continue
        out[f"sharded/unsharded step np={np_}"] = ratio_spread(sharded["run_step_seconds"], whole["run_step_seconds"])
        for settings in ("like-for-like", "defaults"):
            zero = role.get(f"zero {settings}")
            if zero:
                out[f"sharded/ZeroRedundancyOptimizer {settings} step np={np_}"] = ratio_spread(
                    sharded["run_step_seconds"], zero["run_step_seconds"])
        for key, name in (("run_state_bytes_max", "state"), ("run_peak_rss_bytes_max", "peak RSS")):
            if sharded.get(key) and whole.get(key):
                out[f"{name} per rank sharded/unsharded np={np_}"] = ratio_spread(sharded[key], whole[key])
    return out


def _ratios(group: Group, contenders: Dict[str, dict]) -> Dict[str, dict]:
    """hvdp's step time over each other contender's, round by round: ``hvdp/<peer> <settings>`` (a peer as
    shipped, or like for like) and ``hvdp/hvdp VAR=value`` (hvdp with one of its settings changed)."""
    hvdp = next((c for c in group.contenders if c.impl == "hvdp" and not c.env and c.knobs == "hvdp"), None)
    out: Dict[str, dict] = {}
    if hvdp is None:
        return out
    mine = contenders[hvdp.label]["run_step_seconds"]
    for c in group.contenders:
        if c is hvdp or c.np != hvdp.np:
            continue
        if c.impl == "hvdp" and c.env:
            key = "hvdp/hvdp " + ",".join(f"{var}={value}" for var, value in sorted(c.env.items()))
        elif c.impl in ("horovod", "ddp", "mwms"):
            key = f"hvdp/{c.impl} {c.settings}"
        else:
            continue
        out[key] = ratio_spread(mine, contenders[c.label]["run_step_seconds"])
    return out


def _allreduce_figures(group: Group) -> dict:
    """Per contender and size: each round's median call (``round_seconds``), their median and range, algbw,
    busbw, and the spread of single calls (25th and 75th percentiles of every timed call of every round)."""
    sizes = sorted({int(n) for records in group.runs.values() for rec in records for n in rec["seconds"]})
    figures: dict = {"bytes": sizes, "impls": {}}
    for contender in group.contenders:
        records = group.runs.get(contender.label, [])
        size = records[0]["size"] if records else 2
        per_round = [[median(rec["seconds"][str(n)]) for rec in records] for n in sizes]
        seconds = [median(rounds) for rounds in per_round]
        alg = [algbw(n, s) for n, s in zip(sizes, seconds)]
        spread = [quartiles([t for rec in records for t in rec["seconds"][str(n)]]) for n in sizes]
        figures["impls"][contender.label] = {
            "seconds": seconds, "round_seconds": per_round,
            "range_seconds": [[min(rounds), max(rounds)] for rounds in per_round],
            "algbw_GBps": [a / 1e9 for a in alg], "busbw_GBps": [busbw(a, size) / 1e9 for a in alg], "np": size,
            "spread_seconds": spread, "settings": contender.settings,
        }
    return figures


def allreduce_ratio(sweep: dict, mine: str, other: str, nbytes: int, of: str = "algbw_GBps") -> Optional[dict]:
    """``mine``'s figure over ``other``'s at ``nbytes``, round by round, with its median and range (None when
    either was not measured). ``of``: "algbw_GBps" (other's time over mine) or "seconds" (mine over other's).

    Example:
        >>> sweep = {"bytes": [4096], "impls": {"a": {"round_seconds": [[2.0, 2.0, 4.0]]},
        ...                                     "b": {"round_seconds": [[1.0, 2.0, 1.0]]}}}
        >>> allreduce_ratio(sweep, "a", "b", 4096)["per_round"]
        [0.5, 1.0, 0.25]
    """
    impls = sweep.get("impls", {})
    if nbytes not in sweep.get("bytes", []) or mine not in impls or other not in impls:
        return None
    i = sweep["bytes"].index(nbytes)
    a, b = impls[mine]["round_seconds"][i], impls[other]["round_seconds"][i]
    return ratio_spread(b, a) if of == "algbw_GBps" else ratio_spread(a, b)


def targets(results: dict, settings: Settings) -> List[Target]:
    """The targets, evaluated on what this run measured (None where it did not), each ratio's median with
    the range of its rounds (the worst group's, where several groups have it)."""

    def worst(key: str, start: str) -> Optional[dict]:
        found = [g["ratio_spread"][key] for g in results["groups"] if key in g.get("ratio_spread", {})
                 and g["name"].startswith(start)]
        return max(found, key=lambda s: s["median"]) if found else None

    def target(name: str, found: Optional[dict], op: str, threshold: float, note: str = "") -> Target:
        return Target(name, None if found is None else found["median"], op, threshold, note,
                      None if found is None else [found["low"], found["high"]])

    found: List[Target] = []
    for framework in SPECS:
        found.append(target(f"hvdp/horovod step time, like for like, {framework} (worst group)",
                            worst("hvdp/horovod like-for-like", framework), "<=", 1.02))
        found.append(target(f"hvdp/horovod step time, each as shipped, {framework} (worst group)",
                            worst("hvdp/horovod defaults", framework), "<", 1.0))
    found.append(target("hvdp/DDP step time, like for like, torch (worst model)",
                        worst("hvdp/ddp like-for-like", "torch"), "<=", 1.0))
    found.append(target("hvdp/MultiWorkerMirrored step time, like for like, tensorflow (worst model)",
                        worst("hvdp/mwms like-for-like", "tensorflow"), "<=", 1.0))
    sweep = results.get("allreduce") or {}
    # At 64 MB the peers reduce in place (mpi4py into its receive buffer); hvdp's usual call returns a new tensor.
    for form, label, floor in (("usual call", "", 0.85), ("out=", " out=", 0.95)):
        for controller, under, peer, peer_label in (
                ("mpi", "MPI", "mpi4py", "mpi4py Allreduce [like for like]"),
                ("gloo", "Gloo", "torch.distributed", "torch.distributed all_reduce (gloo) [like for like]")):
            found.append(target(f"hvdp.allreduce {form} algbw at 64 MB / {peer} like for like, under {under}",
                                allreduce_ratio(sweep, f"hvdp.allreduce{label} ({controller})", peer_label, 64 << 20),
                                ">=", floor))
    found.append(target("hvdp.allreduce latency at 4 KB / torch.distributed like for like, under Gloo",
                        allreduce_ratio(sweep, "hvdp.allreduce (gloo)",
                                        "torch.distributed all_reduce (gloo) [like for like]", 4096, of="seconds"),
                        "<=", 1.5))
    found.append(target("sharded Adam state per rank / unsharded, np=2 (worst model)",
                        worst("state per rank sharded/unsharded np=2", "sharded"), "<=", 0.525, "1/2 within 5%"))
    found.append(target("sharded/unsharded step time, Adam np=2 (worst model)",
                        worst("sharded/unsharded step np=2", "sharded"), "<=", 1.05))
    found.append(target("sharded/ZeroRedundancyOptimizer step time, like for like, Adam np=2 (worst model)",
                        worst("sharded/ZeroRedundancyOptimizer like-for-like step np=2", "sharded"), "<=", 1.0))
    scaling = results.get("scaling") or {}
    ddp = scaling.get("ddp")
    note = "" if scaling.get("model", "resnet18") == "resnet18" else "target is on resnet18"
    versus = scaling.get("versus_ddp")  # round by round (a results file before it: the medians' ratio, no range)
    value = versus["median"] if versus else \
        ratio(scaling["efficiency"], ddp["efficiency"]) if ddp and scaling.get("efficiency") else None
    found.append(Target(f"scaling efficiency 1->2 processes ({scaling.get('model', 'resnet18')}), hvdp's / DDP's",
                        value, ">=", 1.0, note or ("" if ddp else "DDP's scaling runs in the full run"),
                        [versus["low"], versus["high"]] if versus else None))
    return found


def format_table(results: dict) -> str:
    """The run's figures as a plain-text table (what ``hvdp bench`` prints at the end)."""
    lines = [f"hvdp bench ({results.get('mode', '?')}: {results.get('rounds', '?')} rounds x "
             f"{results.get('steps', '?')} steps, {results.get('warmup', '?')} warm-up; "
             f"{results.get('date', '')}; {results.get('machine', {}).get('description', '')}; seed "
             f"{results.get('seed', '?')}; step: each round's mean step, median [range] of the rounds; "
             f"[defaults]: a peer as shipped, [like for like]: with hvdp run's variables)", ""]
    for group in results["groups"]:
        lines.append(f"{group['name']}")
        for label, fig in group["contenders"].items():
            runs = " ".join(f"{s * 1e3:.1f}" for s in fig["run_step_seconds"])
            cpu = fig.get("cpu_seconds_per_step")
            cpu_text = f"  CPU {cpu * 1e3:6.1f} ms" if cpu is not None else ""
            low, high = fig.get("step_seconds_range", [math.nan, math.nan])
            lines.append(f"  {label:<50} {fig['step_seconds'] * 1e3:8.1f} ms [{low * 1e3:.1f}-{high * 1e3:.1f}]  "
                         f"{fig['examples_per_second']:8.1f} ex/s{cpu_text}   rounds: {runs}")
            if fig.get("state_bytes_per_rank"):
                state = " ".join(f"{b / 2 ** 20:.2f}" for b in fig["state_bytes_per_rank"])
                rss = " ".join(f"{b / 2 ** 20:.0f}" for b in fig["peak_rss_bytes_per_rank"])
                lines.append(f"  {'':<50} optimizer state MB per rank: {state}; peak RSS MB per rank: {rss}")
        for key, value in group["ratios"].items():
            per = group.get("ratio_spread", {}).get(key)
            lines.append(f"  ratio {key:<44} {value:8.3f}" + (
                f" [{per['low']:.3f}-{per['high']:.3f}]  rounds: " + " ".join(f"{r:.3f}" for r in per["per_round"])
                if per else ""))
        lines.append("")
    sweep = results.get("allreduce")
    if sweep:
        names = list(sweep["impls"])
        lines.append("allreduce float32, np=2: algbw / busbw GB/s")
        lines.append("  " + f"{'bytes':>10}" + "".join(f"  {name[:30]:>30}" for name in names))
        for i, nbytes in enumerate(sweep["bytes"]):
            cells = "".join(f"  {sweep['impls'][n]['algbw_GBps'][i]:>14.3f} / "
                            f"{sweep['impls'][n]['busbw_GBps'][i]:<13.3f}" for n in names)
            lines.append(f"  {_human(nbytes):>10}{cells}")
        lines.append("")
        lines.append("allreduce latency, ms: median [25th-75th percentile of single calls]")
        lines.append("  " + f"{'bytes':>10}" + "".join(f"  {name[:30]:>30}" for name in names))
        for i, nbytes in enumerate(sweep["bytes"]):
            cells = ""
            for n in names:
                fig = sweep["impls"][n]
                low, high = fig.get("spread_seconds", [[math.nan, math.nan]] * len(sweep["bytes"]))[i]
                cells += f"  {fig['seconds'][i] * 1e3:>11.3f} [{low * 1e3:.3f}-{high * 1e3:.3f}]".rjust(32)
            lines.append(f"  {_human(nbytes):>10}{cells}")
        lines.append("")
    if results.get("breakdown"):
        lines.append(breakdown.format_table(results["breakdown"]))
        lines.append("")
    scaling = results.get("scaling")
    if scaling:
        lines.append(f"scaling {scaling['model']}: T1 {scaling['throughput_np1']:.1f} ex/s, "
                     f"T2 {scaling['throughput_np2']:.1f} ex/s, efficiency {scaling['efficiency']:.3f}"
                     + (f"; DDP: T1 {scaling['ddp']['throughput_np1']:.1f}, T2 {scaling['ddp']['throughput_np2']:.1f}"
                        f", efficiency {scaling['ddp']['efficiency']:.3f}" if "ddp" in scaling else ""))
        for who, per in (("hvdp", scaling.get("efficiency_spread")),
                         ("DDP", (scaling.get("ddp") or {}).get("efficiency_spread")),
                         ("hvdp's / DDP's", scaling.get("versus_ddp"))):
            if per:
                lines.append(f"  {who} efficiency round by round: {per['median']:.3f} [{per['low']:.3f}-"
                             f"{per['high']:.3f}]  rounds: {' '.join(f'{r:.3f}' for r in per['per_round'])}")
        lines.append("")
    lines.append("targets")
    for target in results["targets"]:
        value = "-" if target["value"] is None else f"{target['value']:.3f}"
        if target.get("spread"):
            value += f" [{target['spread'][0]:.3f}-{target['spread'][1]:.3f}]"
        note = f"  ({target['note']})" if target.get("note") else ""
        lines.append(f"  {target['status']:<5} {target['name']:<62} {value:>7} {target['op']} "
                     f"{target['threshold']}{note}")
    return "\n".join(lines)


def _human(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"
