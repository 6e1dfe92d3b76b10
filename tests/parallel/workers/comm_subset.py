"""hvdp on part of an MPI job: `mpirun -np 4 python comm_subset.py FRAMEWORK comm|ranks`.

Ranks 0 and 1 train with hvdp on an mpi4py communicator of their own (``comm``)
or on the rank list [0, 1] (``ranks``); ranks 2 and 3 never start hvdp and run
mpi4py collectives among themselves until rank 0 tells them training is over. Every rank also reports how
hvdp.init refuses a comm that does not fit.
"""

from __future__ import annotations

import sys
import time

from mpi4py import MPI

import hvdp

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _report
import _train
from _report import refusal

DONE = 7  # the message tag rank 0 sends when training is over


def main() -> None:
    framework, mode = sys.argv[1], sys.argv[2]
    world = MPI.COMM_WORLD
    me = world.Get_rank()
    trainers = world.Split(0 if me < 2 else MPI.UNDEFINED, me)  # MPI.COMM_NULL on ranks 2 and 3
    others = world.Split(1 if me >= 2 else MPI.UNDEFINED, me)
    record = {"rank": me, "world_size": world.Get_size(), "mode": mode, "errors": {
        "not_a_communicator": refusal(lambda: hvdp.init(framework, comm=object())),
        "outside_the_world": refusal(lambda: hvdp.init(framework, comm=[0, 7])),
        "repeated_rank": refusal(lambda: hvdp.init(framework, comm=[0, 0])),
    }}
    if me < 2:
        hvdp.init(framework, comm=trainers if mode == "comm" else [0, 1])
        record.update(hvdp_rank=hvdp.rank(), hvdp_size=hvdp.size(),
                      sum_of_ranks=hvdp.allreduce(hvdp.rank() + 1, op="sum"),
                      world_ranks=hvdp.allgather_object(me), train_started=time.time())
        record.update(_train.train(framework))
        record["train_finished"] = time.time()
        hvdp.shutdown()
        if me == 0:
            world.send("done", dest=2, tag=DONE)
    else:
        record["errors"]["comm_null"] = refusal(lambda: hvdp.init(framework, comm=trainers))
        record["errors"]["not_listed"] = refusal(lambda: hvdp.init(framework, comm=[0, 1]))
        record["hvdp_initialized"] = hvdp.is_initialized()
        # Other MPI work among ranks 2 and 3 for as long as ranks 0 and 1 train.
        record["work_started"], sums, done = time.time(), [], 0
        while not done:
            sums.append(others.allreduce(me))
            done = others.allreduce(1 if me == 2 and world.Iprobe(source=0, tag=DONE) else 0)
            time.sleep(0.02)
        if me == 2:
            world.recv(source=0, tag=DONE)
        record.update(work_finished=time.time(), mpi_collectives=len(sums), mpi_sums=sorted(set(sums)),
                      mpi_peers=others.Get_size())
    _report.write(me, record)
    world.Barrier()  # MPI_COMM_WORLD still works for everyone afterwards


if __name__ == "__main__":
    main()
