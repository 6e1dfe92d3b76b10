"""broadcast_state leaves no trace; object collectives and checkpoint saves never hang (np=2).

Each rank starts from its own random weights, as users' scripts do, and goes through
``broadcast_state``; the result must be the single process's on the whole batch, step
counters included, for every optimizer, before the first step and after some (resuming).
"""

from __future__ import annotations

import os
import subprocess

import pytest
from harness import WORKERS, run_job

TORCH_OPTIMIZERS = ["sgd", "sgd_momentum", "sgd_nesterov", "adam", "adamw", "rmsprop", "adagrad"]
KERAS_OPTIMIZERS = ["sgd_momentum", "adam", "adamw", "rmsprop"]
WHEN = ["fresh", "resumed"]
_JOBS: dict = {}


def _mount_tmpfs(path, options):
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    return path


@pytest.fixture(scope="module")
def filesystems(tmp_path_factory):
    """A 1 MB filesystem and a read-only one (root only: they are real mounts)."""
    if os.geteuid() != 0:
        yield {}
        return
    base = tmp_path_factory.mktemp("mounts")
    full, readonly = _mount_tmpfs(base / "full", "size=1m"), _mount_tmpfs(base / "readonly", "size=1m,ro")
    try:
        yield {"HVDP_TEST_FULL_DIR": str(full), "HVDP_TEST_READONLY_DIR": str(readonly)}
    finally:
        subprocess.run(["umount", str(full), str(readonly)], check=False)


def job_of(worker, framework, controller, tmp_path_factory, extra_env=None):
    key = (worker, framework, controller)
    if key not in _JOBS:
        old = {k: os.environ.get(k) for k in (extra_env or {})}
        os.environ.update(extra_env or {})
        try:
            job = run_job([f"--{controller}", "--framework", framework, str(WORKERS / worker)],
                          tmp_path_factory.mktemp(worker.split(".")[0]))
        finally:
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        assert job.returncode == 0, f"{worker} ({framework}, {controller}) exited {job.returncode}:\n" \
                                    f"{job.output[-6000:]}"
        assert [r["rank"] for r in job.ranks] == [0, 1], f"missing rank reports:\n{job.output[-4000:]}"
        _JOBS[key] = job
    return _JOBS[key]


@pytest.fixture(scope="module", params=["gloo", "mpi"])
def torch_job(request, tmp_path_factory, filesystems):
    return job_of("broadcast_torch.py", "torch", request.param, tmp_path_factory, filesystems)


@pytest.fixture(scope="module", params=[("tensorflow", "gloo"), ("tensorflow", "mpi"), ("torch", "gloo")],
                ids=lambda p: "keras-on-" + "-".join(p))
def keras_job(request, tmp_path_factory):
    return job_of("broadcast_keras.py", *request.param, tmp_path_factory)


def check_runs(job, optimizers, max_abs):
    """Every run within ``max_abs`` of one process on the whole batch (torch: 0, the same bits)."""
    for name in optimizers:
        for when in WHEN:
            results = [rank["runs"][f"{name}/{when}"] for rank in job.ranks]
            for r in results:
                assert r["moved"] > 1e-2, f"{name}/{when}: training did not move the parameters"
                assert r["max_abs"] <= max_abs, f"{name}/{when}: {r['max_abs']} away from one process"
                assert r["steps"] == r["reference_steps"], f"{name}/{when}: step counters {r}"
                assert r["steps_after_broadcast"] == r["reference_steps_after_broadcast"], f"{name}/{when}: {r}"
            assert len({r["digest"] for r in results}) == 1, f"{name}/{when}: replicas differ"


def test_torch_optimizers_from_different_weights_equal_one_process_with_their_step_counters(torch_job):
    check_runs(torch_job, TORCH_OPTIMIZERS, max_abs=0.0)
    adam = torch_job.ranks[1]["runs"]["adam/resumed"]
    assert adam["steps"][0] == 7.0, adam  # 2 steps of rank 0's own, then 5 together: none added by the broadcast


def test_keras_optimizers_from_different_weights_equal_one_process_with_their_iterations(keras_job):
    check_runs(keras_job, KERAS_OPTIMIZERS, max_abs=1e-6)
    assert keras_job.ranks[1]["runs"]["adam/resumed"]["steps"] == 7


def test_torch_schedulers_bound_before_wrapping_keep_their_position_through_broadcast_and_checkpoint(torch_job):
    for rank in torch_job.ranks:
        s = rank["schedulers"]
        assert s["vs_single_process"]["close"], s
        assert s["groups_shared"], "the wrapper does not share the optimizer's param groups and state"
        assert s["lrs"] == s["reference_lrs"] == s["resumed_lrs"], s
        assert s["lrs"][0] < 0.05 / 4, "the schedulers did not move the learning rate"
        assert s["resumed_vs_uninterrupted"] == 0.0, "resuming from the checkpoint is not bit-identical"


def test_keras_learning_rate_schedule_keeps_its_position_through_broadcast_and_checkpoint(keras_job):
    for rank in keras_job.ranks:
        s = rank["schedule"]
        assert s["vs_single_process"]["close"], s
        assert s["iterations"] == s["reference_iterations"] == s["resumed_iterations"] == 9, s
        assert s["lr"] == pytest.approx(s["reference_lr"]) and s["lr"] < 0.05 / 4, s
        assert s["resumed_vs_uninterrupted"] == 0.0, "resuming from the checkpoint is not bit-identical"


@pytest.mark.parametrize("worker", ["torch", "keras"])
def test_object_collectives_take_whatever_each_rank_passes(worker, torch_job, keras_job):
    job = torch_job if worker == "torch" else keras_job
    for rank in job.ranks:
        o = rank["objects"]
        assert o["config"] == {"lr": 0.1, "layers": [4, 8]}, "broadcast_object(config or None) failed"
        assert o["from_rank_1"] == "text"
        assert o["gathered"] == [None, 1]
        if worker == "torch":
            assert o["big_vs_small"] == 100000
            assert o["seconds"] < 30, "object collectives waited (a name mismatch waits for the stall timeout)"


def test_failed_checkpoint_saves_raise_on_every_rank_and_keep_the_previous_one(torch_job):
    for rank in torch_job.ranks:
        saves = rank["failing_saves"]
        for case in ("parent_is_a_file", "bad_extras"):
            assert saves[case]["type"] == "CheckpointError", saves[case]
            assert "failed on rank 0" in saves[case]["message"] and saves[case]["seconds"] < 30, saves[case]
        assert saves["previous_loads"] == 1
        assert saves["left_behind"] == [], "a temporary file was left behind"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a full and a read-only filesystem needs root")
def test_saves_onto_a_full_or_read_only_filesystem_raise_on_every_rank(torch_job):
    for rank in torch_job.ranks:
        saves = rank["failing_saves"]
        assert saves["disk_full"]["type"] == "CheckpointError", saves
        assert "No space left on device" in saves["disk_full"]["message"], saves["disk_full"]
        assert saves["read_only_folder"]["type"] == "CheckpointError", saves
        assert "Read-only file system" in saves["read_only_folder"]["message"], saves["read_only_folder"]
        for case in ("disk_full", "read_only_folder"):
            assert saves[case]["seconds"] < 30, saves[case]
        assert saves["previous_loads_after_full_disk"] == 1, "the checkpoint on the full disk was lost"
