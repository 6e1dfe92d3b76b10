"""hvdp bench's plot: the ratios (each bar its median, a line its range over the rounds), the allreduce sweep,
the scaling figure."""

from __future__ import annotations

from typing import Any

from hvdp.errors import BenchError

#: The overhead panel's bars: hvdp against plain Horovod, and the direct gradient path against Horovod's path.
_OVERHEAD_BARS = {"hvdp/horovod like-for-like": "/ Horovod, like for like",
                  "hvdp/horovod defaults": "/ Horovod as shipped",
                  "hvdp/hvdp HVDP_GRADIENT_PATH=horovod": "direct / Horovod's path"}
#: The native panel's bars: like for like (the target) first, then the native contender as shipped (pale).
_NATIVE_BARS = {"hvdp/ddp like-for-like": "/ DDP like for like", "hvdp/mwms like-for-like": "/ MWMS like for like",
                "hvdp/ddp defaults": "/ DDP as shipped", "hvdp/mwms defaults": "/ MWMS as shipped"}
_AS_SHIPPED = {"hvdp/ddp defaults", "hvdp/mwms defaults"}


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
        labels, values, shipped, low, high = [], [], [], [], []
        for group in results["groups"]:
            for key, label in keys.items():
                if key in group["ratios"]:
                    labels.append(f"{group['name']}: {label}")
                    values.append(group["ratios"][key])
                    shipped.append(key in _AS_SHIPPED)
                    per = group.get("ratio_spread", {}).get(key, {})
                    low.append(values[-1] - per.get("low", values[-1]))
                    high.append(per.get("high", values[-1]) - values[-1])
        ax.barh(range(len(values)), values, xerr=[low, high] if values else None,
                color=["tab:green" if v <= 1.0 else "tab:red" for v in values])
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
