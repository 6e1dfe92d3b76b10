"""`hvdp bench --smoke` for real, the bench smoke CI runs: every contender of the quick plan (hvdp, plain
Horovod, DDP under torchrun, MultiWorkerMirroredStrategy as TF_CONFIG workers, mpi4py, torch.distributed) in
one real job each, 3 steps, and every section's table, targets, JSON and plot. Figures are printed, not
asserted (3 steps measure nothing); the JSON must hold every one of them as a positive finite number.

About 2-4 min on 2 cores (17 jobs, two at a time, most of it interpreter start-ups importing torch or
TensorFlow; 211 s against 340 s one at a time, on one slow day): it replaces both the earlier native-only
smoke (4 jobs) and the separate `hvdp bench --quick` of .ci/run (34 jobs)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from harness import REPO

#: The quick plan's comparisons and what each must yield (its ratios' names).
GROUPS = {
    "torch/cnn np=2 gloo": {"hvdp/ddp", "hvdp/ddp same malloc", "hvdp/horovod same knobs", "hvdp/horovod defaults",
                            "hvdp/hvdp HVDP_EARLY_WAKE=0", "hvdp/hvdp HVDP_GRADIENT_PATH=horovod"},
    "tensorflow/cnn np=2 gloo": {"hvdp/mwms", "hvdp/mwms same malloc", "hvdp/horovod defaults",
                                 "hvdp/hvdp HVDP_EARLY_WAKE=0"},
    "scaling torch/cnn": set(),
    "sharded torch/cnn": {f"{name} np={n}" for n in (1, 2) for name in (
        "sharded/unsharded step", "sharded/ZeroRedundancyOptimizer step", "state per rank sharded/unsharded",
        "peak RSS per rank sharded/unsharded")},
    "sharded tensorflow/cnn": {f"{name} np={n}" for n in (1, 2) for name in (
        "sharded/unsharded step", "state per rank sharded/unsharded", "peak RSS per rank sharded/unsharded")},
}
SWEEP = ["hvdp.allreduce (gloo)", "hvdp.allreduce out= (gloo)", "mpi4py Allreduce",
         "torch.distributed all_reduce (gloo)"]
#: The targets a quick plan measures (the others need the full run's contenders).
MEASURED = {"hvdp/horovod step time, same knobs, torch (worst group)",
            "hvdp/horovod step time, hvdp defaults, torch (worst group)",
            "hvdp/horovod step time, hvdp defaults, tensorflow (worst group)",
            "hvdp/DDP step time, same allocator settings, torch (worst model)",
            "hvdp/MultiWorkerMirrored step time, same allocator settings, tensorflow (worst model)",
            "hvdp.allreduce out= algbw at 64 MB / torch.distributed, under Gloo",
            "hvdp.allreduce usual call algbw at 64 MB / torch.distributed, under Gloo",
            "hvdp.allreduce latency at 4 KB / torch.distributed, under Gloo",
            "sharded Adam state per rank / unsharded, np=2 (worst model)",
            "sharded/unsharded step time, Adam np=2 (worst model)",
            "sharded/ZeroRedundancyOptimizer step time, Adam np=2 (worst model)"}


def _numbers(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _numbers(value)
    elif isinstance(tree, list):
        for value in tree:
            yield from _numbers(value)
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield tree


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One `hvdp bench --smoke --json --plot` run, shared by this module's checks."""
    tmp = tmp_path_factory.mktemp("bench")
    out, png = tmp / "bench.json", tmp / "bench.png"
    proc = subprocess.run([sys.executable, "-m", "hvdp.cli", "bench", "--smoke", "--json", str(out), "--plot",
                           str(png)], cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    print(proc.stdout)  # the table, in the log of a run with -s and on failure
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text()), png.read_bytes()


def test_every_contender_ran_once_with_positive_figures(smoke):
    """The quick plan's comparisons, each contender one run of 3 steps (the smoke size), every figure > 0.

    Over 60 s: the first test of the module runs the shared smoke (17 real jobs, about 3 min)."""
    _, data, _ = smoke
    assert (data["mode"], data["rounds"], data["steps"], data["warmup"]) == ("smoke", 1, 3, 1)
    assert {g["name"]: set(g["ratios"]) for g in data["groups"]} == GROUPS
    for group in data["groups"]:
        assert len(group["contenders"]) >= 2, group["name"]
        for label, figures in group["contenders"].items():
            assert len(figures["run_step_seconds"]) == 1, label
            assert positive(figures["step_seconds"]) and positive(figures["examples_per_second"]), label
        assert all(positive(value) for value in group["ratios"].values()), group["ratios"]
    scaling = data["scaling"]
    assert scaling["model"] == "cnn" and positive(scaling["efficiency"]), scaling


def test_allreduce_sweep_and_breakdown_have_every_contender_and_size(smoke):
    _, data, _ = smoke
    sweep = data["allreduce"]
    assert sweep["bytes"] == [4096, 64 << 20] and sorted(sweep["impls"]) == sorted(SWEEP)
    for label, figures in sweep["impls"].items():
        assert all(positive(s) for s in figures["seconds"]) and all(positive(b) for b in figures["algbw_GBps"]), \
            label
    runs = data["breakdown"]["runs"]
    assert sorted(run["controller"] for run in runs) == ["gloo", "mpi"], runs
    for run in runs:  # every variant, both sizes, both ranks, a few calls each that took time
        assert run["variants"], run
        for variant, by_size in run["variants"].items():
            assert sorted(map(int, by_size)) == [4096, 64 << 20], (run["controller"], variant)
            for by_rank in by_size.values():
                assert sorted(by_rank) == ["0", "1"], (run["controller"], variant)
                assert all(r["calls"] >= 3 and positive(r["median_us"]["call"]) for r in by_rank.values()), by_rank


def test_sharded_section_measures_every_ranks_optimizer_state_and_peak_rss(smoke):
    """Adam's state at np=2: hvdp's sharded ranks hold half of the unsharded state each (its flat split is
    even to the element); torch's ZeroRedundancyOptimizer's ranks hold whole parameters. These bytes are
    exact, not timings: they are asserted."""
    stdout, data, _ = smoke
    group = next(g for g in data["groups"] if g["name"] == "sharded torch/cnn")
    figures = group["contenders"]
    for label, fig in figures.items():
        assert len(fig["state_bytes_per_rank"]) == fig["np"] == len(fig["peak_rss_bytes_per_rank"]), label
        assert all(positive(b) for b in fig["state_bytes_per_rank"] + fig["peak_rss_bytes_per_rank"]), label
    whole = figures["hvdp torch/cnn adam np=2"]["state_bytes_per_rank"]
    sharded = figures["hvdp sharded torch/cnn adam np=2"]["state_bytes_per_rank"]
    assert whole[0] == whole[1] and all(abs(b - whole[0] / 2) <= 64 for b in sharded), (whole, sharded)
    zero = figures["ddp ZeroRedundancyOptimizer torch/cnn adam np=2"]["state_bytes_per_rank"]
    assert abs(sum(zero) - whole[0]) <= 256, (zero, whole)
    keras = next(g for g in data["groups"] if g["name"] == "sharded tensorflow/cnn")["contenders"]
    whole = keras["hvdp tensorflow/cnn adam np=2"]["state_bytes_per_rank"]  # Keras's Adam: its moments, step, rate
    sharded = keras["hvdp sharded tensorflow/cnn adam np=2"]["state_bytes_per_rank"]
    assert whole[0] == whole[1] and all(abs(b - whole[0] / 2) <= 64 for b in sharded), (whole, sharded)
    assert "optimizer state MB per rank" in stdout


def test_targets_table_and_plot(smoke):
    stdout, data, png = smoke
    assert png[:4] == b"\x89PNG"
    measured = {t["name"] for t in data["targets"] if t["value"] is not None}
    assert measured == MEASURED
    numbers = list(_numbers({"groups": data["groups"], "targets": [t["value"] for t in data["targets"]
                                                                    if t["value"] is not None]}))
    assert numbers and all(math.isfinite(n) and n > 0 for n in numbers
                           if not isinstance(n, int) or n > 0), numbers
    assert "targets" in stdout and "hvdp bench smoke" in stdout
