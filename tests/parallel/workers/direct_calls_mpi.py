"""hvdp.allreduce's direct calls under ``hvdp run --mpi`` (their MPI peer, hvdp.backends.direct_mpi): the small
calls by one exchange, the large ones by MPI's allreduce and through shared memory, each beside the same call
on Horovod's path, and the refusals of calls that differ between ranks; the same cases as the Gloo job's
(direct_path.py), so both are checked by the same tests (test_direct_path.py). The gradient path stays
Horovod's under MPI: reported, to be checked."""

from __future__ import annotations

from typing import Any, Dict

from _report import write
from direct_path import calls, large_calls, shared_memory_calls

import hvdp
from hvdp.backends.torch.direct import allreduce as direct_allreduce


def main() -> None:
    hvdp.init(framework="torch")
    record: Dict[str, Any] = {"rank": hvdp.rank(), "size": hvdp.size(),
                              "controller": direct_allreduce.controller(),
                              "gradients direct": direct_allreduce.DirectAllreduce().usable()}
    record["calls"] = calls()
    record["large calls"] = large_calls()
    record["shared memory"] = shared_memory_calls()
    write(hvdp.rank(), record)


if __name__ == "__main__":
    main()
