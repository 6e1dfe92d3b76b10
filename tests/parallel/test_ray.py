"""hvdp on a local Ray cluster (hvdp.ray): Ray Train's workers form one hvdp job.

One Ray cluster (4 logical CPUs: 2 workers of 1 CPU, the rest for Ray Data) serves every test of the module.
Each worker reports what it saw; the tests check every worker's report:

* torch under Ray's own DataParallelTrainer with HvdpConfig: equal to one process stepping on the union of
  the workers' batches (SGD, and Adam with its state sharded, ZeRO-1; rtol 1e-5), the ranks and environment
  ``hvdp run`` would give, collectives, sampler, drift guard, a Keras 3 model fit on the torch backend, Ray's
  context and Ray Data shard beside them;
* Keras 3 model.fit on TensorFlow under HvdpTrainer: the replicas end identical;
* examples/ray_digits.py with torch: a worker that dies makes Ray start the group again, the loop resumes
  from Ray's checkpoint and ends with the uninterrupted run's weights;
* a worker that stalls ends the attempt with hvdp's stall message naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import ray
from harness import REPO, WORKERS

sys.path.insert(0, str(WORKERS))
import ray_loops

from hvdp.ray import HvdpConfig, HvdpTrainer

EXAMPLE = REPO / "examples" / "ray_digits.py"
#: A Ray run that has not ended in this time has hung.
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray cluster for the module; its address lets a script's driver join it."""
    os.environ.pop("HVDP_FRAMEWORK", None)
    os.environ.pop("KERAS_BACKEND", None)
    started = time.perf_counter()
    context = ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                       _temp_dir=str(tmp_path_factory.mktemp("ray")))
    ray.cloudpickle.register_pickle_by_value(ray_loops)
    print(f"\nRay's local cluster started in {time.perf_counter() - started:.1f} s")
    yield context.address_info["gcs_address"]
    ray.shutdown()


def storage(tmp_path: Path):
    from ray.train import RunConfig

    return RunConfig(storage_path=str(tmp_path / "ray-results"))


def reports(out: Path, size: int):
    found = [json.loads((out / f"rank{r}.json").read_text()) for r in range(size) if (out / f"rank{r}.json").exists()]
    assert len(found) == size, f"{len(found)} of {size} workers reported"
    return found


def one_process(start, x, y, size):
    """The reference: one model, stepping on the union of the workers' batches (SGD, then Adam)."""
    import torch

    ends = []
    for index, make in enumerate((lambda p: torch.optim.SGD(p, lr=0.1), lambda p: torch.optim.Adam(p, lr=0.01))):
        model = ray_loops.models(torch)[0]
        with torch.no_grad():
            for param, value in zip(model.parameters(), start[index]):
                param.copy_(torch.tensor(value))
        optimizer = make(model.parameters())
        batch = ray_loops.BATCH * size
        for step in range(ray_loops.STEPS):
            optimizer.zero_grad()
            union = slice(step * batch, (step + 1) * batch)
            torch.nn.CrossEntropyLoss()(model(torch.from_numpy(x[union])), torch.from_numpy(y[union])).backward()
            optimizer.step()
        ends.append([p.detach().numpy() for p in model.parameters()])
    return ends


def test_torch_equals_one_process_on_the_union_of_the_workers_batches(cluster, tmp_path):
    from ray.train import ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    out = tmp_path / "out"
    out.mkdir()
    trainer = DataParallelTrainer(ray_loops.torch_union, train_loop_config={"out": str(out)},
                                  backend_config=HvdpConfig(framework="torch", stall_timeout=120),
                                  scaling_config=ScalingConfig(num_workers=2), run_config=storage(tmp_path),
                                  datasets={"train": ray.data.range(40)})
    assert trainer.fit().error is None
    workers = reports(out, 2)
    x, y = ray_loops.data(2)
    reference = one_process(workers[0]["start"], x, y, 2)
    for worker in workers:
        rank = worker["rank"]
        assert worker["start"] == workers[0]["start"], "broadcast_state left the replicas different"
        assert worker["ray"] == [rank, 2, rank, 2, 0], "hvdp's ranks are not Ray's"
        assert (worker["size"], worker["local_rank"], worker["local_size"], worker["cross_rank"],
                worker["cross_size"]) == (2, rank, 2, 0, 1)
        assert worker["framework"] == "torch" and worker["env"]["HVDP_FRAMEWORK"] == "torch"
        assert worker["env"]["KERAS_BACKEND"] == "torch"
        assert worker["env"]["OMP_NUM_THREADS"] == worker["env"]["TF_NUM_INTRAOP_THREADS"] == "1"
        assert worker["torch_threads"] == 1 and worker["env"]["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "120"
        assert worker["env"]["HOROVOD_GLOO_IFACE"], "Gloo was given no interface"
        for ours, theirs, name in zip(worker["end"], reference, ("SGD", "Adam sharded (ZeRO-1)")):
            for got, want in zip(ours, theirs):
                assert np.allclose(np.array(got), want, rtol=1e-5, atol=1e-6), \
                    f"{name}, worker {rank}: max abs diff {np.abs(np.array(got) - want).max()}"
            moved = max(np.abs(np.array(a) - np.array(b)).max() for a, b in zip(ours, worker["start"][0]))
            assert name != "SGD" or moved > 1e-3, "SGD did not move the parameters"
        assert worker["allreduce"] == 3.0 and worker["allgather"] == [0, 1]
        assert worker["broadcast_object"] == {"from": 0}
    assert workers[0]["keras_backend"] == workers[1]["keras_backend"] == "torch"  # Keras 3 on torch, fit
    assert workers[0]["keras_weights"] == workers[1]["keras_weights"], "Keras on torch: the replicas differ"
    assert sorted(workers[0]["sampler"] + workers[1]["sampler"]) == list(range(10))
    assert workers[0]["data_rows"] + workers[1]["data_rows"] == 40 and workers[0]["data_rows"] > 0


def test_keras_fit_on_tensorflow_ends_with_identical_replicas(cluster, tmp_path):
    from ray.train import ScalingConfig

    out = tmp_path / "out"
    out.mkdir()
    trainer = HvdpTrainer(ray_loops.keras_fit, train_loop_config={"out": str(out)}, framework="tensorflow",
                          scaling_config=ScalingConfig(num_workers=2), run_config=storage(tmp_path))
    trainer.fit()
    workers = reports(out, 2)
    for worker in workers:
        assert (worker["framework"], worker["keras_backend"], worker["env_keras"]) == ("tensorflow",) * 3
        assert worker["moved"] > 1e-3, "fit did not move the weights"
    assert workers[0]["weights"] == workers[1]["weights"], "the replicas differ after fit"


def start_example(cluster, tmp_path, name, *extra):
    """examples/ray_digits.py as a driver of the module's cluster, writing its result to NAME.json."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    return subprocess.Popen([sys.executable, str(EXAMPLE), "--address", cluster, "--epochs", "6",
                             "--storage", str(tmp_path / "ray-results"), "--json", str(tmp_path / f"{name}.json"),
                             *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_example(proc, tmp_path, name):
    try:
        printed, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        printed, _ = proc.communicate()
    assert proc.returncode == 0, f"{name} (exit code {proc.returncode}): {printed[-6000:]}"
    return json.loads((tmp_path / f"{name}.json").read_text()), printed


def test_a_worker_that_dies_resumes_from_rays_checkpoint_to_the_uninterrupted_weights(cluster, tmp_path):
    """Two example runs side by side, one of which Ray starts twice (each start: new worker processes
    importing torch): about 70 s on 2 cores, 90 s one after the other."""
    # The two runs side by side: 2 workers of 1 CPU each fit the cluster's 4 CPUs, and each starts alone.
    runs = {"uninterrupted": start_example(cluster, tmp_path, "uninterrupted", "--framework", "torch"),
            "resumed": start_example(cluster, tmp_path, "resumed", "--framework", "torch", "--fault-epoch", "3",
                                     "--max-failures", "1")}
    (whole, printed), (resumed, _) = (finish_example(proc, tmp_path, name) for name, proc in runs.items())
    assert "test accuracy:" in printed and whole["accuracy"] > 0.85, printed
    assert [w["rank"] for w in resumed["workers"]] == [0, 1]
    assert all(0 < w["resumed_from_epoch"] <= 3 for w in resumed["workers"]), resumed["workers"]
    assert all(w["resumed_from_epoch"] == 0 for w in whole["workers"])
    difference = np.abs(np.array(whole["weights"]) - np.array(resumed["weights"])).max()
    assert difference <= 1e-6, f"the resumed run ends {difference} away from the uninterrupted one"
    assert resumed["accuracy"] == whole["accuracy"]


def test_a_stalled_worker_ends_the_attempt_naming_it(cluster, tmp_path):
    from ray.train import ScalingConfig

    trainer = HvdpTrainer(ray_loops.stall, hvdp_config=HvdpConfig(framework="torch", stall_timeout=6),
                          scaling_config=ScalingConfig(num_workers=2), run_config=storage(tmp_path))
    started = time.perf_counter()
    with pytest.raises(Exception) as raised:
        trainer.fit()
    text = str(raised.value)
    assert "hvdp: the attempt was ended: worker 1 (rank 1, node " in text, text[-3000:]
    assert "never submitted" in text and "never_joined" in text and "stall_timeout=6" in text, text[-3000:]
    assert time.perf_counter() - started < 120
