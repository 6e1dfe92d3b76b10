"""hvdp bench's pure parts: statistics, ratios, bandwidth formulas, the plan, the table, JSON, bad options."""

from __future__ import annotations

import json
import math
import sys
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
    assert quick.mode == "quick" and full.rounds == 5 and full.warmup == 0


@pytest.mark.parametrize("quick", [True, False])
def test_every_measuring_run_takes_three_rounds_or_more_and_covers_the_drift_guard(quick):
    """A figure is a median with its range: at least 3 rounds, --quick included (fewer is refused). The
    measured steps hold one interval of the drift guard (hvdp.consistency's default), so its check is paid."""
    from hvdp.consistency import DEFAULT_CHECK_EVERY

    settings = bench.make_settings(quick, None, None, None, None)
    assert settings.rounds >= 3 == bench.MIN_ROUNDS
    first, last = settings.warmup + 1, settings.warmup + settings.steps
    assert settings.steps >= DEFAULT_CHECK_EVERY and any(s % DEFAULT_CHECK_EVERY == 0 for s in range(first, last + 1))
    assert bench.notes(settings) == []
    for rounds in (1, 2):
        with pytest.raises(BenchError, match=f"--rounds {rounds}: every figure is a median with its range over at "
                                             f"least 3 rounds; give --rounds 3 or more"):
            bench.make_settings(quick, rounds, None, None, None)
    short = bench.make_settings(quick, None, 20, None, None)
    assert "the drift guard runs every 100 steps" in bench.notes(short)[0]
    groups = bench.plan(settings)  # every group, the allreduce sweep and the breakdown included, runs every round
    assert all(g.rounds is None for g in groups)
    bench.run_groups(groups, settings, {}, 2, lambda line: None, runner=_fake_runner)
    assert {len(runs) for g in groups for runs in g.runs.values()} == {settings.rounds}


def test_smoke_runs_every_peer_both_ways_and_every_task_of_the_quick_plan_at_a_few_steps():
    """--smoke: every implementation of the quick plan under each of its settings and every task, 2 steps, the
    sweep's two ends; the torch comparison over 2 shuffled rounds, the rest once; hvdp's variants left out."""
    smoke, quick = (bench.make_settings(q, None, None, None, None, smoke=not q) for q in (False, True))
    assert (smoke.mode, smoke.rounds, smoke.steps, smoke.warmup) == ("smoke", 2, 2, 1)
    assert smoke.sweep_bytes == (4096, 64 << 20) and smoke.breakdown_calls < quick.breakdown_calls

    def kinds(groups):
        return {(c.impl, c.framework, c.task, c.settings, c.shard) for g in groups for c in g.contenders
                if c.knobs != "one-thread" or c.shard or c.impl != "hvdp"}

    smoke_plan, quick_plan = bench.plan(smoke), bench.plan(quick)
    assert {c.label for g in smoke_plan for c in g.contenders} <= {c.label for g in quick_plan for c in g.contenders}
    assert kinds(smoke_plan) == kinds(quick_plan)
    assert [(g.name, g.rounds) for g in smoke_plan] == [
        ("torch/cnn np=2 gloo", None), ("tensorflow/cnn np=2 gloo", 1), ("allreduce", 1), ("breakdown", 1),
        ("sharded torch/cnn", 1), ("sharded tensorflow/cnn", 1)]
    assert sum(len(g.contenders) * (g.rounds or smoke.rounds) for g in smoke_plan) == 27  # jobs
    assert bench.make_settings(False, None, 5, None, None, smoke=True).steps == 5  # overrides still apply


def _fake_runner(contender, settings_, workdir, environ, cpus):
    if contender.task == "allreduce":
        return {"rank": 0, "size": 2, "seconds": {"4096": [1e-4]}}
    if contender.task == "breakdown":
        return {"controller": contender.controller, "size": 2, "phases": {"hvdp.allreduce": {}}, "faults": {},
                "env": {}}
    return {"rank": 0, "size": contender.np, "batch": 32, "step_seconds": [0.1], "who": contender.label}


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


def test_quick_plan_touches_every_section_and_pairs_every_peer():
    groups = bench.plan(bench.make_settings(True, None, None, None, None))
    impls = {c.impl for g in groups for c in g.contenders}
    assert {"hvdp", "horovod", "ddp", "mwms", "mpi4py", "torchdist"} <= impls
    assert any(g.name.startswith("scaling") for g in groups) and any(g.name == "allreduce" for g in groups)
    torch_cnn = next(g for g in groups if g.name == "torch/cnn np=2 gloo")
    assert [c.env for c in torch_cnn.contenders if c.impl == "hvdp"] == [
        {}, {"HVDP_EARLY_WAKE": "0"}, {"HVDP_GRADIENT_PATH": "horovod"}]  # torch's gradient path, before and after
    tensorflow_cnn = next(g for g in groups if g.name == "tensorflow/cnn np=2 gloo")
    assert [c.env for c in tensorflow_cnn.contenders if c.impl == "hvdp"] == [{}, {"HVDP_EARLY_WAKE": "0"}]
    sharded = next(g for g in groups if g.name == "sharded torch/cnn")
    assert [(c.impl, c.np, c.shard, c.settings) for c in sharded.contenders] == [
        (impl, n, shard, settings) for n in (1, 2) for impl, shard, settings in (
            ("hvdp", False, "hvdp"), ("hvdp", True, "hvdp"), ("ddp", True, "defaults"), ("ddp", True, "like-for-like"))]
    keras = next(g for g in groups if g.name == "sharded tensorflow/cnn")  # a Keras optimizer: no peer shards one
    assert [(c.impl, c.framework, c.np, c.shard) for c in keras.contenders] == [
        ("hvdp", "tensorflow", n, shard) for n in (1, 2) for shard in (False, True)]
    sweep = next(g for g in groups if g.name == "allreduce")
    assert [c.form for c in sweep.contenders if c.impl == "hvdp"] == ["new", "out"]
    only = bench.plan(bench.make_settings(True, None, None, None, "native"))
    assert all({c.impl for c in g.contenders} <= {"hvdp", "ddp", "mwms"} for g in only)
    full = bench.plan(bench.make_settings(False, None, None, None, None))
    names = {g.name for g in full}
    for model in ("cnn", "mlp", "resnet18"):  # TensorFlow's gradient path both ways, in the full run
        group = next(g for g in full if g.name == f"tensorflow/{model} np=2 gloo")
        assert {"HVDP_GRADIENT_PATH": "horovod"} in [c.env for c in group.contenders if c.impl == "hvdp"], model
    assert {"torch/cnn np=1 mpi", "tensorflow/resnet18 np=2 gloo", "scaling torch/resnet18"} <= names
    for plan_ in (groups, full):  # every peer twice in its group: as shipped, and like for like
        for group in plan_:
            # (the scaling section's DDP runs like hvdp there, one thread per rank: like for like only)
            peers = [c for c in group.contenders if c.impl != "hvdp" and not group.name.startswith("scaling")]
            pairs: dict = {}
            for c in peers:
                pairs.setdefault((c.impl, c.np, c.controller, c.task, c.shard), []).append(c.settings)
            assert all(sorted(s) == ["defaults", "like-for-like"] for s in pairs.values()), (group.name, pairs)
            assert all(c.label.endswith(("[defaults]", "[like for like]")) for c in peers), group.name
    assert {(c.impl, c.settings) for g in groups for c in g.contenders if c.impl in ("horovod", "ddp", "mwms")} == {
        (impl, s) for impl in ("horovod", "ddp", "mwms") for s in ("defaults", "like-for-like")}


def test_every_contender_of_a_group_does_the_same_work_per_step():
    """No contender's timed step makes a collective more than the others: every torch contender runs the one
    step function, and TensorFlow's MultiWorkerMirroredStrategy step only runs the replica step (its loss
    stays local, as hvdp's and Horovod's: no strategy.reduce of it across workers)."""
    import ast
    import inspect

    from hvdp.bench import tensorflow_bench, torch_bench

    def calls(function, owner):
        tree = ast.parse(inspect.getsource(function))
        return sorted({n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call)
                       and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                       and n.func.value.id == owner})

    assert calls(tensorflow_bench.train, "strategy") == ["experimental_local_results", "run", "scope"]
    source = inspect.getsource(tensorflow_bench.train)
    assert "ReduceOp" not in source and "all_reduce" not in source
    tree = ast.parse(inspect.getsource(torch_bench.train))
    steps = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "step"]
    assert len(steps) == 1  # one step for hvdp, Horovod, DDP and the single process alike
    called = {n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id for n in ast.walk(steps[0])
              if isinstance(n, ast.Call)}
    assert called == {"zero_grad", "cross_entropy", "model", "backward", "step"}, called  # the reduce: in backward


def test_contenders_are_shuffled_per_round_from_the_recorded_seed_and_every_sample_is_kept():
    people = [Contender(label, "hvdp") for label in "ABCD"]
    settings = Settings(rounds=4, seed=7)
    order, lines = [], []

    def fake(contender, settings_, workdir, environ, cpus):
        order.append(contender.label)
        return {"rank": 0, "size": 2, "batch": 32, "step_seconds": [0.1 * (len(order))]}

    group = Group("g", people)
    bench.run_groups([group], settings, {}, 2, lines.append, runner=fake)
    rounds = [order[i:i + 4] for i in range(0, 16, 4)]
    assert group.orders == rounds and all(sorted(r) == list("ABCD") for r in rounds)
    assert all(a != b for a, b in zip(rounds, rounds[1:]))  # no round repeats the one before
    assert rounds != [list("ABCD")] * 4
    again = Group("g", people)
    bench.run_groups([again], Settings(rounds=4, seed=7), {}, 2, lambda line: None, runner=fake)
    assert again.orders == rounds  # the seed gives the orders back
    assert [(s["round"], s["place"], s["contender"]) for s in group.samples] == [
        (r, p, label) for r, labels in enumerate(rounds) for p, label in enumerate(labels)]
    for label in "ABCD":  # each contender's records in round order, whatever its place
        assert group.runs[label] == [s["record"] for s in group.samples if s["contender"] == label]
    assert [[c.label for c in o] for o in bench.round_orders(people[:1], 3, __import__("random").Random(0))] == \
        [["A"]] * 3


def test_ratio_spread_is_taken_round_by_round():
    spread = bench.ratio_spread([0.09, 0.12, 0.10], [0.10, 0.10, 0.08])
    assert spread["per_round"] == pytest.approx([0.9, 1.2, 1.25])
    assert (spread["median"], spread["low"], spread["high"], spread["rounds"]) == (pytest.approx(1.2),
                                                                                  pytest.approx(0.9),
                                                                                  pytest.approx(1.25), 3)
    with pytest.raises(BenchError, match="both contenders in every round: 3 and 2"):
        bench.ratio_spread([1.0, 1.0, 1.0], [1.0, 1.0])
    assert bench.mean_step({"step_seconds": [0.1, 0.1, 0.1, 0.5]}) == pytest.approx(0.2)  # the periodic step counts


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
def test_a_smoke_run_keeps_two_jobs_going_and_records_each_contenders_rounds(mode, most):
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


def test_job_commands_start_hvdp_under_hvdp_run_and_peers_as_shipped_or_like_for_like(monkeypatch):
    from hvdp import launch

    monkeypatch.setattr(launch, "horovodrun_path", lambda: "/venv/bin/horovodrun")
    settings = Settings()
    environ = {"PATH": "/usr/bin:/bin", "HVDP_FRAMEWORK": "tensorflow"}
    hv, env_hv, _ = bench.job(Contender("h", "hvdp"), settings, "/o.json", environ, 2)
    same, env_same, _ = bench.job(Contender("s", "horovod", knobs="hvdp"), settings, "/o.json", environ, 2)
    plain, env_plain, _ = bench.job(Contender("p", "horovod", knobs="defaults"), settings, "/o.json", environ, 2)
    # hvdp as its users start it: hvdp run (its bootstrap, relay and heartbeat), which sets its own variables
    assert hv[0][:8] == [*bench.runner.hvdp_command(), "run", "-np", "2", "--gloo", "--framework", "torch",
                         sys.executable]
    assert hv[0][0].endswith("/hvdp") and hv[0][8:11] == ["-m", "hvdp.bench.worker", "train"] and "--impl" in hv[0]
    assert not any(k.startswith(("HOROVOD_", "MALLOC_")) or k == "OMP_NUM_THREADS" for k in env_hv)
    # Horovod's own command line (its build check cached, as hvdp run starts it), like for like or as shipped
    assert same[0][1:6] == ["-m", "hvdp.launch.horovodrun", "-np", "2", "--gloo"]
    _, hvdp_set = bench.hvdp_env(Contender("h", "hvdp"), {"PATH": "/usr/bin:/bin"}, 2)
    assert {"HOROVOD_CYCLE_TIME", "MALLOC_MMAP_THRESHOLD_", "OMP_NUM_THREADS"} <= set(hvdp_set)
    assert all(env_same.get(k) == v for k, v in hvdp_set.items())
    assert not any(k in env_plain for k in hvdp_set), env_plain  # none of hvdp's: Horovod's defaults
    ddp, env_ddp, _ = bench.job(Contender("d", "ddp", knobs="defaults"), settings, "/o.json", environ, 2)
    assert ddp[0][1:4] == ["-m", "torch.distributed.run", "--standalone"]  # torchrun binds its own free port
    assert "--master_port" not in ddp[0] and "OMP_NUM_THREADS" not in env_ddp
    mw, env_mw, per = bench.job(Contender("m", "mwms", "tensorflow"), settings, "/o.json", environ, 2)
    assert len(mw) == 2 and [json.loads(p["TF_CONFIG"])["task"]["index"] for p in per] == [0, 1]
    assert env_mw["KERAS_BACKEND"] == "tensorflow" and env_mw["HOROVOD_CYCLE_TIME"] == "5"  # like for like
    one, env_one, _ = bench.job(Contender("1", "hvdp", np=1, knobs="one-thread"), settings, "/o.json", environ, 2)
    assert env_one["OMP_NUM_THREADS"] == "1" and one[0][3] == "1"
    described = bench.runner.describe(Contender("s", "horovod", knobs="hvdp"), settings, environ, 2)
    assert described["settings"] == "like-for-like" and described["env"]["HOROVOD_CYCLE_TIME"] == "5"
    mine = bench.runner.describe(Contender("h", "hvdp"), settings, environ, 2)
    assert mine["settings"] == "hvdp" and mine["set_by_hvdp_run"]["HOROVOD_CYCLE_TIME"] == "5"
    assert "HOROVOD_CYCLE_TIME" not in mine["env"]  # hvdp run sets it, not the bench


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
    settings = Settings(rounds=3)
    groups = [
        Group("torch/cnn np=2 gloo", [Contender("hvdp", "hvdp"), Contender("same", "horovod"),
                                      Contender("plain", "horovod", knobs="defaults"),
                                      Contender("ddp", "ddp", knobs="defaults"),
                                      Contender("nowake", "hvdp", env={"HVDP_EARLY_WAKE": "0"}),
                                      Contender("ddpm", "ddp")]),
        Group("scaling torch/resnet18", [Contender("n1", "hvdp", np=1, knobs="one-thread", model="resnet18"),
                                         Contender("n2", "hvdp", np=2, knobs="one-thread", model="resnet18"),
                                         Contender("d1", "ddp", np=1, knobs="one-thread", model="resnet18"),
                                         Contender("d2", "ddp", np=2, knobs="one-thread", model="resnet18")]),
        Group("allreduce", [Contender("hvdp.allreduce (gloo)", "hvdp", task="allreduce"),
                            Contender("hvdp.allreduce out= (gloo)", "hvdp", task="allreduce", form="out"),
                            Contender("hvdp.allreduce out= (mpi)", "hvdp", controller="mpi", task="allreduce",
                                      form="out"),
                            Contender("mpi4py Allreduce [like for like]", "mpi4py", task="allreduce"),
                            Contender("torch.distributed all_reduce (gloo) [like for like]", "torchdist",
                                      task="allreduce")]),
    ]
    steps = {"hvdp": 0.09, "same": 0.09, "plain": 0.1, "ddp": 0.095, "n1": 0.1, "n2": 0.105,
             "nowake": 0.1, "ddpm": 0.08, "d1": 0.1, "d2": 0.11}
    for group in groups:
        for c in group.contenders:
            records = []
            for r in range(settings.rounds):  # hvdp's second round slower: a ratio with a range
                slow = 1.1 if (r == 1 and c.label == "hvdp") else 1.0
                if c.task == "allreduce":
                    factor = 1.0 if c.impl == "hvdp" else 0.5
                    records.append({"size": 2, "seconds": {str(n): [factor * n / 1e9 * k for k in (0.9, 1.0, 1.1)]
                                                           for n in bench.SWEEP_BYTES}})
                else:  # the 5th step pays a periodic check: the round's figure is the mean step
                    records.append({"size": c.np, "step_seconds": [steps[c.label] * slow] * 4
                                    + [steps[c.label] * slow * 2]})
            group.runs[c.label] = records
    return bench.summarize(groups, settings)


def test_summary_ratios_per_round_with_their_range_targets_table_and_json():
    results = _fake_results()
    torch_group = results["groups"][0]
    assert torch_group["contenders"]["hvdp"]["run_step_seconds"] == pytest.approx([0.108, 0.1188, 0.108])
    assert torch_group["contenders"]["hvdp"]["step_seconds_range"] == pytest.approx([0.108, 0.1188])
    assert torch_group["ratios"] == pytest.approx({
        "hvdp/horovod like-for-like": 1.0, "hvdp/horovod defaults": 0.9, "hvdp/ddp defaults": 0.09 / 0.095,
        "hvdp/hvdp HVDP_EARLY_WAKE=0": 0.9, "hvdp/ddp like-for-like": 0.09 / 0.08})
    spread = torch_group["ratio_spread"]["hvdp/horovod like-for-like"]
    assert spread["per_round"] == pytest.approx([1.0, 1.1, 1.0]) and (spread["low"], spread["high"]) == \
        pytest.approx((1.0, 1.1))
    assert results["scaling"]["efficiency"] == pytest.approx((2 * 32 / 0.126) / (2 * 32 / 0.12))
    sweep = results["allreduce"]["impls"]
    assert sweep["hvdp.allreduce (gloo)"]["algbw_GBps"][-1] == pytest.approx(1.0)
    assert sweep["hvdp.allreduce (gloo)"]["round_seconds"][0] == pytest.approx([4096 / 1e9] * 3)
    assert sweep["mpi4py Allreduce [like for like]"]["busbw_GBps"][-1] == pytest.approx(2.0)
    status = {t["name"]: (t["status"], t["value"]) for t in results["targets"]}
    assert status["hvdp/DDP step time, like for like, torch (worst model)"] == ("MISS", pytest.approx(0.09 / 0.08))
    assert status["hvdp/horovod step time, like for like, torch (worst group)"] == ("PASS", pytest.approx(1.0))
    spreads = {t["name"]: t["spread"] for t in results["targets"]}
    assert spreads["hvdp/horovod step time, like for like, torch (worst group)"] == pytest.approx([1.0, 1.1])
    assert status["hvdp.allreduce out= algbw at 64 MB / mpi4py like for like, under MPI"] == (
        "MISS", pytest.approx(0.5))
    assert status["hvdp.allreduce out= algbw at 64 MB / torch.distributed like for like, under Gloo"] == (
        "MISS", pytest.approx(0.5))
    assert status["hvdp.allreduce usual call algbw at 64 MB / mpi4py like for like, under MPI"] == ("n/a", None)
    assert status["hvdp.allreduce latency at 4 KB / torch.distributed like for like, under Gloo"] == (
        "MISS", pytest.approx(2.0))
    assert results["allreduce"]["bytes"][-1] == 256 << 20
    low, high = sweep["hvdp.allreduce (gloo)"]["spread_seconds"][0]
    assert low == pytest.approx(0.9 * 4096 / 1e9) and high == pytest.approx(1.1 * 4096 / 1e9)  # 9 calls
    assert results["scaling"]["ddp"]["efficiency"] == pytest.approx(0.1 / 0.11)
    # round by round: each round's np=1 step over its np=2 step, and hvdp's over DDP's, the target's range
    assert results["scaling"]["efficiency_spread"]["per_round"] == pytest.approx([0.12 / 0.126] * 3)
    assert results["scaling"]["versus_ddp"]["per_round"] == pytest.approx([(0.12 / 0.126) / (0.12 / 0.132)] * 3)
    scaling_target = next(t for t in results["targets"] if t["name"].startswith("scaling efficiency"))
    assert scaling_target["value"] == pytest.approx((0.12 / 0.126) / (0.12 / 0.132))
    assert scaling_target["spread"] == pytest.approx([scaling_target["value"]] * 2)
    assert status["hvdp/MultiWorkerMirrored step time, like for like, tensorflow (worst model)"] == ("n/a", None)
    table = bench.format_table(results)
    assert "ratio hvdp/horovod defaults" in table and "PASS" in table and "MISS" in table and "64 MB" in table
    assert "1.000 [1.000-1.100]  rounds: 1.000 1.100 1.000" in table
    assert json.loads(json.dumps(results)) == results


def test_sharded_section_ratios_memory_and_targets():
    """Per np: sharded step over unsharded's and ZeroRedundancyOptimizer's (as shipped and like for like); the
    largest state and peak RSS per rank over unsharded's, round by round; the table prints every rank's memory."""
    people = [Contender(f"{who} np={n}", impl, np=n, knobs=knobs, optimizer="adam", shard=shard)
              for n in (1, 2) for who, impl, shard, knobs in (
                  ("hvdp", "hvdp", False, "one-thread"), ("sharded", "hvdp", True, "one-thread"),
                  ("zero", "ddp", True, "one-thread"), ("zerod", "ddp", True, "defaults"))]
    group = Group("sharded torch/cnn", people)
    steps = {"hvdp": 0.1, "sharded": 0.102, "zero": 0.11, "zerod": 0.12}
    state = {("hvdp", 2): [400, 400], ("sharded", 2): [200, 200], ("zero", 2): [360, 40], ("zerod", 2): [360, 40]}
    for c in people:
        who, n = c.label.split()[0], c.np
        record = {"size": n, "step_seconds": [steps[who]] * 3,
                  "memory": {"state_bytes": state.get((who, n), [400]), "peak_rss_bytes": [2 ** 30] * n}}
        group.runs[c.label] = [record, record, record]
    results = bench.summarize([group], Settings(rounds=3))
    ratios = results["groups"][0]["ratios"]
    expected = {}
    for n, state_ratio in ((1, 1.0), (2, 0.5)):
        expected.update({f"sharded/unsharded step np={n}": 1.02,
                         f"sharded/ZeroRedundancyOptimizer like-for-like step np={n}": 0.102 / 0.11,
                         f"sharded/ZeroRedundancyOptimizer defaults step np={n}": 0.102 / 0.12,
                         f"state per rank sharded/unsharded np={n}": state_ratio,
                         f"peak RSS per rank sharded/unsharded np={n}": 1.0})
    assert ratios == pytest.approx(expected)
    assert results["groups"][0]["ratio_spread"]["state per rank sharded/unsharded np=2"]["per_round"] == [0.5] * 3
    status = {t["name"]: (t["status"], t["value"]) for t in results["targets"]}
    assert status["sharded Adam state per rank / unsharded, np=2 (worst model)"] == ("PASS", pytest.approx(0.5))
    assert status["sharded/unsharded step time, Adam np=2 (worst model)"] == ("PASS", pytest.approx(1.02))
    assert status["sharded/ZeroRedundancyOptimizer step time, like for like, Adam np=2 (worst model)"][0] == "PASS"
    assert "optimizer state MB per rank: 0.00 0.00; peak RSS MB per rank: 1024 1024" in bench.format_table(results)


def test_results_file_holds_the_run_every_sample_and_each_contenders_settings(tmp_path):
    from hvdp.bench import results as results_file

    settings = bench.make_settings(True, None, None, None, "native", seed=11)
    groups = bench.plan(settings)
    bench.run_groups(groups, settings, {"PATH": "/usr/bin:/bin"}, 2, lambda line: None, runner=_fake_runner)
    summary = bench.summarize(groups, settings)
    start = {"date": "2026-12-07 10:00 UTC", "load": results_file.load_average()}
    doc = results_file.document(["hvdp", "bench", "--quick", "--only", "native"], groups, settings, summary, start,
                                {"PATH": "/usr/bin:/bin"}, 2)
    doc = json.loads(json.dumps(doc))  # what is written is JSON
    assert list(doc) == ["format", "command", "date", "machine", "versions", "settings", "contenders", "orders",
                         "samples", "summary"]
    assert doc["format"] == "hvdp-bench-results/1" and doc["command"][:3] == ["hvdp", "bench", "--quick"]
    machine = doc["machine"]
    assert machine["cpus"] >= 1 and len(machine["load_average_start"]) == len(machine["load_average_end"]) == 3
    assert {"python", "torch", "tensorflow", "keras", "horovod", "hvdp_commit"} <= set(doc["versions"])
    assert doc["settings"]["seed"] == 11 and doc["settings"]["rounds"] == 3 and doc["settings"]["steps"] == 100
    labels = [c.label for g in groups for c in g.contenders]
    assert sorted(doc["contenders"]) == sorted(labels)
    for label, described in doc["contenders"].items():
        assert described["settings"] in ("hvdp", "defaults", "like-for-like") and described["argv"], label
        assert described["settings"] != "defaults" or not any(k.startswith("HOROVOD_") for k in described["env"])
    samples = doc["samples"]  # every job: 3 rounds of every contender, each with its record
    assert len(samples) == 3 * len(labels)
    assert sorted((s["contender"], s["round"]) for s in samples) == sorted((label, r) for label in labels
                                                                           for r in range(3))
    assert all(s["record"]["step_seconds"] == [0.1] for s in samples)
    for group in groups:
        assert doc["orders"][group.name] == group.orders and len(group.orders) == 3
    assert doc["summary"]["groups"][0]["ratio_spread"]


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


def test_every_committed_results_file_prints_its_tables_with_its_heading():
    """scripts/results_table.py on each file under docs/results/: the heading names the command, the commit and
    the sample count; a row for every contender, every ratio and every target, and the allreduce sweep where run;
    and docs/results/README.md lists the file."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("results_table", root / "scripts" / "results_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    files = sorted((root / "docs" / "results").glob("*.json"))
    assert files, "no results file committed"
    listed = (root / "docs" / "results" / "README.md").read_text()
    for path in files:
        results = json.loads(path.read_text())
        head = table.heading(path.name, results)
        assert results["versions"]["hvdp_commit"] in head[1] and f"{len(results['samples'])} samples" in head[1]
        lines = table.markdown(results["summary"])
        for group in results["summary"]["groups"]:
            for label in group["contenders"]:
                assert any(f"| {label} |" in line for line in lines), (path.name, label)
        for target in results["summary"]["targets"]:
            assert any(line.startswith(f"| {target['name']} |") for line in lines), (path.name, target["name"])
        for label in (results["summary"].get("allreduce") or {}).get("impls", {}):
            assert any(line.startswith(f"| {label} |") for line in lines), (path.name, label)
        assert f"[{path.name}]({path.name})" in listed, f"docs/results/README.md does not list {path.name}"


def test_two_results_files_compare_ratio_by_ratio():
    """scripts/results_table.py --before: each ratio and target of both files with its median and range, the
    change as a factor, and whether the ranges overlap; a figure only one file has is said to be so."""
    import copy
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("results_table", root / "scripts" / "results_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    before = json.loads((root / "docs" / "results" / "2026-12-07-quick.json").read_text())
    after = copy.deepcopy(before)
    group = after["summary"]["groups"][0]
    key = next(iter(group["ratio_spread"]))
    spread = group["ratio_spread"][key]
    shift = spread["high"] - spread["low"] + 0.5
    group["ratios"][key] += shift
    spread.update(low=spread["low"] + shift, high=spread["high"] + shift, median=spread["median"] + shift)
    gone = next(k for k in group["ratios"] if k != key)
    del group["ratios"][gone]
    lines = table.compare(before, after)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in lines[2:]}
    assert len(rows) == len(table.ratio_figures(before["summary"]))
    moved = rows[f"{group['name']}: {key}"]
    assert moved.endswith("ranges apart |") and f"{group['ratios'][key]:.3f} [" in moved, moved
    assert rows[f"{group['name']}: {gone}"].endswith("| - | only before |")
    same = [line for name, line in rows.items() if name not in (f"{group['name']}: {key}", f"{group['name']}: {gone}")]
    assert same and all("1.000x" in line and ("within the ranges" in line or "no range" in line) for line in same)


def test_a_results_file_names_the_cpus_family_and_vector_extensions():
    """Two machines that both say "AMD EPYC" can differ by their vector extensions (and by twice the step time):
    the first processor's family, model number, clock and SIMD flags are kept, and the table's heading says them."""
    import importlib.util

    from hvdp.bench import results

    info = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
            "cpu MHz\t\t: 2600.000\nflags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512bw\n\n"
            "processor\t: 1\ncpu family\t: 99\nflags\t\t: fpu\n")
    found = results.machine(info)
    assert (found["cpu_family"], found["cpu_model_number"], found["cpu_mhz"]) == ("25", "17", "2600.000")
    assert found["simd"] == ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw"]
    assert found["description"].endswith("AMD EPYC (family 25 model 17)")
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("results_table", root / "scripts" / "results_table.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    head = table.heading("x.json", {"machine": found, "versions": {}, "samples": []})
    assert "(family 25 model 17, sse4_2 avx avx2 fma avx512f avx512bw)" in head[1], head
    assert "(its family and vector extensions not recorded)" in table.heading("x.json", {"machine": {}})[1]
