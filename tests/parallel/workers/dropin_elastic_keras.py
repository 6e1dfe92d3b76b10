"""An existing elastic horovod.tensorflow.keras script, unchanged, on Keras 3: 2 workers -> 1 -> 2.

Only Horovod's own API: hvd.elastic.KerasState, @hvd.elastic.run, model.fit with
hvd.DistributedOptimizer(Adam) and the elastic callbacks (UpdateBatchState, UpdateEpochState,
CommitState). The job runs under ``hvdp run --elastic`` with a discovery script that prints
$HVDP_TEST_OUT/hosts: two names of this machine, one slot each.

1. At epoch 1, batch 3, the first rank 1 removes its host from the file and kills itself.
2. Rank 0 goes back to its last commit and trains on alone.
3. At epoch 2, rank 0 puts the host back and commits until Horovod adds a new worker. That
   worker's optimizer has never taken a step (Keras 3 builds an optimizer's slots lazily):
   KerasState's sync must still give it rank 0's whole optimizer state (Adam's moments and
   step counter), or the ranks' updates differ from then on.

Every worker that finishes writes rank{N}.json: the sizes it trained at, the optimizer's step
counter, digests of its weights and optimizer state, and the largest difference from every rank.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import numpy as np
from tensorflow import keras

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report
from _report import digest

FEATURES, CLASSES, BATCH, BATCHES, EPOCHS = 8, 3, 16, 6, 4
KILL_AT, READD_EPOCH = (1, 3), 2
OUT = os.environ["HVDP_TEST_OUT"]
HOSTS = os.path.join(OUT, "hosts")
KILLED = os.path.join(OUT, "killed")
READD_TIMEOUT_S = 60


def write_hosts(lines: list) -> None:
    with open(HOSTS + ".tmp", "w") as out:
        out.write("".join(f"{line}\n" for line in lines))
    os.replace(HOSTS + ".tmp", HOSTS)


def data(rank: int) -> tuple:
    rng = np.random.default_rng(rank)
    return (rng.normal(size=(BATCH * BATCHES, FEATURES)).astype(np.float32),
            rng.integers(0, CLASSES, size=BATCH * BATCHES))


def main() -> None:
    hvd.init()
    first = not os.path.exists(KILLED)
    keras.utils.set_random_seed(os.getpid())  # different weights on every worker until the sync
    model = keras.Sequential([keras.Input(shape=(FEATURES,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(CLASSES)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    sizes: list = []
    resets: list = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])

    class Scenario(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if not sizes or sizes[-1] != hvd.size():
                sizes.append(hvd.size())
            if (state.epoch, batch) == KILL_AT and first and hvd.rank() == 1:
                mine = os.environ["HOROVOD_HOSTNAME"]
                write_hosts([line for line in open(HOSTS).read().split() if not line.startswith(mine + ":")])
                with open(KILLED, "w") as out:
                    out.write(f"{time.time()} {mine}")
                os.kill(os.getpid(), signal.SIGKILL)
            if state.epoch == READD_EPOCH and hvd.size() == 1:
                write_hosts(open(HOSTS).read().split() + [f"{open(KILLED).read().split()[1]}:1"])
                deadline = time.time() + READD_TIMEOUT_S
                while time.time() < deadline:  # commit() raises once Horovod has added the worker
                    time.sleep(0.1)
                    state.commit()
                raise RuntimeError(f"the worker was not re-added within {READD_TIMEOUT_S} s")

    @hvd.elastic.run
    def train(state) -> None:
        x, y = data(hvd.rank())
        model.fit(x, y, batch_size=BATCH, epochs=EPOCHS - state.epoch, shuffle=False, verbose=0, callbacks=[
            hvd.elastic.UpdateBatchStateCallback(state), hvd.elastic.UpdateEpochStateCallback(state),
            hvd.elastic.CommitStateCallback(state, batches_per_commit=2), Scenario()])

    train(state)
    weights = np.concatenate([np.asarray(v).reshape(-1) for v in model.trainable_variables])
    slots = np.concatenate([np.asarray(v, dtype=np.float64).reshape(-1) for v in model.optimizer.variables])
    everyone = hvd_tf.allgather_object((weights, slots))
    _report.write(hvd.rank(), {
        "rank": hvd.rank(), "size": hvd.size(), "first_incarnation": first, "sizes": sizes, "resets": resets,
        "epoch": state.epoch, "iterations": int(model.optimizer.iterations.numpy()),
        "optimizer_variables": len(model.optimizer.variables), "weights": digest(weights), "slots": digest(slots),
        "max_abs_diff": max(float(np.max(np.abs(w - weights))) for w, _ in everyone),
        "max_abs_diff_slots": max(float(np.max(np.abs(s - slots))) for _, s in everyone),
    })


if __name__ == "__main__":
    main()
