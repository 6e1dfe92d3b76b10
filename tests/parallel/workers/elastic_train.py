"""Elastic training that goes from 2 workers to 1 and back to 2, on the framework hvdp run chose,
with a torch module (argv[1] == "torch"; "sharded": its Adam with shard_optimizer_state=True) or a
Keras 3 model ("keras", on either Keras backend; "keras-sharded": its Adam sharded).

The job runs under ``hvdp run --elastic`` with a discovery script that prints the file
$HVDP_TEST_OUT/hosts: two names of this machine (localhost and 127.0.0.1), one slot each,
so that Horovod can blacklist the "host" of the killed worker and keep the other.

1. At epoch 1, batch 5 (between commits), the first rank 1 removes its host from the file
   (the machine leaves) and kills itself with SIGKILL.
2. Rank 0 goes back to its last commit and trains on alone.
3. At epoch 2, batch 4, rank 0 puts the host back in the file and keeps committing until
   Horovod adds the new worker (after the blacklist cooldown): training goes on with 2.

Every worker that finishes writes rank{N}.json: each commit's step counter in order, the
step counter and size at each (re)start of the training function, the sizes it trained at,
its reset callbacks, timestamps of the events, and its final parameters' digest and largest
difference from every other rank's; and, for every model but unsharded Keras, the Adam step counters
of the whole optimizer state and how many elements of Adam's first moment this rank holds. With Keras sharded on
TensorFlow, rank 0 also traces a step at np=2 and runs it at np=1: what it raised ("stale").
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import hvdp

hvdp.init()

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _report
from _parts import keras_parts, torch_parts
from _report import digest

EPOCHS, BATCHES, COMMIT_EVERY, BATCH = 4, 8, 2, 16
KILL_AT, READD_AT = (1, 5), (2, 4)
OUT = os.environ["HVDP_TEST_OUT"]
HOSTS = os.path.join(OUT, "hosts")
KILLED = os.path.join(OUT, "killed")
READD_TIMEOUT_S = 60


def batch(epoch: int, number: int, rank: int) -> tuple:
    data = np.random.default_rng(10_000 * epoch + 100 * number + rank)
    return data.normal(size=(BATCH, 8)).astype(np.float32), data.integers(0, 3, size=BATCH)


PARTS = {"torch": torch_parts, "keras": keras_parts, "sharded": lambda seed: torch_parts(seed, shard=True),
         "keras-sharded": lambda seed: keras_parts(seed, shard=True)}


def adam(optimizer) -> dict:
    """The step counters of the whole state (gathered when sharded: every rank calls it) and this rank's part."""
    if sys.argv[1] == "keras":
        return {}
    if sys.argv[1] == "keras-sharded":  # one step counter; the first moments are this rank's pieces
        return {"adam_steps": [float(optimizer.iterations.numpy())],
                "adam_elements": sum(int(np.prod(m.shape)) for m in optimizer._momentums)}
    whole = optimizer.state_dict()
    return {"adam_steps": sorted({float(s["step"]) for s in whole["state"].values()}),
            "adam_elements": sum(int(s["exp_avg"].numel()) for s in optimizer.state.values())}


def write_hosts(lines: list) -> None:
    """Replace the hosts file atomically, so the discovery script never reads half of it."""
    with open(HOSTS + ".tmp", "w") as out:
        out.write("".join(f"{line}\n" for line in lines))
    os.replace(HOSTS + ".tmp", HOSTS)


def main() -> None:
    # Seeded by the process id: different on every worker until the state is synced.
    model, optimizer, step, flat = PARTS[sys.argv[1]](os.getpid())
    commits: list = []
    sizes: list = []
    events: list = []
    resets: list = []
    starts: list = []
    first = not os.path.exists(KILLED)
    state = hvdp.elastic.State(model, optimizer, epoch=0, batch=0, step=0)
    state.register_reset_callbacks([lambda: resets.append(hvdp.size())])

    stale: dict = {}

    def trace_a_step() -> None:
        """A step compiled for the np=2 layout (traced, not run), for rank 0 to run at np=1; and a second
        sharded optimizer outside the State (every rank makes it, as it would be in a real script)."""
        import keras

        if sys.argv[1] != "keras-sharded":
            return
        other, other_optimizer, _, _ = keras_parts(1, shard=True)
        other_optimizer.build(other.trainable_variables)
        stale["other"] = (other, other_optimizer)
        if keras.backend.backend() == "tensorflow" and hvdp.rank() == 0:
            import tensorflow as tf

            zeros = [tf.zeros(v.shape) for v in model.trainable_variables]
            stale["step"] = tf.function(lambda: optimizer.apply(zeros, model.trainable_variables)) \
                .get_concrete_function()

    def run_stale() -> None:
        if "other" in stale and "unmanaged" not in stale:
            import keras

            other, other_optimizer = stale.pop("other")
            stale["unmanaged"] = _report.refusal(lambda: other_optimizer.apply(
                [keras.ops.zeros(v.shape) for v in other.trainable_variables], other.trainable_variables))
        if "step" in stale and "raised" not in stale:
            stale["raised"] = _report.refusal(stale["step"])

    def commit() -> None:
        commits.append(state.step)
        state.commit()

    @hvdp.elastic.run
    def train(state: hvdp.elastic.State) -> None:
        starts.append([state.step, hvdp.size()])  # after the sync (or the restore)
        if hvdp.size() == 2 and first and not starts[:-1]:
            trace_a_step()
        if hvdp.size() == 1:
            run_stale()
        while state.epoch < EPOCHS:
            while state.batch < BATCHES:
                size = hvdp.size()
                if (state.epoch, state.batch) == KILL_AT and first and hvdp.rank() == 1:
                    mine = os.environ["HOROVOD_HOSTNAME"]
                    kept = [line for line in open(HOSTS).read().split() if not line.startswith(mine + ":")]
                    write_hosts(kept)
                    with open(KILLED, "w") as out:
                        out.write(f"{time.time()} {mine}")
                    os.kill(os.getpid(), signal.SIGKILL)
                if (state.epoch, state.batch) == READD_AT and size == 1:
                    host = open(KILLED).read().split()[1]
                    write_hosts(open(HOSTS).read().split() + [f"{host}:1"])
                    events.append(["readd", time.time()])
                    deadline = time.time() + READD_TIMEOUT_S
                    while time.time() < deadline:  # commit() raises once Horovod has added the worker
                        time.sleep(0.1)
                        commit()
                    raise RuntimeError(f"the worker was not re-added within {READD_TIMEOUT_S} s")
                step(*batch(state.epoch, state.batch, hvdp.rank()))
                state.batch += 1
                state.step += 1
                if not sizes or sizes[-1] != size:
                    sizes.append(size)
                    events.append([f"first step at size {size}", time.time()])
                if state.batch % COMMIT_EVERY == 0:
                    commit()
            state.epoch, state.batch = state.epoch + 1, 0
            commit()

    train(state)
    parameters = flat()
    everyone = hvdp.allgather_object(parameters)
    _report.write(hvdp.rank(), {**adam(optimizer),
        "rank": hvdp.rank(), "size": hvdp.size(), "first_incarnation": first, "commits": commits,
        "sizes": sizes, "resets": resets, "starts": starts, "events": events, "epoch": state.epoch, "step": state.step,
        "final": digest(parameters),
        "max_abs_diff": max(float(np.max(np.abs(other - parameters))) for other in everyone),
        **({"stale": stale["raised"]} if "raised" in stale else {}),
        **({"unmanaged": stale["unmanaged"]} if "unmanaged" in stale else {}),
    })
    hvdp.shutdown()


if __name__ == "__main__":
    main()
