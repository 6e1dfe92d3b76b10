"""A training loop in which rank 1 fails at step 5 (argv[1]): kill9 (SIGKILL to itself), raise
(an exception), stall (it stops taking part in collectives), vanish (SIGKILL to itself and to the
process that started it, as when its container is killed), or pause (SIGSTOP to both, as when its
container is paused); or late: rank 1 never reaches hvdp.init() (it sleeps before it). Rank 1 writes
the moment of the fault to $HVDP_TEST_OUT/fault_time so the test can time the detection."""

from __future__ import annotations

import os
import signal
import time

import torch

import hvdp

FAULT_STEP = 5


def main() -> None:
    mode = os.sys.argv[1]
    if mode == "late" and os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK")) == "1":
        with open(os.path.join(os.environ["HVDP_TEST_OUT"], "fault_time"), "w") as out:
            out.write(str(time.time()))
        time.sleep(3600)  # never reaches hvdp.init(): rank 0's Horovod init waits for it
    hvdp.init()
    rank = hvdp.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = hvdp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    for step in range(1000):
        if rank == 1 and step == FAULT_STEP:
            with open(os.path.join(os.environ["HVDP_TEST_OUT"], "fault_time"), "w") as out:
                out.write(str(time.time()))
            if mode == "kill9":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "raise":
                raise RuntimeError("injected failure at step 5")
            if mode == "stall":
                time.sleep(3600)
            if mode in ("vanish", "pause"):
                sig = signal.SIGKILL if mode == "vanish" else signal.SIGSTOP
                os.kill(os.getppid(), sig)
                os.kill(os.getpid(), sig)
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        time.sleep(0.01)
    hvdp.shutdown()


if __name__ == "__main__":
    main()
