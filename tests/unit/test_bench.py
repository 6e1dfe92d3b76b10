"""hvdp bench's pure parts: statistics, ratios, bandwidth formulas, the plan, the table, JSON, bad options."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hvdp import bench, cli
from hvdp.bench import BenchError, Contender, Group, Settings


def test_median_ratio_and_bandwidths():
    assert bench.median([0.3, 0.1, 0.2, 10.0]) == pytest.approx(0.25)
    assert bench.ratio(0.09, 0.1) == pytest.approx(0.9)
    assert bench.algbw(64 << 20, 0.1) == pytest.approx((64 << 20) / 0.1)
    # busbw = algbw * 2 (n - 1) / n: equal to algbw at n=2, 1.5x at n=4, 0 at n=1.
    assert bench.busbw(1.0e9, 2) == pytest.approx(1.0e9)
    assert bench.busbw(1.0e9, 4) == pytest.approx(1.5e9)
    assert bench.busbw(1.0e9, 1) == 0.0
    assert bench.efficiency(100.0, 180.0) == pytest.approx(0.9)


@pytest.mark.parametrize("call", [lambda: bench.median([]), lambda: bench.ratio(1.0, 0.0),
                                  lambda: bench.ratio(math.inf, 1.0), lambda: bench.algbw(4096, 0.0),
                                  lambda: bench.busbw(1.0, 0), lambda: bench.efficiency(0.0, 1.0)])
def test_bad_figures_raise(call):
    with pytest.raises(BenchError):
        call()


def test_sections_and_settings():
    assert bench.parse_sections(None) == bench.SECTIONS
    assert bench.parse_sections(" scaling, native ") == ("native", "scaling")
    with pytest.raises(BenchError, match="'speed'.*overhead, native, allreduce, scaling"):
        bench.parse_sections("native,speed")
    with pytest.raises(BenchError, match="--rounds 0 must be at least 1"):
        bench.make_settings(True, 0, None, None, None)
    with pytest.raises(BenchError, match="--steps -3"):
        bench.make_settings(False, None, -3, None, None)
    with pytest.raises(BenchError, match="--warmup -1"):
        bench.make_settings(False, None, None, -1, None)
    quick, full = bench.make_settings(True, None, None, None, None), bench.make_settings(False, 5, None, 0, None)
    assert quick.mode == "quick" and full.rounds == 5 and full.warmup == 0 and full.steps > quick.steps


def test_smoke_runs_every_quick_contender_once_at_a_few_steps():
    """--smoke: the quick plan's groups and contenders, one round, 3 steps, the sweep's two ends."""
    smoke, quick = (bench.make_settings(q, None, None, None, None, smoke=not q) for q in (False, True))
    assert (smoke.mode, smoke.rounds, smoke.steps, smoke.warmup) == ("smoke", 1, 3, 1)
    assert smoke.sweep_bytes == (4096, 64 << 20) and smoke.breakdown_calls < quick.breakdown_calls
    labels = [[c.label for c in g.contenders] for g in bench.plan(smoke)]
    assert labels == [[c.label for c in g.contenders] for g in bench.plan(quick)] and len(labels) == 7
    assert bench.make_settings(False, None, 5, None, None, smoke=True).steps == 5  # overrides still apply


def test_unwritable_json_path_is_refused(tmp_path):
    with pytest.raises(BenchError, match="--json '/nonexistent/dir/b.json' cannot be written"):
        bench.check_writable("/nonexistent/dir/b.json", "--json")
    with pytest.raises(BenchError, match="cannot be written"):
        bench.check_writable(str(tmp_path), "--json")
    bench.check_writable(str(tmp_path / "ok.json"), "--json")


def test_cli_reports_bad_options(capsys):
    assert cli.main(["bench", "--only", "bogus"]) == 2
    assert "unknown section 'bogus'" in capsys.readouterr().err
    assert cli.main(["bench", "--rounds", "0"]) == 2
    assert "--rounds 0 must be at least 1" in capsys.readouterr().err


def test_quick_plan_touches_every_section_and_alternates():
    groups = bench.plan(bench.make_settings(True, None, None, None, None))
    impls = {c.impl for g in groups for c in g.contenders}
    assert {"hvdp", "horovod", "ddp", "mwms", "mpi4py", "torchdist"} <= impls
    assert any(g.name.startswith("scaling") for g in groups) and any(g.name == "allreduce" for g in groups)
    torch_cnn = next(g for g in groups if g.name == "torch/cnn np=2 gloo")
    assert [c.env for c in torch_cnn.contenders if c.impl == "hvdp"] == [
        {}, {"HVDP_EARLY_WAKE": "0"}, {"HVDP_GRADIENT_PATH": "horovod"}]  # torch's gradient path, before and after
    tensorflow_cnn = next(g for g in groups if g.name == "tensorflow/cnn np=2 gloo")
    assert [c.env for c in tensorflow_cnn.contenders if c.impl == "hvdp"] == [{}, {"HVDP_EARLY_WAKE": "0"}]
    assert [c.env for c in torch_cnn.contenders if c.impl == "ddp"] == [{}, dict(bench.ALLOCATOR_SETTINGS)]
    sharded = next(g for g in groups if g.name == "sharded torch/cnn")
    assert [(c.impl, c.np, c.shard, c.optimizer) for c in sharded.contenders] == [
        (impl, n, shard, "adam") for n in (1, 2) for impl, shard in (("hvdp", False), ("hvdp", True), ("ddp", True))]
    keras = next(g for g in groups if g.name == "sharded tensorflow/cnn")  # a Keras optimizer: no peer shards one
    assert [(c.impl, c.framework, c.np, c.shard) for c in keras.contenders] == [
        ("hvdp", "tensorflow", n, shard) for n in (1, 2) for shard in (False, True)]
    sweep = next(g for g in groups if g.name == "allreduce")
    assert [c.form for c in sweep.contenders if c.impl == "hvdp"] == ["new", "out"]
    only = bench.plan(bench.make_settings(True, None, None, None, "native"))
    assert all({c.impl for c in g.contenders} <= {"hvdp", "ddp", "mwms"} for g in only)
    full = bench.plan(bench.make_settings(False, None, None, None, None))
    names = {g.name for g in full}
    full_cnn = next(g for g in full if g.name == "torch/cnn np=2 gloo")
    for model in ("cnn", "mlp", "resnet18"):  # TensorFlow's gradient path both ways, in the full run
        group = next(g for g in full if g.name == f"tensorflow/{model} np=2 gloo")
        assert {"HVDP_GRADIENT_PATH": "horovod"} in [c.env for c in group.contenders if c.impl == "hvdp"], model
    assert [c.env for c in full_cnn.contenders if c.impl == "ddp"] == [{}, dict(bench.ALLOCATOR_SETTINGS)]
    assert {"torch/cnn np=1 mpi", "tensorflow/resnet18 np=2 gloo", "scaling torch/resnet18"} <= names

    order = []
    settings = Settings(rounds=2)

    def fake(contender, settings_, workdir, environ, cpus):
        order.append(contender.label)
        return {"rank": 0, "size": contender.np, "batch": 32, "step_seconds": [0.1]}

    group = Group("g", [Contender("A", "hvdp"), Contender("B", "horovod")])
    bench.run_groups([group], settings, {}, 2, lambda line: None, runner=fake)
    assert order == ["A", "B", "A", "B"]


@pytest.mark.parametrize("mode, hangs, outcome", [("smoke", 1, "retried"), ("smoke", 2, "fails"),
                                                  ("quick", 1, "fails")])
def test_a_smoke_run_starts_a_hung_contender_once_more_and_a_measuring_run_never(mode, hangs, outcome):
    calls, lines = [], []

    def hanging(contender, settings_, workdir, environ, cpus):
        calls.append(contender.label)
        if len(calls) <= hangs:
            raise BenchError(f"{contender.label}: the job was still running after 180 s, so it was stopped")
        return {"rank": 0, "size": 2, "batch": 32, "step_seconds": [0.1]}

    group = Group("g", [Contender("A", "ddp")])
    settings = Settings(mode=mode, rounds=1)
    if outcome == "fails":
        with pytest.raises(BenchError, match="still running after 180 s"):
            bench.run_groups([group], settings, {}, 2, lines.append, runner=hanging)
        assert calls == ["A"] * min(hangs, 2 if mode == "smoke" else 1)
    else:
        bench.run_groups([group], settings, {}, 2, lines.append, runner=hanging)
        assert calls == ["A", "A"] and len(group.runs["A"]) == 1
        assert "still running after 180 s" in lines[0] and "A: hung; starting it once more" in lines[0]


@pytest.mark.parametrize("mode, most", [("smoke", bench.SMOKE_JOBS_AT_ONCE), ("quick", 1)])
def test_a_smoke_run_keeps_two_jobs_going_and_records_them_in_plan_order(mode, most):
    """--smoke measures nothing, so its jobs overlap (two at a time); every other mode runs one at a time."""
    import threading
    import time

    running, peak, lock = [0], [0], threading.Lock()

    def fake(contender, settings_, workdir, environ, cpus):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05 if contender.label == "A" else 0.01)  # A ends after B: the record order must not follow
        with lock:
            running[0] -= 1
        return {"rank": 0, "size": contender.np, "batch": 32, "step_seconds": [0.1], "who": contender.label}

    groups = [Group("g", [Contender("A", "hvdp"), Contender("B", "horovod")]), Group("h", [Contender("C", "ddp")])]
    bench.run_groups(groups, Settings(mode=mode, rounds=2), {}, 2, lambda line: None, runner=fake)
    assert peak[0] == most
    assert {label: [r["who"] for r in runs] for g in groups for label, runs in g.runs.items()} == \
        {"A": ["A", "A"], "B": ["B", "B"], "C": ["C", "C"]}
    assert list(groups[0].runs) == ["A", "B"]


def test_job_commands_use_hvdp_launcher_and_identical_knobs(monkeypatch):
    from hvdp import launch

    monkeypatch.setattr(launch, "horovodrun_path", lambda: "horovodrun")
    settings = Settings()
    environ = {"PATH": "/usr/bin:/bin", "HVDP_FRAMEWORK": "tensorflow"}
    hv, env_hv, _ = bench.job(Contender("h", "hvdp"), settings, "/o.json", environ, 2)
    same, env_same, _ = bench.job(Contender("s", "horovod", knobs="hvdp"), settings, "/o.json", environ, 2)
    plain, env_plain, _ = bench.job(Contender("p", "horovod", knobs="threads"), settings, "/o.json", environ, 2)
    assert hv[0][:4] == ["horovodrun", "-np", "2", "--gloo"] and "--impl" in hv[0]
    assert same[0][:4] == ["horovodrun", "-np", "2", "--gloo"]
    hvdp_set = {k: v for k, v in env_hv.items() if k not in environ}
    assert all(env_same.get(k) == v for k, v in hvdp_set.items())
    assert env_plain["OMP_NUM_THREADS"] == env_hv["OMP_NUM_THREADS"] == "1"
    assert not any(k.startswith("HOROVOD_") for k in env_plain)
    ddp, _, _ = bench.job(Contender("d", "ddp"), settings, "/o.json", environ, 2)
    assert ddp[0][1:4] == ["-m", "torch.distributed.run", "--standalone"]  # torchrun binds its own free port
    assert "--master_port" not in ddp[0]
    mw, env_mw, per = bench.job(Contender("m", "mwms", "tensorflow"), settings, "/o.json", environ, 2)
    assert len(mw) == 2 and [json.loads(p["TF_CONFIG"])["task"]["index"] for p in per] == [0, 1]
    assert env_mw["KERAS_BACKEND"] == "tensorflow"
    one, env_one, _ = bench.job(Contender("1", "hvdp", np=1, knobs="one-thread"), settings, "/o.json", environ, 2)
    assert env_one["OMP_NUM_THREADS"] == "1" and one[0][2] == "1"


def test_a_job_past_its_time_prints_its_stacks_and_is_killed_with_the_processes_below_it(tmp_path):
    """wait_all: a finished job's code; for one still running, None, and it and its child (in a session of
    its own, as torchrun's workers are) print their Python stacks and are gone."""
    import subprocess
    import sys
    import time

    import psutil

    from hvdp.bench import runner

    parent = ("import subprocess, sys, time\n"
              "subprocess.Popen([sys.executable, '-c', 'import time\\ndef child_waits():\\n    time.sleep(600)\\n"
              "child_waits()'], start_new_session=True)\n"
              "def parent_waits():\n    time.sleep(600)\nparent_waits()\n")
    log = tmp_path / "log"
    env = {"PATH": "/usr/bin:/bin", "PYTHONFAULTHANDLER": "1"}
    with open(log, "w") as out:
        quick = subprocess.Popen([sys.executable, "-c", "pass"], stdout=out, stderr=subprocess.STDOUT, env=env)
        slow = subprocess.Popen([sys.executable, "-c", parent], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        time.sleep(1.5)  # the child has started
        child = psutil.Process(slow.pid).children()[0]
        start = time.monotonic()
        codes = runner.wait_all([quick, slow], limit=0.5)
    assert codes == [0, None]
    assert time.monotonic() - start < runner.STACKS_GRACE_S + 3
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    text = log.read_text()
    assert "parent_waits" in text and "child_waits" in text, text


def _fake_results():
    settings = Settings(rounds=2)
    groups = [
        Group("torch/cnn np=2 gloo", [Contender("hvdp", "hvdp"), Contender("same", "horovod"),
                                      Contender("plain", "horovod", knobs="threads"), Contender("ddp", "ddp",
                                                                                                 knobs="threads"),
                                      Contender("nowake", "hvdp", env={"HVDP_EARLY_WAKE": "0"}),
                                      Contender("ddpm", "ddp", knobs="threads", env=dict(bench.ALLOCATOR_SETTINGS))]),
        Group("scaling torch/resnet18", [Contender("n1", "hvdp", np=1, knobs="one-thread", model="resnet18"),
                                         Contender("n2", "hvdp", np=2, knobs="one-thread", model="resnet18"),
                                         Contender("d1", "ddp", np=1, knobs="one-thread", model="resnet18"),
                                         Contender("d2", "ddp", np=2, knobs="one-thread", model="resnet18")]),
        Group("allreduce", [Contender("hvdp.allreduce (gloo)", "hvdp", task="allreduce"),
                            Contender("hvdp.allreduce out= (gloo)", "hvdp", task="allreduce", form="out"),
                            Contender("hvdp.allreduce out= (mpi)", "hvdp", controller="mpi", task="allreduce",
                                      form="out"),
                            Contender("mpi4py Allreduce", "mpi4py", task="allreduce"),
                            Contender("torch.distributed all_reduce (gloo)", "torchdist", task="allreduce")]),
    ]
    steps = {"hvdp": 0.09, "same": 0.09, "plain": 0.1, "ddp": 0.095, "n1": 0.1, "n2": 0.105,
             "nowake": 0.1, "ddpm": 0.08, "d1": 0.1, "d2": 0.11}
    for group in groups:
        for c in group.contenders:
            if c.task == "allreduce":
                factor = 1.0 if c.impl == "hvdp" else 0.5
                record = {"size": 2, "seconds": {str(n): [factor * n / 1e9 * k for k in (0.9, 1.0, 1.1)]
                                                 for n in bench.SWEEP_BYTES}}
            else:
                record = {"size": c.np, "step_seconds": [steps[c.label]] * 5}
            group.runs[c.label] = [record, record]
    return bench.summarize(groups, settings)


def test_summary_ratios_targets_table_and_json():
    results = _fake_results()
    torch_group = results["groups"][0]
    assert torch_group["ratios"] == pytest.approx({"hvdp/horovod same knobs": 1.0, "hvdp/horovod defaults": 0.9,
                                                   "hvdp/ddp": 0.09 / 0.095, "hvdp/hvdp HVDP_EARLY_WAKE=0": 0.9,
                                                   "hvdp/ddp same malloc": 0.09 / 0.08})
    assert results["scaling"]["efficiency"] == pytest.approx((2 * 32 / 0.105) / (2 * 32 / 0.1))
    sweep = results["allreduce"]["impls"]
    assert sweep["hvdp.allreduce (gloo)"]["algbw_GBps"][-1] == pytest.approx(1.0)
    assert sweep["mpi4py Allreduce"]["busbw_GBps"][-1] == pytest.approx(2.0)
    status = {t["name"]: (t["status"], t["value"]) for t in results["targets"]}
    assert status["hvdp/DDP step time, same allocator settings, torch (worst model)"] == (
        "MISS", pytest.approx(0.09 / 0.08))  # like for like: the DDP run given hvdp's allocator settings
    assert status["hvdp.allreduce out= algbw at 64 MB / mpi4py, under MPI"] == ("MISS", pytest.approx(0.5))
    assert status["hvdp.allreduce out= algbw at 64 MB / torch.distributed, under Gloo"] == ("MISS",
                                                                                          pytest.approx(0.5))
    assert status["hvdp.allreduce usual call algbw at 64 MB / torch.distributed, under Gloo"] == (
        "MISS", pytest.approx(0.5))
    assert status["hvdp.allreduce usual call algbw at 64 MB / mpi4py, under MPI"] == ("n/a", None)
    assert status["hvdp.allreduce latency at 4 KB / torch.distributed, under Gloo"] == ("MISS", pytest.approx(2.0))
    assert results["allreduce"]["bytes"][-1] == 256 << 20
    low, high = sweep["hvdp.allreduce (gloo)"]["spread_seconds"][0]
    assert low == pytest.approx(0.925 * 4096 / 1e9) and high == pytest.approx(1.075 * 4096 / 1e9)
    assert results["scaling"]["ddp"]["efficiency"] == pytest.approx(0.1 / 0.11)
    assert status["scaling efficiency 1->2 processes (resnet18), hvdp's / DDP's"] == (
        "PASS", pytest.approx((0.1 / 0.105) / (0.1 / 0.11)))
    assert status["hvdp/MultiWorkerMirrored step time, same allocator settings, tensorflow (worst model)"] == (
        "n/a", None)
    table = bench.format_table(results)
    assert "ratio hvdp/horovod defaults" in table and "PASS" in table and "MISS" in table and "64 MB" in table
    assert json.loads(json.dumps(results)) == results


def test_sharded_section_ratios_memory_and_targets():
    """Per np: sharded step over unsharded's and ZeroRedundancyOptimizer's; the largest state and peak RSS per
    rank over unsharded's; the table prints every rank's memory."""
    people = [Contender(f"{who} np={n}", impl, np=n, knobs="one-thread", optimizer="adam", shard=shard)
              for n in (1, 2) for who, impl, shard in (("hvdp", "hvdp", False), ("sharded", "hvdp", True),
                                                       ("zero", "ddp", True))]
    group = Group("sharded torch/cnn", people)
    steps = {"hvdp": 0.1, "sharded": 0.102, "zero": 0.11}
    state = {("hvdp", 2): [400, 400], ("sharded", 2): [200, 200], ("zero", 2): [360, 40]}
    for c in people:
        who, n = c.label.split()[0], c.np
        record = {"size": n, "step_seconds": [steps[who]] * 3,
                  "memory": {"state_bytes": state.get((who, n), [400]), "peak_rss_bytes": [2 ** 30] * n}}
        group.runs[c.label] = [record, record]
    results = bench.summarize([group], Settings(rounds=2))
    ratios = results["groups"][0]["ratios"]
    assert ratios == pytest.approx({
        "sharded/unsharded step np=1": 1.02, "sharded/ZeroRedundancyOptimizer step np=1": 0.102 / 0.11,
        "state per rank sharded/unsharded np=1": 1.0, "peak RSS per rank sharded/unsharded np=1": 1.0,
        "sharded/unsharded step np=2": 1.02, "sharded/ZeroRedundancyOptimizer step np=2": 0.102 / 0.11,
        "state per rank sharded/unsharded np=2": 0.5, "peak RSS per rank sharded/unsharded np=2": 1.0})
    status = {t["name"]: (t["status"], t["value"]) for t in results["targets"]}
    assert status["sharded Adam state per rank / unsharded, np=2 (worst model)"] == ("PASS", pytest.approx(0.5))
    assert status["sharded/unsharded step time, Adam np=2 (worst model)"] == ("PASS", pytest.approx(1.02))
    assert status["sharded/ZeroRedundancyOptimizer step time, Adam np=2 (worst model)"][0] == "PASS"
    assert "optimizer state MB per rank: 0.00 0.00; peak RSS MB per rank: 1024 1024" in bench.format_table(results)


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    bench.plot(_fake_results(), str(path))
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_target_status():
    assert bench.Target("x", 1.0, "<=", 1.0).status == "PASS"
    assert bench.Target("x", 1.0, "<", 1.0).status == "MISS"
    assert bench.Target("x", None, ">=", 0.9).status == "n/a"
    assert Path(bench.__file__).parent.joinpath("worker.py").exists()


def test_each_framework_builds_the_models_in_its_bench_module():
    from hvdp.bench import models, per_framework
    from hvdp.frameworks import SPECS

    assert per_framework.MODULES == {"torch": "hvdp.bench.torch_bench", "tensorflow": "hvdp.bench.tensorflow_bench"}
    assert list(per_framework.MODULES) == list(SPECS)
    sizes = {name: sum(p.numel() for p in per_framework.build("torch", name).parameters()) for name in models.MODELS}
    assert sizes == {"cnn": 582026, "mlp": 513162, "resnet18": 11181642}  # 0.6 M, 0.5 M, 11.2 M as documented
    with pytest.raises(ValueError, match="Unknown model 'vgg'. Expected one of: cnn, mlp, resnet18."):
        per_framework.build("torch", "vgg")
    with pytest.raises(BenchError, match="no framework 'jax'; expected one of: torch, tensorflow"):
        per_framework.load("jax")
