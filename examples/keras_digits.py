"""One Keras 3 model, trained data-parallel with model.fit on PyTorch or TensorFlow.

The launcher flag alone picks the framework that runs Keras and reduces its gradients:

    hvdp run -np 2 --framework torch examples/keras_digits.py
    hvdp run -np 2 --framework tensorflow examples/keras_digits.py

Data: scikit-learn's bundled 8x8 digits (no download), split 80/20; each rank
fits on its own shard; the learning rate follows the linear scaling rule with
a warm-up; metrics are averaged over ranks; rank 0 prints per-epoch loss and
time and the test accuracy over all ranks.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict, Optional

import numpy as np
from digits_data import load_digits  # examples/digits_data.py, beside this script

import hvdp
import hvdp.keras  # the callbacks; Keras itself is imported after hvdp.init()


def build_model(keras: Any) -> Any:
    """The one model definition, whatever runs it."""
    return keras.Sequential([
        keras.Input(shape=(64,)),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dropout(0.1),
        keras.layers.Dense(10),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="examples per replica per step")
    parser.add_argument("--lr", type=float, default=0.001, help="learning rate for one process")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    hvdp.init()  # sets KERAS_BACKEND to the framework before Keras is imported
    import keras

    rank, size = hvdp.rank(), hvdp.size()
    x_train, y_train, x_test, y_test = load_digits(args.seed)
    shard = hvdp.shard(len(x_train), seed=args.seed)
    keras.utils.set_random_seed(args.seed + rank)  # replicas differ until BroadcastInitialState
    model = build_model(keras)
    model.compile(optimizer=hvdp.DistributedOptimizer(keras.optimizers.Adam(args.lr * size)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    class EpochReport(keras.callbacks.Callback):
        """Per-epoch loss (averaged over ranks by MetricAverage) and time, on rank 0."""

        def __init__(self) -> None:
            super().__init__()
            self.times: list = []

        def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
            self.times.append(time.perf_counter() - self.start)
            if rank == 0 and logs:
                print(f"epoch {epoch + 1:>3}/{args.epochs}  loss {logs['loss']:.4f}  "
                      f"accuracy {logs['accuracy']:.4f}  {self.times[-1]:.2f} s", flush=True)

    report = EpochReport()
    if rank == 0:
        print(f"hvdp: Keras {keras.__version__} on {keras.backend.backend()}, {size} processes, "
              f"{len(shard)} examples per replica", flush=True)
    model.fit(x_train[shard], y_train[shard], batch_size=args.batch_size, epochs=args.epochs, verbose=0,
              callbacks=[hvdp.keras.BroadcastInitialState(), hvdp.keras.LearningRateWarmup(warmup_epochs=3),
                         hvdp.keras.MetricAverage(), report])

    mine = np.arange(len(x_test))[rank::size]
    predicted = np.argmax(keras.ops.convert_to_numpy(model.predict(x_test[mine], verbose=0)), axis=1)
    correct = hvdp.allreduce(int((predicted == y_test[mine]).sum()), op="sum")
    total = hvdp.allreduce(len(mine), op="sum")
    epoch_time = float(np.median(report.times[1:] or report.times))
    if rank == 0:
        print(f"test accuracy: {correct / total:.4f} ({correct}/{total}, {keras.backend.backend()}, "
              f"{size} processes, median epoch {epoch_time:.3f} s)", flush=True)
    hvdp.shutdown()


if __name__ == "__main__":
    main()
