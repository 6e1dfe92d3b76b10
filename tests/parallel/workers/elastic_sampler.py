"""hvdp.elastic.Sampler through 3 -> 2 -> 3 workers in the middle of an epoch, on the framework
hvdp run chose, with a torch module (argv[1] == "torch") or a Keras 3 model ("keras").

The discovery script prints $HVDP_TEST_OUT/hosts: three names of this machine, one slot each.

1. Epoch 1, batch 6 of the first rank 2 (between commits, every 4 batches): it removes its host
   from the file and kills itself with SIGKILL. The others go back to the commit at batch 4.
2. Two workers train 3 batches; then rank 0 lists the host again and every worker commits until
   Horovod adds the new worker; three workers finish the epoch. (The commit comes after a
   step, never between taking a batch and training it: a batch counts as trained at the
   next commit.)

Every step, the workers gather the indices they trained and the state keeps them, with the
number of workers, in ``state.log``: the log is committed, restored and synced with the model,
so it holds exactly the steps the final model learned from. Every worker reports the log, and
``hvdp.DistributedSampler``'s shares each time the workers change (its length and every worker's part).
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

N, BATCH, EPOCHS, COMMIT_EVERY = 240, 4, 3, 4
OUT = os.environ["HVDP_TEST_OUT"]
HOSTS, KILLED = os.path.join(OUT, "hosts"), os.path.join(OUT, "killed")
READD_TIMEOUT_S = 90


def write_hosts(lines: list) -> None:
    with open(HOSTS + ".tmp", "w") as out:
        out.write("".join(f"{line}\n" for line in lines))
    os.replace(HOSTS + ".tmp", HOSTS)


def main() -> None:
    model, optimizer, step, _ = {"torch": torch_parts, "keras": keras_parts}[sys.argv[1]](os.getpid())
    data = np.random.default_rng(0)
    x, y = data.normal(size=(N, 8)).astype(np.float32), data.integers(0, 3, size=N)
    first = not os.path.exists(KILLED)
    state = hvdp.elastic.State(model, optimizer, sampler=hvdp.elastic.Sampler(N, BATCH, seed=3), epoch=0,
                               log=[], steps_at_2=0, shares=[])
    dealt = hvdp.DistributedSampler(N, seed=3)  # reads the workers when asked: after a resize, the new ones

    @hvdp.elastic.run
    def train(state: hvdp.elastic.State) -> None:
        while state.epoch < EPOCHS:
            for number, idx in enumerate(state.sampler.batches(state.epoch), 1):
                size = hvdp.size()
                if state.epoch == 1 and number == 6 and first and hvdp.rank() == 2 and size == 3:
                    mine = os.environ["HOROVOD_HOSTNAME"]
                    write_hosts([h for h in open(HOSTS).read().split() if not h.startswith(mine + ":")])
                    with open(KILLED, "w") as out:
                        out.write(mine)
                    os.kill(os.getpid(), signal.SIGKILL)
                step(x[idx], y[idx])
                if not state.shares or state.shares[-1][:2] != [state.epoch, size]:
                    dealt.set_epoch(state.epoch)
                    parts = hvdp.allgather_object(dealt.indices().tolist())
                    state.shares.append([state.epoch, size, len(dealt), parts])
                trained = hvdp.allgather_object(idx.tolist())
                state.log.append([state.epoch, size, [i for part in trained for i in part]])
                if size == 2:
                    state.steps_at_2 += 1
                if number % COMMIT_EVERY == 0:
                    state.commit()
                if size == 2 and state.steps_at_2 == 3:  # after the 3rd step at 2: every worker
                    if hvdp.rank() == 0:
                        write_hosts(open(HOSTS).read().split() + [f"{open(KILLED).read()}:1"])
                    state.steps_at_2 += 1
                    deadline = time.time() + READD_TIMEOUT_S
                    while time.time() < deadline:  # commit() raises once Horovod has added the worker
                        time.sleep(0.1)
                        state.commit()
                    raise RuntimeError(f"the worker was not re-added within {READD_TIMEOUT_S} s")
            state.epoch += 1
            state.commit()

    train(state)
    _report.write(hvdp.rank(), {"rank": hvdp.rank(), "size": hvdp.size(), "first_incarnation": first,
                                "log": state.log, "shares": state.shares})
    hvdp.shutdown()


if __name__ == "__main__":
    main()
