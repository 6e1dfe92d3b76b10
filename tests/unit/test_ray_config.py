"""hvdp.ray without a cluster: HvdpConfig refuses bad values naming the fix, the trainer refuses a framework
that contradicts its config, Horovod's slots come from the workers' nodes, and the package is imported only
when asked for (with the fix when Ray is missing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import hvdp.ray as ray_pkg  # Ray comes with scripts/setup.sh (setup.py's ray extra)
from hvdp.errors import FrameworkError

REPO = Path(__file__).resolve().parents[2]
HvdpConfig = ray_pkg.HvdpConfig


def test_the_defaults_are_hvdp_runs():
    config = HvdpConfig()
    assert config.to_dict() == {"framework": "torch", "stall_timeout": 300, "threads_per_worker": None,
                                "start_timeout": 60}
    assert config.framework.value == "torch" and HvdpConfig(framework="tensorflow").framework.value == "tensorflow"
    assert config == HvdpConfig(framework="torch") != HvdpConfig(framework="torch", stall_timeout=10)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"framework": "pytorch"}, FrameworkError, ["'pytorch'", "Expected one of: torch, tensorflow", "'torch'?"]),
    ({"framework": "keras"}, FrameworkError, ["'keras'", "Did you mean 'tensorflow'?"]),
    ({"stall_timeout": -1}, ValueError, ["stall_timeout=-1", "0 or more", "stall_timeout=10"]),
    ({"stall_timeout": "60"}, TypeError, ["stall_timeout='60'", "got str", "stall_timeout=10"]),
    ({"stall_timeout": True}, TypeError, ["stall_timeout=True", "got bool"]),
    ({"threads_per_worker": 0}, ValueError, ["threads_per_worker=0", "1 or more threads", "threads_per_worker=10"]),
    ({"threads_per_worker": 1.5}, TypeError, ["threads_per_worker=1.5", "got float"]),
    ({"start_timeout": 0}, ValueError, ["start_timeout=0", "1 or more seconds"]),
])
def test_a_bad_value_is_refused_naming_it_and_the_fix(kwargs, error, words):
    with pytest.raises(error) as raised:
        HvdpConfig(**kwargs)
    assert all(word in str(raised.value) for word in words), str(raised.value)


def test_the_trainer_takes_the_framework_from_one_place():
    from hvdp.ray.trainer import hvdp_config_for

    assert hvdp_config_for(None, None).framework_name == "torch"
    assert hvdp_config_for("tensorflow", None).framework_name == "tensorflow"
    given = HvdpConfig(framework="tensorflow", stall_timeout=5)
    assert hvdp_config_for(None, given) is given and hvdp_config_for("tensorflow", given) is given
    with pytest.raises(ValueError, match="framework='torch'.*contradicts.*'tensorflow'"):
        hvdp_config_for("torch", given)
    with pytest.raises(TypeError, match="expected an hvdp.ray.HvdpConfig, got dict"):
        hvdp_config_for(None, {"framework": "torch"})
    with pytest.raises(FrameworkError, match="'jax'"):
        hvdp_config_for("jax", None)


def test_the_trainer_refuses_rays_local_mode():
    from ray.train import ScalingConfig

    with pytest.raises(ValueError, match="num_workers=0.*num_workers=1 or more"):
        ray_pkg.HvdpTrainer(lambda: None, scaling_config=ScalingConfig(num_workers=0))


def test_slots_follow_the_workers_nodes_as_horovodrun_places_hosts():
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    from hvdp.ray.backend import assign_slots, slot_env

    nodes = ["n1", "n1", "n2", "n2", "n3"]
    ips = ["10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2", "10.0.0.3"]
    ours = assign_slots(nodes, ips)
    theirs = get_host_assignments(parse_hosts("10.0.0.1:2,10.0.0.2:2,10.0.0.3:1"), 5)
    assert ours == [vars(slot) for slot in theirs]
    assert slot_env(ours[4]) == {"HOROVOD_HOSTNAME": "10.0.0.3", "HOROVOD_RANK": "4", "HOROVOD_SIZE": "5",
                                 "HOROVOD_LOCAL_RANK": "0", "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": "2",
                                 "HOROVOD_CROSS_SIZE": "3"}
    shared = assign_slots(["aaaaaaaaaa", "bbbbbbbbbb"], ["10.0.0.1", "10.0.0.1"])  # two nodes, one address
    assert [s["hostname"] for s in shared] == ["10.0.0.1-aaaaaaaa", "10.0.0.1-bbbbbbbb"]
    with pytest.raises(ValueError, match="2 node ids but 1 addresses"):
        assign_slots(["a", "b"], ["10.0.0.1"])


def test_the_stall_message_names_the_worker_and_its_node():
    from hvdp.ray.worker import stall_message

    text = stall_message({1: "allreduce.w, allreduce.b"}, ["10.0.0.1", "10.0.0.2"], 10)
    assert text.startswith("hvdp: the attempt was ended: worker 1 (rank 1, node 10.0.0.2) never submitted "
                           "allreduce.w, allreduce.b (stalled longer than HvdpConfig(stall_timeout=10))")


def test_importing_hvdp_does_not_import_ray_and_a_missing_ray_names_the_extra():
    code = ("import sys, hvdp, hvdp.launch\nassert 'ray' not in sys.modules, 'hvdp imported ray'\n"
            "sys.modules['ray'] = None\n"
            "try:\n    import hvdp.ray\nexcept ImportError as exc:\n    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "hvdp.ray needs Ray Train" in proc.stdout and "pip install 'hvdp[ray]'" in proc.stdout, proc.stdout


def test_the_training_context_turns_a_stall_report_on_stderr_into_the_workers_name():
    import os

    from hvdp.errors import JobFailedError
    from hvdp.ray.worker import TrainingContext

    with pytest.raises(JobFailedError) as raised:
        with TrainingContext(10):  # what Horovod's stall inspector writes to fd 2, then the loop's error
            os.write(2, b"[W stall_inspector.cc:107] One or more tensors were submitted ...\nMissing ranks:\n"
                        b"1!: [allreduce.never_joined]\n")
            raise RuntimeError("Horovod has been shut down")
    assert "worker 1 (rank 1, node ?) never submitted allreduce.never_joined" in str(raised.value)
    assert isinstance(raised.value.__cause__, RuntimeError)
    with pytest.raises(ValueError, match="the loop's own"):  # no stall report: the loop's error as it was
        with TrainingContext(10):
            os.write(2, b"an ordinary line\n")
            raise ValueError("the loop's own")
