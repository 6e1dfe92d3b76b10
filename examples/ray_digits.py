"""Train the digits classifier data-parallel on a Ray cluster, with torch or Keras on TensorFlow.

    python examples/ray_digits.py --framework torch                  # a local Ray cluster of 2 workers
    python examples/ray_digits.py --framework tensorflow --address HEAD:6379

hvdp.ray.HvdpTrainer starts the workers; inside the loop hvdp works as under hvdp run (hvdp.init,
DistributedOptimizer, broadcast_state, shard, allreduce), beside Ray's own calls: every epoch each
worker calls ray.train.report (worker 0 with a checkpoint of the model and its optimizer), and a group
Ray starts again after a failure resumes from ray.train.get_checkpoint(). ``--fault-epoch N`` makes
worker 1 exit at epoch N of the first attempt (with ``--max-failures 1`` Ray starts the group again).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pickle
import socket
import tempfile
import time
from typing import Any, Dict, List, Tuple

import numpy as np
import ray
import ray.train
from digits_data import load_digits  # examples/digits_data.py, beside this script
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

import hvdp
from hvdp.ray import HvdpConfig, HvdpTrainer


def torch_model(lr: float) -> Tuple[Any, Any, Any]:
    """(step(x, y) -> loss, predict(x) -> labels, state: (get() -> picklable, set(state))) for a torch MLP."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = hvdp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=lr), model)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x: np.ndarray, y: np.ndarray) -> float:
        optimizer.zero_grad()
        loss = loss_fn(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
        return float(loss.item())

    def predict(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(x)).argmax(dim=1).numpy()

    def get() -> Dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def put(state: Dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    hvdp.broadcast_state(model, optimizer)
    return step, predict, (get, put, lambda: [p.detach().numpy().copy() for p in model.parameters()])


def keras_model(lr: float) -> Tuple[Any, Any, Any]:
    """The same MLP in Keras 3, trained with model.fit."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.Adam(learning_rate=lr))
    model.compile(optimizer=optimizer, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    optimizer.build(model.trainable_variables)

    def step(x: np.ndarray, y: np.ndarray) -> float:
        history = model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        return float(history.history["loss"][-1])

    def predict(x: np.ndarray) -> np.ndarray:
        return np.argmax(model.predict_on_batch(x), axis=1)

    def get() -> Dict[str, Any]:
        return {"model": [w.numpy() for w in model.weights], "optimizer": [v.numpy() for v in optimizer.variables]}

    def put(state: Dict[str, Any]) -> None:
        for variable, value in zip(model.weights, state["model"]):
            variable.assign(value)
        for variable, value in zip(optimizer.variables, state["optimizer"]):
            variable.assign(value)

    hvdp.broadcast_state(model, optimizer)
    return step, predict, (get, put, lambda: [w.numpy().copy() for w in model.weights])


def train_loop(config: Dict[str, Any]) -> None:
    """Each worker's loop: one hvdp job per worker group, resumed from Ray's checkpoint after a failure."""
    entered = time.time()
    started = time.perf_counter()
    # The framework HvdpConfig set for this worker (Keras picks its backend from KERAS_BACKEND, set too):
    # imported first, so that the time of hvdp.init() below is Horovod's start and Gloo's rendezvous.
    importlib.import_module("torch" if os.environ["HVDP_FRAMEWORK"] == "torch" else "keras")
    import_s = time.perf_counter() - started
    hvdp.init()
    rendezvous_s = time.perf_counter() - started - import_s
    rank, size = hvdp.rank(), hvdp.size()
    x_train, y_train, x_test, y_test = ray.get(config["data"])
    batch = config["batch_size"] if hvdp.framework() == "torch" else len(x_train)  # fit batches itself
    step, predict, (get, put, weights) = (torch_model if hvdp.framework() == "torch" else keras_model)(
        config["lr"] * size)
    first_epoch, resumed = 0, ray.train.get_checkpoint()
    if resumed is not None:
        with resumed.as_directory() as folder, open(os.path.join(folder, "state.pkl"), "rb") as f:
            saved = pickle.load(f)
        put(saved["state"])
        first_epoch = saved["epoch"] + 1
    attempt = ray.train.get_context().get_world_rank(), first_epoch
    trained, report_s = time.perf_counter(), 0.0
    for epoch in range(first_epoch, config["epochs"]):
        if epoch == config["fault_epoch"] and rank == 1 and resumed is None:
            os._exit(1)  # worker 1 dies in the first attempt; Ray starts the group again
        shard = hvdp.shard(len(x_train), seed=0, epoch=epoch)
        losses = [step(x_train[shard[i:i + batch]], y_train[shard[i:i + batch]]) for i in range(0, len(shard), batch)]
        loss = hvdp.allreduce(float(np.mean(losses)), name="epoch_loss")
        reporting = time.perf_counter()
        with tempfile.TemporaryDirectory() as folder:
            checkpoint = None
            if rank == 0:
                with open(os.path.join(folder, "state.pkl"), "wb") as f:
                    pickle.dump({"epoch": epoch, "state": get()}, f)
                checkpoint = ray.train.Checkpoint.from_directory(folder)
            ray.train.report({"epoch": epoch, "loss": loss}, checkpoint=checkpoint)
        report_s += time.perf_counter() - reporting  # Ray's report and checkpoint, apart from training
    train_s = time.perf_counter() - trained
    mine = np.arange(len(x_test))[rank::size]
    correct = hvdp.allreduce(int((predict(x_test[mine]) == y_test[mine]).sum()), op="sum")
    total = hvdp.allreduce(len(mine), op="sum")
    flat = np.concatenate([w.ravel() for w in weights()])
    workers = hvdp.allgather_object({
        "rank": rank, "world_rank": attempt[0], "resumed_from_epoch": attempt[1], "node": socket.gethostname(),
        "node_ip": ray.util.get_node_ip_address(), "local_rank": hvdp.local_rank(), "local_size": hvdp.local_size(),
        "cross_rank": hvdp.cross_rank(), "cross_size": hvdp.cross_size(), "framework": hvdp.framework(),
        "keras_backend": os.environ.get("KERAS_BACKEND"), "ray_start_s": entered - config["submitted"],
        "import_s": import_s, "rendezvous_s": rendezvous_s, "train_s": train_s, "report_s": report_s,
        "weights_sum": float(flat.sum())})
    if rank == 0:
        with tempfile.TemporaryDirectory() as folder:
            np.save(os.path.join(folder, "weights.npy"), flat)
            ray.train.report({"epoch": config["epochs"], "accuracy": correct / total, "workers": workers},
                             checkpoint=ray.train.Checkpoint.from_directory(folder))
    else:
        ray.train.report({"epoch": config["epochs"]}, checkpoint=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=["torch", "tensorflow"], default="torch")
    parser.add_argument("--address", default=None, help="a running Ray cluster (HEAD:PORT); default: a local one")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--placement-strategy", default="PACK", choices=["PACK", "SPREAD", "STRICT_SPREAD"],
                        help="Ray's placement of the workers on the nodes (ScalingConfig)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="examples per worker per step (torch)")
    parser.add_argument("--lr", type=float, default=0.001, help="learning rate for one worker")
    parser.add_argument("--fault-epoch", type=int, default=-1, help="worker 1 exits at this epoch, once")
    parser.add_argument("--max-failures", type=int, default=0)
    parser.add_argument("--storage", default=None, help="where Ray keeps checkpoints (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="write the result (accuracy, times, weights) here")
    args = parser.parse_args()

    begun = time.time()
    ray.init(address=args.address, num_cpus=None if args.address else args.workers, include_dashboard=False,
             log_to_driver=False)
    storage = args.storage or tempfile.mkdtemp(prefix="hvdp-ray-")
    data = ray.put(load_digits(0))
    config = {"data": data, "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
              "fault_epoch": args.fault_epoch, "submitted": time.time()}
    trainer = HvdpTrainer(train_loop, train_loop_config=config,
                          hvdp_config=HvdpConfig(framework=args.framework, stall_timeout=60),
                          scaling_config=ScalingConfig(num_workers=args.workers,
                                                       placement_strategy=args.placement_strategy),
                          run_config=RunConfig(name=f"digits-{args.framework}-{int(begun)}", storage_path=storage,
                                               failure_config=FailureConfig(max_failures=args.max_failures),
                                               checkpoint_config=CheckpointConfig(num_to_keep=2)))
    result = trainer.fit()
    fit_s = time.time() - config["submitted"]
    with result.checkpoint.as_directory() as folder:
        weights: List[float] = np.load(os.path.join(folder, "weights.npy")).tolist()
    metrics = result.metrics
    print(f"test accuracy: {metrics['accuracy']:.4f} ({args.framework}, {args.workers} Ray workers on "
          f"{len({w['node_ip'] for w in metrics['workers']})} node(s), fit {fit_s:.1f} s, Ray's start "
          f"{max(w['ray_start_s'] for w in metrics['workers']):.1f} s, hvdp.init "
          f"{max(w['rendezvous_s'] for w in metrics['workers']):.2f} s)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"accuracy": metrics["accuracy"], "workers": metrics["workers"], "fit_s": fit_s,
                       "total_s": time.time() - begun, "weights": weights}, f)
    ray.shutdown()


if __name__ == "__main__":
    main()
