"""Print the figures of an ``hvdp bench --results`` file: the table the run printed at its end, or (``--markdown``)
the step times and ratios as the Markdown tables docs/performance.md quotes.

Usage: python scripts/results_table.py [--markdown] docs/results/FILE.json
       python scripts/results_table.py --before docs/results/OLDER.json docs/results/FILE.json

``--before OLDER`` prints, for every ratio and target the two files share, its median and range in each file and
whether the two ranges overlap (the change is within the rounds' own spread) or not (it moved), beside the figures
only one file has.

The figures come from the file's ``summary`` (docs/results/README.md); the command, the date, the machine's load
at the start and the end and hvdp's commit are printed above them, so a figure quoted in the docs can be traced to
the run that measured it, and every sample behind it read in the file.
"""

from __future__ import annotations

import argparse
import json
from typing import Dict, List, Optional, Tuple

from hvdp.bench.report import format_table


def heading(path: str, results: dict) -> List[str]:
    machine, versions = results.get("machine", {}), results.get("versions", {})
    command = results.get("command")
    return [f"{path}: `{' '.join(command) if isinstance(command, list) else command}`",
            f"{results.get('date')}; {machine.get('cpus')} CPUs, {machine.get('cpu_model')}"
            + (f" (family {machine['cpu_family']} model {machine['cpu_model_number']}, "
               f"{' '.join(machine.get('simd') or []) or 'no vector extensions'})" if machine.get("cpu_family") else
               " (its family and vector extensions not recorded)") + "; load average "
            f"{machine.get('load_average_start')} at the start, {machine.get('load_average_end')} at the end; hvdp "
            f"{versions.get('hvdp_commit')}" + (" (modified)" if versions.get("hvdp_modified") else "")
            + f", torch {versions.get('torch')}, tensorflow {versions.get('tensorflow')}, horovod "
            f"{versions.get('horovod')}; {len(results.get('samples', []))} samples"]


def markdown(summary: dict) -> List[str]:
    """Each group's contenders (median step of the rounds' means, with the range) and its ratios (median of the
    per-round ratios, with their range)."""
    lines = ["| comparison | contender | step ms: median [range] | rounds (ms) |", "|---|---|---|---|"]
    for group in summary["groups"]:
        for label, fig in group["contenders"].items():
            low, high = fig["step_seconds_range"]
            rounds = " ".join(f"{s * 1e3:.1f}" for s in fig["run_step_seconds"])
            lines.append(f"| {group['name']} | {label} | {fig['step_seconds'] * 1e3:.1f} "
                         f"[{low * 1e3:.1f}-{high * 1e3:.1f}] | {rounds} |")
    lines += ["", "| comparison | ratio | median [range] | per round |", "|---|---|---|---|"]
    for group in summary["groups"]:
        for key, value in group["ratios"].items():
            spread = group.get("ratio_spread", {}).get(key)
            if spread:
                rounds = " ".join(f"{r:.3f}" for r in spread["per_round"])
                lines.append(f"| {group['name']} | {key} | {value:.3f} [{spread['low']:.3f}-{spread['high']:.3f}] "
                             f"| {rounds} |")
            else:
                lines.append(f"| {group['name']} | {key} | {value:.3f} | - |")
    lines += allreduce_markdown(summary.get("allreduce"))
    lines += ["", "| target | value [range] | needs | status |", "|---|---|---|---|"]
    for target in summary["targets"]:
        value = "-" if target["value"] is None else f"{target['value']:.3f}"
        if target.get("spread"):
            value += f" [{target['spread'][0]:.3f}-{target['spread'][1]:.3f}]"
        lines.append(f"| {target['name']} | {value} | {target['op']} {target['threshold']} | {target['status']} |")
    return lines


def allreduce_markdown(sweep: Optional[dict]) -> List[str]:
    """The allreduce sweep, where the run has one: each call's time per size (ms, median of the rounds with
    their range) and its algorithm bandwidth at the largest size."""
    if not sweep or not sweep.get("impls"):
        return []
    sizes = sweep["bytes"]
    names = [f"{b >> 20} MB" if b >= 1 << 20 else f"{b >> 10} KB" for b in sizes]
    lines = ["", f"| allreduce, ms: median [range] | {' | '.join(names)} | GB/s at {names[-1]} |",
             "|---|" + "---|" * (len(sizes) + 1)]
    for label, fig in sweep["impls"].items():
        cells = [f"{s * 1e3:.3g} [{lo * 1e3:.3g}-{hi * 1e3:.3g}]" if s is not None else "-"
                 for s, (lo, hi) in zip(fig["seconds"], fig["range_seconds"])]
        lines.append(f"| {label} | {' | '.join(cells)} | {fig['algbw_GBps'][-1]:.2f} |")
    return lines


def ratio_figures(summary: dict) -> Dict[str, Tuple[float, Optional[Tuple[float, float]]]]:
    """Every ratio of a summary (``group: ratio``) and every target (``target: name``): (median, (low, high) or
    None where the file has no per-round spread)."""
    found: Dict[str, Tuple[float, Optional[Tuple[float, float]]]] = {}
    for group in summary["groups"]:
        for key, value in group["ratios"].items():
            spread = group.get("ratio_spread", {}).get(key)
            found[f"{group['name']}: {key}"] = (value, (spread["low"], spread["high"]) if spread else None)
    for target in summary["targets"]:
        if target["value"] is not None:
            found[f"target: {target['name']}"] = (target["value"], tuple(target["spread"]) if target.get("spread")
                                                  else None)
    return found


def compare(before: dict, after: dict) -> List[str]:
    """The before / after table of two results files' ratios (:func:`ratio_figures`), as Markdown."""
    old, new = ratio_figures(before["summary"]), ratio_figures(after["summary"])

    def cell(figure: Optional[Tuple[float, Optional[Tuple[float, float]]]]) -> str:
        if figure is None:
            return "-"
        value, spread = figure
        return f"{value:.3f}" + (f" [{spread[0]:.3f}-{spread[1]:.3f}]" if spread else "")

    lines = ["| ratio | before: median [range] | after: median [range] | change |", "|---|---|---|---|"]
    for key in [*old, *(k for k in new if k not in old)]:
        was, now = old.get(key), new.get(key)
        if was is None or now is None:
            verdict = "only after" if was is None else "only before"
        elif was[1] is None or now[1] is None:
            verdict = f"{now[0] / was[0]:.3f}x (no range)"
        else:
            apart = now[1][0] > was[1][1] or now[1][1] < was[1][0]
            verdict = f"{now[0] / was[0]:.3f}x, " + ("ranges apart" if apart else "within the ranges")
        lines.append(f"| {key} | {cell(was)} | {cell(now)} | {verdict} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="Markdown tables instead of the run's own table")
    parser.add_argument("--before", metavar="OLDER", help="an older results file: print the two files' ratios side "
                                                              "by side")
    parser.add_argument("file", help="a results file (hvdp bench --results FILE)")
    args = parser.parse_args()
    with open(args.file) as handle:
        results = json.load(handle)
    if args.before:
        with open(args.before) as handle:
            older = json.load(handle)
        print("before: " + "\n".join(heading(args.before, older)))
        print("after: " + "\n".join(heading(args.file, results)) + "\n")
        print("\n".join(compare(older, results)))
        return
    print("\n".join(heading(args.file, results)) + "\n")
    print("\n".join(markdown(results["summary"])) if args.markdown else format_table(results["summary"]))


if __name__ == "__main__":
    main()
