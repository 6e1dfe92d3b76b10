"""`hvdp bench --smoke --results` for real, the bench smoke CI runs: every implementation of the quick plan (hvdp
under hvdp run, plain Horovod, DDP under torchrun, MultiWorkerMirroredStrategy as TF_CONFIG workers, mpi4py,
torch.distributed), each peer as shipped and like for like, in real jobs of 2 steps; the torch comparison over
two shuffled rounds, the others once. Figures are printed, not asserted (2 steps measure nothing); the JSON
must hold every one of them as a positive finite number, and the results file every sample and each round's
order.

27 jobs, two at a time: most of a job is its processes importing torch or TensorFlow (a TensorFlow job
costs 10-20 s of CPU here)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest
from harness import REPO

#: The smoke plan's comparisons and what each must yield (its ratios' names).
GROUPS = {
    "torch/cnn np=2 gloo": {f"hvdp/{peer} {settings}" for peer in ("ddp", "horovod")
                            for settings in ("defaults", "like-for-like")},
    "tensorflow/cnn np=2 gloo": {f"hvdp/{peer} {settings}" for peer in ("mwms", "horovod")
                                 for settings in ("defaults", "like-for-like")},
    "sharded torch/cnn": {"sharded/unsharded step np=2", "sharded/ZeroRedundancyOptimizer defaults step np=2",
                          "sharded/ZeroRedundancyOptimizer like-for-like step np=2",
                          "state per rank sharded/unsharded np=2", "peak RSS per rank sharded/unsharded np=2"},
    "sharded tensorflow/cnn": {"sharded/unsharded step np=2", "state per rank sharded/unsharded np=2",
                               "peak RSS per rank sharded/unsharded np=2"},
}
SWEEP = ["hvdp.allreduce (gloo)", "mpi4py Allreduce [defaults]", "mpi4py Allreduce [like for like]",
         "torch.distributed all_reduce (gloo) [defaults]", "torch.distributed all_reduce (gloo) [like for like]"]
#: The targets a smoke plan measures (the others need the quick or full run's contenders).
MEASURED = {f"hvdp/horovod step time, {how}, {fw} (worst group)" for fw in ("torch", "tensorflow")
            for how in ("like for like", "each as shipped")} | {
    "hvdp/DDP step time, like for like, torch (worst model)",
    "hvdp/MultiWorkerMirrored step time, like for like, tensorflow (worst model)",
    "hvdp.allreduce usual call algbw at 64 MB / torch.distributed like for like, under Gloo",
    "hvdp.allreduce latency at 4 KB / torch.distributed like for like, under Gloo",
    "sharded Adam state per rank / unsharded, np=2 (worst model)",
    "sharded/unsharded step time, Adam np=2 (worst model)",
    "sharded/ZeroRedundancyOptimizer step time, like for like, Adam np=2 (worst model)"}


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
    """One `hvdp bench --smoke --results --json --plot` run, shared by this module's checks."""
    tmp = tmp_path_factory.mktemp("bench")
    out, kept, png = tmp / "bench.json", tmp / "results.json", tmp / "bench.png"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hvdp.cli", "bench", "--smoke", "--results", str(kept), "--json",
                           str(out), "--plot", str(png)], cwd=REPO, capture_output=True, text=True, timeout=900,
                          check=False)
    print(proc.stdout)  # the table, in the log of a run with -s and on failure
    print(f"hvdp bench --smoke took {time.monotonic() - start:.0f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text()), png.read_bytes(), json.loads(kept.read_text())


def test_every_contender_ran_with_positive_figures(smoke):
    """The smoke plan's comparisons, each contender its rounds of 2 steps, every figure > 0.

    Over 60 s: the first test of the module runs the shared smoke (27 real jobs)."""
    _, data, _, _ = smoke
    assert (data["mode"], data["rounds"], data["steps"], data["warmup"]) == ("smoke", 2, 2, 1)
    assert {g["name"]: set(g["ratios"]) for g in data["groups"]} == GROUPS
    for group in data["groups"]:
        assert len(group["contenders"]) >= 2, group["name"]
        rounds = 2 if group["name"] == "torch/cnn np=2 gloo" else 1
        for label, figures in group["contenders"].items():
            assert len(figures["run_step_seconds"]) == rounds, label
            assert positive(figures["step_seconds"]) and positive(figures["examples_per_second"]), label
        for key, spread in group["ratio_spread"].items():
            assert len(spread["per_round"]) == rounds and spread["low"] <= spread["median"] <= spread["high"], key
        assert all(positive(value) for value in group["ratios"].values()), group["ratios"]


def test_results_file_keeps_every_sample_the_settings_and_a_shuffled_order(smoke):
    _, data, _, kept = smoke
    assert kept["format"] == "hvdp-bench-results/1" and kept["command"][:3] == ["hvdp", "bench", "--smoke"]
    assert len(kept["machine"]["load_average_start"]) == 3 and kept["machine"]["cpus"] >= 1
    assert kept["versions"]["torch"] and kept["versions"]["tensorflow"] and kept["versions"]["horovod"]
    rounds = {g["name"]: 2 if g["name"] == "torch/cnn np=2 gloo" else 1 for g in data["groups"]}
    rounds.update({"allreduce": 1, "breakdown": 1})
    expected = sorted((c["group"], label, r) for label, c in kept["contenders"].items()
                      for r in range(rounds[c["group"]]))
    assert sorted((s["group"], s["contender"], s["round"]) for s in kept["samples"]) == expected  # every job
    for sample in kept["samples"]:
        record = sample["record"]
        assert positive(sample["job_seconds"]) and ("step_seconds" in record or "seconds" in record
                                                    or "phases" in record), sample
        if "step_seconds" in record:
            assert len(record["step_seconds"]) == 2 and all(positive(t) for t in record["step_seconds"])
    orders = kept["orders"]["torch/cnn np=2 gloo"]  # the two rounds ran the five contenders in different orders
    assert len(orders) == 2 and sorted(orders[0]) == sorted(orders[1]) and orders[0] != orders[1], orders
    assert [s["contender"] for s in kept["samples"] if s["group"] == "torch/cnn np=2 gloo"] == orders[0] + orders[1]
    settings = {label: (c["impl"], c["settings"]) for label, c in kept["contenders"].items()}
    for peer in ("horovod", "ddp", "mwms", "mpi4py", "torchdist"):
        assert {s for impl, s in settings.values() if impl == peer} == {"defaults", "like-for-like"}, peer
    for label, c in kept["contenders"].items():
        if c["settings"] == "defaults":  # as shipped: none of hvdp run's variables
            assert not any(k.startswith("HOROVOD_") or k.startswith("MALLOC_") for k in c["env"]), label
        if c["impl"] == "hvdp":  # under hvdp run, which sets its own
            assert c["argv"][1] == "run" and c["set_by_hvdp_run"], label
    assert kept["summary"]["groups"] == data["groups"]


def test_allreduce_sweep_and_breakdown_have_every_contender_and_size(smoke):
    _, data, _, _ = smoke
    sweep = data["allreduce"]
    assert sweep["bytes"] == [4096, 64 << 20] and sorted(sweep["impls"]) == sorted(SWEEP)
    for label, figures in sweep["impls"].items():
        assert all(positive(s) for s in figures["seconds"]) and all(positive(b) for b in figures["algbw_GBps"]), \
            label
    runs = data["breakdown"]["runs"]
    assert [run["controller"] for run in runs] == ["gloo"], runs
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
    stdout, data, _, _ = smoke
    group = next(g for g in data["groups"] if g["name"] == "sharded torch/cnn")
    figures = group["contenders"]
    for label, fig in figures.items():
        assert len(fig["state_bytes_per_rank"]) == fig["np"] == len(fig["peak_rss_bytes_per_rank"]), label
        assert all(positive(b) for b in fig["state_bytes_per_rank"] + fig["peak_rss_bytes_per_rank"]), label
    whole = figures["hvdp torch/cnn adam np=2"]["state_bytes_per_rank"]
    sharded = figures["hvdp sharded torch/cnn adam np=2"]["state_bytes_per_rank"]
    assert whole[0] == whole[1] and all(abs(b - whole[0] / 2) <= 64 for b in sharded), (whole, sharded)
    for settings in ("defaults", "like for like"):
        zero = figures[f"ddp ZeroRedundancyOptimizer torch/cnn adam np=2 [{settings}]"]["state_bytes_per_rank"]
        assert abs(sum(zero) - whole[0]) <= 256, (zero, whole)
    keras = next(g for g in data["groups"] if g["name"] == "sharded tensorflow/cnn")["contenders"]
    whole = keras["hvdp tensorflow/cnn adam np=2"]["state_bytes_per_rank"]  # Keras's Adam: its moments, step, rate
    sharded = keras["hvdp sharded tensorflow/cnn adam np=2"]["state_bytes_per_rank"]
    assert whole[0] == whole[1] and all(abs(b - whole[0] / 2) <= 64 for b in sharded), (whole, sharded)
    assert "optimizer state MB per rank" in stdout


def test_targets_table_and_plot(smoke):
    stdout, data, png, _ = smoke
    assert png[:4] == b"\x89PNG"
    measured = {t["name"] for t in data["targets"] if t["value"] is not None}
    assert measured == MEASURED
    numbers = list(_numbers({"groups": data["groups"], "targets": [t["value"] for t in data["targets"]
                                                                    if t["value"] is not None]}))
    assert numbers and all(math.isfinite(n) and n > 0 for n in numbers
                           if not isinstance(n, int) or n > 0), numbers
    assert "targets" in stdout and "hvdp bench smoke" in stdout and "[like for like]" in stdout
