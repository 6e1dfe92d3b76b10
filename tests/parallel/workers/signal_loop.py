"""A job that trains until it is stopped, for the signal tests: every rank reports its pid once
it has taken part in a collective, then keeps calling allreduce.

argv[1]:
- ``plain``: every rank loops;
- ``ignore-term``: rank 1 catches SIGTERM and then hangs without calling collectives (a
  script whose own handler never returns, e.g. stuck saving), so only SIGKILL ends it;
- ``elastic``: the loop runs inside hvdp.elastic.run with a State that commits every 10 steps;
- ``caret``: rank 1 fails with a traceback whose ``~~~^^^`` markers Python writes piece by
  piece when unbuffered (what the ``--mpi`` output must keep readable); rank 0 waits.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import hvdp

hvdp.init()

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import _report

MODE = sys.argv[1]


def report() -> None:
    _report.write(hvdp.rank(), {"rank": hvdp.rank(), "size": hvdp.size(), "pid": os.getpid(),
                                "host": os.environ.get("HOROVOD_HOSTNAME", "")})


def lookup(table: dict) -> int:
    return table["missing key"] + 1


def hang(_signum: int, _frame: object) -> None:
    while True:
        time.sleep(1)


def main() -> None:
    if MODE == "ignore-term" and hvdp.rank() == 1:
        signal.signal(signal.SIGTERM, hang)
    if MODE == "caret":
        hvdp.barrier()
        if hvdp.rank() == 1:
            lookup({"present": 1})
        time.sleep(60)
        return
    if MODE == "elastic":
        state = hvdp.elastic.State(None, None, step=0)

        @hvdp.elastic.run
        def train(state: hvdp.elastic.State) -> None:
            hvdp.barrier()
            report()
            while True:
                hvdp.allreduce(1.0, name="loop")
                state.step += 1
                if state.step % 10 == 0:
                    state.commit()
                time.sleep(0.05)

        train(state)
        return
    hvdp.barrier()
    report()
    while True:
        hvdp.allreduce(1.0, name="loop")
        time.sleep(0.05)


if __name__ == "__main__":
    main()
