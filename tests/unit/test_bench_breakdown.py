"""The bench's breakdown section, its pure parts: Horovod timeline parsing (over real timelines that
hvdp.bench.worker's breakdown task wrote under Gloo and MPI, 2 processes, 4 KB), per-call phases,
summaries, the table, the sizes option and the plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hvdp import bench
from hvdp.bench import BenchError, Contender, Settings
from hvdp.bench import breakdown as bd

FIXTURES = Path(__file__).resolve().parent / "fixtures"
HVDP_TENSOR, INPLACE_TENSOR = "allreduce.breakdown.0.4096", "allreduce.breakdown.1.4096"


def _timeline(controller: str) -> bd.Timeline:
    return bd.parse_timeline((FIXTURES / f"horovod_timeline_{controller}.json").read_text())


@pytest.mark.parametrize("controller,transport", [("gloo", "GLOO_ALLREDUCE"), ("mpi", "MPI_ALLREDUCE")])
def test_real_timeline_gives_each_call_its_negotiation_op_and_transport(controller, transport):
    timeline = _timeline(controller)
    assert timeline.start_epoch_us > 1_700_000_000 * 10**6  # wall clock, microseconds since the epoch
    # The worker made 5 calls of each variant (1 estimate, 1 warm-up, 3 timed), alternating.
    assert len(timeline.calls[HVDP_TENSOR]) == len(timeline.calls[INPLACE_TENSOR]) == 5
    for call in timeline.calls[HVDP_TENSOR] + timeline.calls[INPLACE_TENSOR]:
        assert call.negotiate is not None
        assert call.negotiate[0] <= call.negotiate[1] <= call.op[0] <= call.op[1]
        assert [name for name, _, _ in call.activities] == [transport]
        (_, begun, ended), = call.activities
        assert call.op[0] <= begun <= ended <= call.op[1]
    # Calls alternate: each hvdp call ends before the in-place call after it starts.
    for mine, theirs in zip(timeline.calls[HVDP_TENSOR], timeline.calls[INPLACE_TENSOR]):
        assert mine.op[1] <= theirs.negotiate[0] + 1
    # The job's final join negotiates without an op: no call.
    assert not any(name.startswith("join") for name in timeline.calls)


def test_unclosed_or_cut_timeline_keeps_its_whole_events():
    text = (FIXTURES / "horovod_timeline_gloo.json").read_text().rstrip().rstrip("]")
    assert len(bd.parse_timeline(text).calls[HVDP_TENSOR]) == 5
    ops = [i for i in range(len(text)) if text.startswith('"name": "ALLREDUCE"', i)]
    cut = text[:ops[6] + 30]  # inside an event, as when a job dies: the calls that ended before it stay
    assert len(bd.parse_timeline(cut).calls[HVDP_TENSOR]) == 3
    for bad in ("", "{}", '[{"ph": "B"}]', "[{"):
        with pytest.raises(BenchError, match="not a Horovod timeline"):
            bd.parse_timeline(bad)


def test_fused_call_counts_its_copies():
    text = json.dumps([
        {"name": "process_name", "ph": "M", "pid": 0, "args": {"start_time_since_epoch_in_micros": 1000}},
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allreduce.g"}},
        {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 10, "pid": 1}, {"ph": "E", "ts": 12, "pid": 1},
        {"ph": "B", "name": "ALLREDUCE", "ts": 20, "pid": 1},
        {"ph": "B", "name": "MEMCPY_IN_FUSION_BUFFER", "ts": 21, "pid": 1}, {"ph": "E", "ts": 25, "pid": 1},
        {"ph": "B", "name": "MPI_ALLREDUCE", "ts": 25, "pid": 1}, {"ph": "E", "ts": 45, "pid": 1},
        {"ph": "B", "name": "MEMCPY_OUT_FUSION_BUFFER", "ts": 45, "pid": 1}, {"ph": "E", "ts": 48, "pid": 1},
        {"ph": "E", "ts": 50, "pid": 1},
    ])
    timeline = bd.parse_timeline(text)
    call, = timeline.calls["allreduce.g"]
    # Rank 0 enqueued at wall 1005 us, saw the end at 1060 us; its marks (ns) read perf_counter, offset 0.
    marks = [1_000_000, 1_001_000, 1_002_000, 1_005_000, 1_060_000, 1_061_000, 1_062_000]
    phases = bd.timeline_phases(marks, call, 0, 1000)
    assert phases == {"cycle wait": 5.0, "negotiation": 2.0, "to op start": 8.0, "untimed copy": 1.0,
                      "memcpy in fusion buffer": 4.0, "transport": 20.0, "memcpy out fusion buffer": 3.0,
                      "op end": 2.0, "completion notice": 10.0}
    assert sum(phases.values()) == pytest.approx(55.0)  # enqueued -> done


def _marks_for(timeline: bd.Timeline, tensor: str, offset_ns: int, queued_us: float, notice_us: float):
    """Rank 0's marks as if its request waited ``queued_us`` before the negotiation and saw the end after
    ``notice_us``; 10 us of Python before, 5 of allocation, 3 of enqueue, 2 after, 1 to free."""
    rows = []
    for call in timeline.calls[tensor]:
        enqueued = timeline.start_epoch_us * 1000 + int((call.negotiate[0] - queued_us) * 1000) - offset_ns
        done = timeline.start_epoch_us * 1000 + int((call.op[1] + notice_us) * 1000) - offset_ns
        rows.append([enqueued - 18_000, enqueued - 8_000, enqueued - 3_000, enqueued, done, done + 2_000,
                     done + 3_000])
    return rows


def test_call_phases_split_rank_0s_wait_and_add_up_to_the_call():
    timeline = _timeline("mpi")
    offset = 1_764_000_000 * 10**9
    rank0 = {"marks": _marks_for(timeline, HVDP_TENSOR, offset, 250.0, 40.0), "offset_ns": offset}
    rank1 = {"marks": [[0, 10, 20, 30, 5_030, 5_040, 5_050]] * 5, "offset_ns": 0}
    rows = bd.call_phases({0: rank0, 1: rank1}, timeline, HVDP_TENSOR, warmup=2)
    assert len(rows[0]) == len(rows[1]) == 3
    for row, call in zip(rows[0], timeline.calls[HVDP_TENSOR][2:]):
        assert row["cycle wait"] == pytest.approx(250.0, abs=0.01)
        assert row["completion notice"] == pytest.approx(40.0, abs=0.01)
        assert row["python before"] == pytest.approx(10.0) and row["output allocation"] == pytest.approx(5.0)
        assert row["transport"] == sum(e - b for _, b, e in call.activities)
        assert "wait" not in row and abs(row["unaccounted"]) < 0.01
        assert min(v for k, v in row.items() if k != "unaccounted") >= 0
    assert rows[1][0]["wait"] == pytest.approx(5.0) and rows[1][0]["call"] == pytest.approx(5.05)
    assert set(rows[1][0]) == {*bd.PYTHON_PHASES, "call", "unaccounted"}
    with pytest.raises(BenchError, match="the timeline has 5 calls"):
        bd.call_phases({0: {"marks": rank0["marks"][:4], "offset_ns": offset}}, timeline, HVDP_TENSOR, 0)


def test_negotiation_begun_by_another_rank_is_clamped_to_this_ranks_enqueue():
    call = bd.TimelineCall(negotiate=(100, 900), op=(950, 2000), activities=[("GLOO_ALLREDUCE", 960, 1990)])
    # This rank enqueued at 500 us, after the other rank started the negotiation at 100 us.
    marks = [480_000, 490_000, 495_000, 500_000, 2_100_000, 2_101_000, 2_102_000]
    phases = bd.timeline_phases(marks, call, 0, 0)
    assert phases["cycle wait"] == 0 and phases["negotiation"] == 400 and phases["to op start"] == 50
    assert sum(phases.values()) == pytest.approx(1600.0)


def test_summary_table_and_json():
    timeline = _timeline("gloo")
    offset = 0
    record = {"controller": "gloo", "size": 2, "env": {"HOROVOD_CYCLE_TIME": "5"}, "phases": {}, "faults": {}}
    for variant, tensor in zip(bd.VARIANTS, (HVDP_TENSOR, INPLACE_TENSOR)):
        rows = bd.call_phases({0: {"marks": _marks_for(timeline, tensor, offset, 100.0, 20.0), "offset_ns": 0},
                               1: {"marks": [[0, 10, 20, 30, 5_030, 5_040, 5_050]] * 5, "offset_ns": 0}},
                              timeline, tensor, warmup=2)
        record["phases"][variant] = {"4096": {str(r): v for r, v in rows.items()}}
        record["faults"][variant] = {"4096": {"0": [0, 2, 1], "1": [0, 0, 0]}}
    figures = bd.summarize([record])
    run, = figures["runs"]
    rank0 = run["variants"][bd.VARIANTS[0]]["4096"]["0"]
    assert rank0["calls"] == 3 and rank0["minor_faults_per_call"] == 1
    assert rank0["median_us"]["cycle wait"] == pytest.approx(100.0, abs=0.01)
    table = bd.format_table(figures)
    for text in ("gloo, 4 KB", "cycle wait", "transport", "= call (measured)", "minor page faults / call",
                 "rank 1:", bd.VARIANTS[1]):
        assert text in table
    assert json.loads(json.dumps(figures)) == figures


def test_sizes_option():
    assert bd.parse_sizes("4K,64M") == (4096, 64 << 20)
    assert bd.parse_sizes(" 1024 , 1mb") == (1024, 1 << 20)
    for bad in ("", "4K,x", "3", "-4K", "1.5M"):
        with pytest.raises(BenchError, match="--breakdown"):
            bd.parse_sizes(bad)


def test_plan_and_job_of_the_breakdown_section(monkeypatch):
    from hvdp import launch

    monkeypatch.setattr(launch, "horovodrun_path", lambda: "horovodrun")
    settings = bench.make_settings(True, None, None, None, "breakdown")
    settings.breakdown_bytes = (4096, 1 << 20)
    group, = bench.plan(settings)
    assert group.name == "breakdown" and settings.rounds == 3  # every round, as every figure
    assert [c.controller for c in group.contenders] == ["gloo", "mpi"]
    argv, _, _ = bench.job(group.contenders[1], settings, "/o.json", {"PATH": "/usr/bin"}, 2)
    assert argv[0][1:6] == ["run", "-np", "2", "--mpi", "--framework"]  # under hvdp run
    worker = argv[0][argv[0].index("breakdown"):]
    assert worker[worker.index("--sizes") + 1] == "4096,1048576" and "--calls" in worker
    assert any(g.name == "breakdown" for g in bench.plan(bench.make_settings(True, None, None, None, None)))
    with pytest.raises(BenchError, match="'zz' is not a size"):
        bench.main(bench_args(breakdown="4K,zz"))
    with pytest.raises(BenchError, match="--only native leaves out: add it, e.g. --only native,breakdown"):
        bench.main(bench_args(breakdown="4K", only="native"))
    assert isinstance(Settings().breakdown_bytes, tuple) and Contender("x", "hvdp").task == "train"


def bench_args(**overrides):
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--only", "breakdown"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args
