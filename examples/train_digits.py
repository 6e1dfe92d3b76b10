"""Train a digit classifier data-parallel, on PyTorch or TensorFlow, from one script.

The framework is chosen only by the launcher:

    hvdp run -np 2 --framework torch examples/train_digits.py
    hvdp run -np 2 --framework tensorflow examples/train_digits.py

Add ``--profile DIR`` to record each rank's steps, then ``hvdp report DIR``.

Data: scikit-learn's bundled 8x8 digits (1797 images, no download). Each rank
trains on its own shard of every epoch (hvdp.shard), gradients are averaged by
hvdp.DistributedOptimizer, the learning rate is scaled by the number of
processes (linear scaling rule), rank 0 shows progress and prints the loss
averaged over all ranks, and the test accuracy is computed over all ranks.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, Tuple

import numpy as np
from digits_data import load_digits  # examples/digits_data.py, beside this script

import hvdp

HIDDEN = 128
CLASSES = 10


def torch_trainer(lr: float, seed: int) -> Tuple[Callable, Callable]:
    """(train_step(x, y) -> loss, predict(x) -> labels) for a torch MLP."""
    import torch

    torch.manual_seed(seed)
    # One GPU per process where there are GPUs (Horovod then reduces with NCCL), else the CPU.
    device = torch.device("cuda", hvdp.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    model = torch.nn.Sequential(
        torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES)).to(device)
    optimizer = hvdp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=lr), model)
    hvdp.broadcast_state(model, optimizer)
    loss_fn = torch.nn.CrossEntropyLoss()

    def train_step(x: np.ndarray, y: np.ndarray) -> float:
        with hvdp.profiler.phase("compute"):
            optimizer.zero_grad()
            loss = loss_fn(model(torch.from_numpy(x).to(device)), torch.from_numpy(y).to(device))
            loss.backward()
        optimizer.step()  # waits for the gradient allreduce: phase "sync" when profiling
        return loss.item()

    def predict(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(x).to(device)).argmax(dim=1).cpu().numpy()

    return train_step, predict


def tensorflow_trainer(lr: float, seed: int) -> Tuple[Callable, Callable]:
    """(train_step(x, y) -> loss, predict(x) -> labels) for the same MLP in Keras 3."""
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input(shape=(64,)),
        keras.layers.Dense(HIDDEN, activation="relu"),
        keras.layers.Dense(CLASSES),
    ])
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.Adam(learning_rate=lr))
    # Horovod's ops have no XLA kernels: keep Keras from compiling with XLA, its default on GPUs.
    model.compile(optimizer=optimizer, jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hvdp.broadcast_state(model, optimizer)

    def train_step(x: np.ndarray, y: np.ndarray) -> float:
        # One call computes and applies the step; hvdp records its gradient sync as phase "sync".
        return float(model.train_on_batch(x, y))

    def predict(x: np.ndarray) -> np.ndarray:
        return np.argmax(model.predict_on_batch(x), axis=1)

    return train_step, predict


TRAINERS = {"torch": torch_trainer, "tensorflow": tensorflow_trainer}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="examples per replica per step")
    parser.add_argument("--lr", type=float, default=0.001, help="learning rate for one process")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hvdp.init()
    rank, size = hvdp.rank(), hvdp.size()
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    train_step, predict = TRAINERS[hvdp.framework()](args.lr * size, args.seed)
    if rank == 0:
        print(f"hvdp: {hvdp.framework()} on {size} processes, {len(x_train)} training examples, "
              f"{args.batch_size} per replica per step, lr {args.lr * size:g}", flush=True)

    from tqdm import tqdm

    steps_per_epoch = -(-len(hvdp.shard(len(x_train))) // args.batch_size)
    bar = tqdm(total=args.epochs * steps_per_epoch, desc="training", unit="step",
               disable=rank != 0, mininterval=1.0)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        shard = hvdp.shard(len(x_train), seed=args.seed, epoch=epoch)
        losses = []
        for begin in range(0, len(shard), args.batch_size):
            with hvdp.profiler.phase("data"):
                batch = shard[begin:begin + args.batch_size]
                x_batch, y_batch = x_train[batch], y_train[batch]
            losses.append(train_step(x_batch, y_batch))
            hvdp.profiler.step(examples=len(batch))  # records only under hvdp run --profile DIR
            bar.update()
        loss = hvdp.allreduce(float(np.mean(losses)), name="epoch_loss")
        if rank == 0:
            bar.set_postfix(loss=f"{loss:.4f}")
            bar.write(f"epoch {epoch + 1:>3}/{args.epochs}  loss {loss:.4f}  "
                      f"({time.perf_counter() - start:.1f} s)")
    bar.close()

    mine = np.arange(len(x_test))[rank::size]
    correct = hvdp.allreduce(int((predict(x_test[mine]) == y_test[mine]).sum()), op="sum")
    total = hvdp.allreduce(len(mine), op="sum")
    if rank == 0:
        print(f"test accuracy: {correct / total:.4f} ({correct}/{total}, {hvdp.framework()}, "
              f"{size} processes, {time.perf_counter() - start:.1f} s)", flush=True)
    hvdp.shutdown()


if __name__ == "__main__":
    main()
