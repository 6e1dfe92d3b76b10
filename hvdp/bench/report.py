"""hvdp bench's results: figures per comparison, targets, the printed table and the plot."""

from __future__ import annotations

import math
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from hvdp.bench import breakdown
from hvdp.bench.plan import Group, Settings
from hvdp.bench.stats import algbw, busbw, efficiency, median, quartiles, ratio
from hvdp.errors import BenchError
from hvdp.frameworks import SPECS


@dataclass
class Target:
    """One target of the issue, with its measured value."""

    name: str
    value: Optional[float]
    op: str  # "<=" | "<" | ">="
    threshold: float
    note: str = ""

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
            per_run = [median(rec["step_seconds"]) for rec in records]
            step = median(per_run)
            cpu = [rec["cpu_seconds_per_step"] for rec in records if "cpu_seconds_per_step" in rec]
            figures["contenders"][contender.label] = {
                "impl": contender.impl, "framework": contender.framework, "model": contender.model,
                "np": contender.np, "controller": contender.controller, "knobs": contender.knobs,
                "run_step_seconds": per_run, "step_seconds": step,
                "examples_per_second": contender.np * settings.batch / step,
                "cpu_seconds_per_step": median(cpu) if cpu else None,
            }
            memory = [rec["memory"] for rec in records if "memory" in rec]
            if memory:  # state bytes are the same every run; peak RSS per rank, the median of the runs
                figures["contenders"][contender.label].update({
                    "state_bytes_per_rank": memory[-1]["state_bytes"],
                    "peak_rss_bytes_per_rank": [median([m["peak_rss_bytes"][r] for m in memory])
                                                for r in range(len(memory[-1]["peak_rss_bytes"]))]})
        figures["ratios"] = _ratios(group, figures["contenders"])
        if group.name.startswith("sharded"):
            figures["ratios"] = _sharded(group, figures["contenders"])
        if group.name.startswith("scaling"):
            results["scaling"] = _scaling(group, figures["contenders"])
        results["groups"].append(figures)
    results["targets"] = [asdict(t) | {"status": t.status} for t in targets(results, settings)]
    return results


def _scaling(group: Group, contenders: Dict[str, dict]) -> dict:
    """hvdp's throughput at np=1 and np=2 and its efficiency; DDP's under "ddp" when it ran too."""
    def of(impl: str) -> Optional[dict]:
        rates = {c.np: contenders[c.label]["examples_per_second"] for c in group.contenders if c.impl == impl}
        if set(rates) != {1, 2}:
            return None
        return {"throughput_np1": rates[1], "throughput_np2": rates[2], "efficiency": efficiency(rates[1], rates[2], 2)}

    figures: dict = {"model": group.contenders[0].model, **(of("hvdp") or {})}
    ddp = of("ddp")
    if ddp:
        figures["ddp"] = ddp
    return figures


def _sharded(group: Group, contenders: Dict[str, dict]) -> Dict[str, float]:
    """Per np: hvdp sharded's step time over hvdp unsharded's and ZeroRedundancyOptimizer's, and its
    largest state and peak RSS per rank over unsharded's."""
    out: Dict[str, float] = {}
    for np_ in sorted({c.np for c in group.contenders}):
        role = {("hvdp" if c.impl == "hvdp" else "zero") + (" sharded" if c.shard and c.impl == "hvdp" else ""):
                contenders[c.label] for c in group.contenders if c.np == np_}
        sharded, whole, zero = role.get("hvdp sharded"), role.get("hvdp"), role.get("zero")
        if sharded and whole:
            out[f"sharded/unsharded step np={np_}"] = ratio(sharded["step_seconds"], whole["step_seconds"])
        if sharded and zero:
            out[f"sharded/ZeroRedundancyOptimizer step np={np_}"] = ratio(sharded["step_seconds"],
                                                                          zero["step_seconds"])
        for key, name in (("state_bytes_per_rank", "state"), ("peak_rss_bytes_per_rank", "peak RSS")):
            if sharded and whole and sharded.get(key) and whole.get(key):
                out[f"{name} per rank sharded/unsharded np={np_}"] = ratio(max(sharded[key]), max(whole[key]))
    return out


def _ratios(group: Group, contenders: Dict[str, dict]) -> Dict[str, float]:
    by_role = {(c.impl, c.knobs): contenders[c.label]["step_seconds"] for c in group.contenders if not c.env}
    hvdp_step = by_role.get(("hvdp", "hvdp"))
    out: Dict[str, float] = {}
    if hvdp_step is None:
        return out
    for c in group.contenders:  # a contender with settings changed: hvdp's step / its step
        if c.impl == "hvdp" and c.env:  # an on/off of hvdp's
            changed = ",".join(f"{var}={value}" for var, value in sorted(c.env.items()))
            out[f"hvdp/hvdp {changed}"] = ratio(hvdp_step, contenders[c.label]["step_seconds"])
        elif c.impl in ("ddp", "mwms") and c.env:  # the native contender with hvdp's allocator settings
            out[f"hvdp/{c.impl} same malloc"] = ratio(hvdp_step, contenders[c.label]["step_seconds"])
    for (impl, knobs), step in by_role.items():
        if impl == "horovod":
            key = "hvdp/horovod same knobs" if knobs == "hvdp" else "hvdp/horovod defaults"
            out[key] = ratio(hvdp_step, step)
        elif impl in ("ddp", "mwms"):
            out[f"hvdp/{impl}"] = ratio(hvdp_step, step)
    return out


def _allreduce_figures(group: Group) -> dict:
    """Per contender and size: the median time (of each run's median), algbw, busbw, and the spread
    of single calls (25th and 75th percentiles of every timed call of every run)."""
    sizes = sorted({int(n) for records in group.runs.values() for rec in records for n in rec["seconds"]})
    figures: dict = {"bytes": sizes, "impls": {}}
    for contender in group.contenders:
        records = group.runs.get(contender.label, [])
        size = records[0]["size"] if records else 2
        seconds = [median([median(rec["seconds"][str(n)]) for rec in records]) for n in sizes]
        alg = [algbw(n, s) for n, s in zip(sizes, seconds)]
        spread = [quartiles([t for rec in records for t in rec["seconds"][str(n)]]) for n in sizes]
        figures["impls"][contender.label] = {
            "seconds": seconds, "algbw_GBps": [a / 1e9 for a in alg],
            "busbw_GBps": [busbw(a, size) / 1e9 for a in alg], "np": size,
            "spread_seconds": spread,
        }
    return figures


def allreduce_ratio(sweep: dict, mine: str, other: str, nbytes: int, of: str = "algbw_GBps") -> Optional[float]:
    """``mine``'s figure over ``other``'s at ``nbytes`` (None when either was not measured).

    Example:
        >>> sweep = {"bytes": [4096], "impls": {"a": {"algbw_GBps": [1.0]}, "b": {"algbw_GBps": [2.0]}}}
        >>> allreduce_ratio(sweep, "a", "b", 4096)
        0.5
    """
    impls = sweep.get("impls", {})
    if nbytes not in sweep.get("bytes", []) or mine not in impls or other not in impls:
        return None
    i = sweep["bytes"].index(nbytes)
    return ratio(impls[mine][of][i], impls[other][of][i])


def targets(results: dict, settings: Settings) -> List[Target]:
    """The issue's targets, evaluated on what this run measured (None where it did not)."""

    def worst(key: str, framework: str) -> Optional[float]:
        values = [g["ratios"][key] for g in results["groups"] if key in g["ratios"]
                  and g["name"].startswith(framework)]
        return max(values) if values else None

    def at(name_start: str, key: str) -> Optional[float]:
        values = [g["ratios"][key] for g in results["groups"] if g["name"].startswith(name_start)
                  and key in g["ratios"]]
        return values[0] if values else None

    found: List[Target] = []
    for framework in SPECS:
        found.append(Target(f"hvdp/horovod step time, same knobs, {framework} (worst group)",
                            worst("hvdp/horovod same knobs", framework), "<=", 1.02))
        found.append(Target(f"hvdp/horovod step time, hvdp defaults, {framework} (worst group)",
                            worst("hvdp/horovod defaults", framework), "<", 1.0))
    # Like for like: the native peer given hvdp's allocator settings in the same run.
    found.append(Target("hvdp/DDP step time, same allocator settings, torch (worst model)",
                        worst("hvdp/ddp same malloc", "torch"), "<=", 1.0))
    found.append(Target("hvdp/MultiWorkerMirrored step time, same allocator settings, tensorflow (worst model)",
                        worst("hvdp/mwms same malloc", "tensorflow"), "<=", 1.0))
    sweep = results.get("allreduce") or {}
    # At 64 MB the peers reduce in place (mpi4py into its receive buffer); hvdp's usual call returns a new tensor.
    for form, label, floor in (("usual call", "", 0.85), ("out=", " out=", 0.95)):
        for controller, under, peer, peer_label in (
                ("mpi", "MPI", "mpi4py", "mpi4py Allreduce"),
                ("gloo", "Gloo", "torch.distributed", "torch.distributed all_reduce (gloo)")):
            found.append(Target(f"hvdp.allreduce {form} algbw at 64 MB / {peer}, under {under}",
                                allreduce_ratio(sweep, f"hvdp.allreduce{label} ({controller})", peer_label, 64 << 20),
                                ">=", floor))
    found.append(Target("hvdp.allreduce latency at 4 KB / torch.distributed, under Gloo",
                        allreduce_ratio(sweep, "hvdp.allreduce (gloo)", "torch.distributed all_reduce (gloo)",
                                        4096, of="seconds"), "<=", 1.5))

    def sharded(key: str) -> Optional[float]:
        values = [g["ratios"][key] for g in results["groups"] if g["name"].startswith("sharded")
                  and key in g["ratios"]]
        return max(values) if values else None

    found.append(Target("sharded Adam state per rank / unsharded, np=2 (worst model)",
                        sharded("state per rank sharded/unsharded np=2"), "<=", 0.525, "1/2 within 5%"))
    found.append(Target("sharded/unsharded step time, Adam np=2 (worst model)",
                        sharded("sharded/unsharded step np=2"), "<=", 1.05))
    found.append(Target("sharded/ZeroRedundancyOptimizer step time, Adam np=2 (worst model)",
                        sharded("sharded/ZeroRedundancyOptimizer step np=2"), "<=", 1.0))
    scaling = results.get("scaling") or {}
    ddp = scaling.get("ddp")
    note = "" if scaling.get("model", "resnet18") == "resnet18" else "target is on resnet18"
    found.append(Target(f"scaling efficiency 1->2 processes ({scaling.get('model', 'resnet18')}), hvdp's / DDP's",
                        ratio(scaling["efficiency"], ddp["efficiency"]) if ddp and scaling.get("efficiency") else None,
                        ">=", 1.0, note or ("" if ddp else "DDP's scaling runs in the full run")))
    return found


def format_table(results: dict) -> str:
    """The run's figures as a plain-text table (what ``hvdp bench`` prints at the end)."""
    lines = [f"hvdp bench ({results.get('mode', '?')}: {results.get('rounds', '?')} rounds x "
             f"{results.get('steps', '?')} steps, {results.get('warmup', '?')} warm-up; "
             f"{results.get('date', '')}; {results.get('machine', {}).get('description', '')})", ""]
    for group in results["groups"]:
        lines.append(f"{group['name']}")
        for label, fig in group["contenders"].items():
            runs = " ".join(f"{s * 1e3:.1f}" for s in fig["run_step_seconds"])
            cpu = fig.get("cpu_seconds_per_step")
            cpu_text = f"  CPU {cpu * 1e3:6.1f} ms" if cpu is not None else ""
            lines.append(f"  {label:<50} {fig['step_seconds'] * 1e3:8.1f} ms  {fig['examples_per_second']:8.1f} ex/s"
                         f"{cpu_text}   runs: {runs}")
            if fig.get("state_bytes_per_rank"):
                state = " ".join(f"{b / 2 ** 20:.2f}" for b in fig["state_bytes_per_rank"])
                rss = " ".join(f"{b / 2 ** 20:.0f}" for b in fig["peak_rss_bytes_per_rank"])
                lines.append(f"  {'':<50} optimizer state MB per rank: {state}; peak RSS MB per rank: {rss}")
        for key, value in group["ratios"].items():
            lines.append(f"  ratio {key:<44} {value:8.3f}")
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
        lines.append("")
    lines.append("targets")
    for target in results["targets"]:
        value = "-" if target["value"] is None else f"{target['value']:.3f}"
        note = f"  ({target['note']})" if target.get("note") else ""
        lines.append(f"  {target['status']:<5} {target['name']:<62} {value:>7} {target['op']} "
                     f"{target['threshold']}{note}")
    return "\n".join(lines)


def _human(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


#: The overhead panel's bars: hvdp against plain Horovod, and the direct gradient path against Horovod's path.
_OVERHEAD_BARS = {"hvdp/horovod same knobs": "/ Horovod, same knobs",
                  "hvdp/horovod defaults": "/ Horovod, its defaults",
                  "hvdp/hvdp HVDP_GRADIENT_PATH=horovod": "direct / Horovod's path"}
#: The native panel's bars: like for like (the target) first, then the native contender as shipped (pale).
_NATIVE_BARS = {"hvdp/ddp same malloc": "/ DDP like for like", "hvdp/mwms same malloc": "/ MWMS like for like",
                "hvdp/ddp": "/ DDP as shipped", "hvdp/mwms": "/ MWMS as shipped"}
_AS_SHIPPED = {"hvdp/ddp", "hvdp/mwms"}


def _not_measured(ax: Any, results: dict) -> None:
    ax.text(0.5, 0.5, f"not measured in this run\n(sections: {', '.join(results.get('sections', []))})",
            ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def plot(results: dict, path: str) -> None:
    """Draw the ratios, the allreduce sweep and the scaling figure into ``path`` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BenchError("--plot needs matplotlib: pip install matplotlib (or leave out --plot).") from exc
    bars = sum(len(group["ratios"]) for group in results["groups"])
    fig, axes = plt.subplots(2, 2, figsize=(15, max(9.0, 5.0 + 0.25 * bars)),
                             gridspec_kw={"height_ratios": [max(1.0, bars / 16), 1.0]})
    panels = ((axes[0][0], _OVERHEAD_BARS, "Overhead: hvdp / plain Horovod, direct / Horovod's path"),
              (axes[0][1], _NATIVE_BARS, "Versus native: hvdp / native step time"))
    for ax, keys, title in panels:
        labels, values, shipped = [], [], []
        for group in results["groups"]:
            for key, label in keys.items():
                if key in group["ratios"]:
                    labels.append(f"{group['name']}: {label}")
                    values.append(group["ratios"][key])
                    shipped.append(key in _AS_SHIPPED)
        ax.barh(range(len(values)), values, color=["tab:green" if v <= 1.0 else "tab:red" for v in values])
        for bar, light in zip(ax.patches, shipped):  # the native contender as shipped: context, not the target
            if light:
                bar.set_alpha(0.35)
        ax.set_yticks(range(len(values)), labels, fontsize=7)
        ax.axvline(1.0, color="black", lw=1)
        ax.set_title(title)
        ax.set_xlabel("step-time ratio (< 1: hvdp faster)")
        if not values:
            _not_measured(ax, results)
    ax = axes[1][0]
    sweep = results.get("allreduce") or {}
    for name, fig_ in sweep.get("impls", {}).items():
        ax.plot(sweep["bytes"], fig_["algbw_GBps"], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("bytes (float32)")
    ax.set_ylabel("algbw GB/s")
    ax.set_title("Allreduce, np=2")
    if sweep:
        ax.legend(fontsize=7)
    else:
        _not_measured(ax, results)
    ax = axes[1][1]
    scaling = results.get("scaling") or {}
    if scaling:
        ddp = scaling.get("ddp") or {}
        names = ["hvdp\nnp=1", "hvdp\nnp=2", "hvdp\nideal np=2"] + (["DDP\nnp=1", "DDP\nnp=2"] if ddp else [])
        heights = [scaling["throughput_np1"], scaling["throughput_np2"], 2 * scaling["throughput_np1"]] + \
            ([ddp["throughput_np1"], ddp["throughput_np2"]] if ddp else [])
        ax.bar(names, heights, color=["tab:blue", "tab:blue", "lightgray", "tab:orange", "tab:orange"][:len(names)])
        ax.set_title(f"Scaling {scaling['model']}: efficiency hvdp {scaling['efficiency']:.2f}"
                     + (f", DDP {ddp['efficiency']:.2f}" if ddp else ""))
        ax.set_ylabel("examples / s")
    else:
        _not_measured(ax, results)
    fig.suptitle(f"hvdp bench ({results.get('mode')}), {results.get('date')}, "
                 f"{results.get('machine', {}).get('description', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the longest bar labels too
    plt.close(fig)


def machine() -> dict:
    """What the figures were measured on."""
    cpus = os.cpu_count() or 1
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": cpus, "cpu_model": model, "platform": platform.platform(), "python": platform.python_version(),
            "description": f"{cpus} CPUs{', ' + model if model else ''}"}
