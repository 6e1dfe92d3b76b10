"""Train several models side by side in one job: one process set per model.

    hvdp run -np 4 --framework torch examples/ensemble.py
    mpirun --allow-run-as-root --oversubscribe -np 4 python examples/ensemble.py --framework tensorflow

The job's processes are split into process sets of ``--per-set`` processes
(4 processes: sets [0, 1] and [2, 3]). Each set trains its own digit classifier,
a small sweep: set i has hidden width ``WIDTHS[i]`` and its own seed. Within a
set, training is data-parallel: the members split the data
(``hvdp.shard(process_set=...)``) and average gradients among themselves only
(``hvdp.DistributedOptimizer(process_set=...)``); the first member of each set
prints its model's test accuracy. Then the models vote: rank 0 prints the
accuracy of their averaged probabilities.

Data: scikit-learn's bundled 8x8 digits (no download).
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, Optional, Tuple

import numpy as np
from digits_data import load_digits  # examples/digits_data.py, beside this script

import hvdp

WIDTHS = (64, 128, 32, 256)
CLASSES = 10
Trainer = Tuple[Callable[[np.ndarray, np.ndarray], float], Callable[[np.ndarray], np.ndarray]]


def torch_trainer(hidden: int, lr: float, seed: int, group: hvdp.ProcessSet) -> Trainer:
    """(train_step(x, y) -> loss, logits(x)) for a torch MLP trained within ``group``."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, CLASSES))
    optimizer = hvdp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=lr), model, process_set=group)
    hvdp.broadcast_state(model, optimizer, process_set=group)

    def train_step(x: np.ndarray, y: np.ndarray) -> float:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
        return loss.item()

    def logits(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(x)).numpy()

    return train_step, logits


def tensorflow_trainer(hidden: int, lr: float, seed: int, group: hvdp.ProcessSet) -> Trainer:
    """(train_step(x, y) -> loss, logits(x)) for the same MLP in Keras 3, trained within ``group``."""
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input(shape=(64,)), keras.layers.Dense(hidden, activation="relu"),
                              keras.layers.Dense(CLASSES)])
    optimizer = hvdp.DistributedOptimizer(keras.optimizers.Adam(learning_rate=lr), process_set=group)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hvdp.broadcast_state(model, optimizer, process_set=group)
    return (lambda x, y: float(model.train_on_batch(x, y))), (lambda x: np.asarray(model.predict_on_batch(x)))


TRAINERS = {"torch": torch_trainer, "tensorflow": tensorflow_trainer}


def softmax(logits: np.ndarray) -> np.ndarray:
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    return exp / exp.sum(axis=1, keepdims=True)


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=["torch", "tensorflow"], default=None,
                        help="default: hvdp run --framework, or the only one installed")
    parser.add_argument("--per-set", type=int, default=2, help="processes that train one model")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="examples per process per step")
    parser.add_argument("--lr", type=float, default=0.001, help="learning rate for one process")
    args = parser.parse_args(argv)

    # The sets depend on the job's size, known once hvdp runs: add them after init.
    hvdp.init(framework=args.framework, process_sets="dynamic")
    size, k = hvdp.size(), args.per_set
    if k < 1 or size % k or size // k > len(WIDTHS):
        raise SystemExit(f"ensemble.py: {size} processes cannot form sets of --per-set {k} "
                         f"(need a multiple of {k}, at most {len(WIDTHS)} sets).")
    sets = [hvdp.add_process_set(range(i * k, (i + 1) * k)) for i in range(size // k)]
    group = hvdp.my_process_set(sets)
    index, leader = sets.index(group), group.rank() == 0
    hidden, seed = WIDTHS[index], index

    x_train, y_train, x_test, y_test = load_digits(seed=0)
    train_step, logits = TRAINERS[hvdp.framework()](hidden, args.lr * k, seed, group)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        shard = hvdp.shard(len(x_train), seed=seed, epoch=epoch, process_set=group)
        losses = [train_step(x_train[shard[b:b + args.batch_size]], y_train[shard[b:b + args.batch_size]])
                  for b in range(0, len(shard), args.batch_size)]
        loss = hvdp.allreduce(float(np.mean(losses)), process_set=group)
        if leader and (epoch + 1) % 5 == 0:
            print(f"set {index}: epoch {epoch + 1:>3}/{args.epochs}  loss {loss:.4f}", flush=True)

    mine = np.arange(len(x_test))[group.rank()::k]
    correct = hvdp.allreduce(int((logits(x_test[mine]).argmax(axis=1) == y_test[mine]).sum()), op="sum",
                             process_set=group)
    total = hvdp.allreduce(len(mine), op="sum", process_set=group)
    if leader:
        print(f"set {index} (ranks {list(group.ranks)}, hidden {hidden}): test accuracy {correct / total:.4f} "
              f"({correct}/{total}, {hvdp.framework()}, {k} processes, {time.perf_counter() - start:.1f} s)",
              flush=True)

    # Every model's probabilities, averaged over the whole job (each set's replicas are identical).
    votes = hvdp.allreduce(softmax(logits(x_test)).astype(np.float64), name="ensemble.votes")
    if hvdp.rank() == 0:
        accuracy = float((votes.argmax(axis=1) == y_test).mean())
        print(f"ensemble of {len(sets)} models: test accuracy {accuracy:.4f} ({hvdp.framework()}, "
              f"{size} processes)", flush=True)
    hvdp.shutdown()


if __name__ == "__main__":
    main()
