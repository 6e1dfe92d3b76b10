"""hvdp.allreduce's direct calls under ``hvdp run --mpi`` (their MPI peer, hvdp.backends.direct_mpi): the small
calls by one exchange, the large ones by MPI's allreduce and through shared memory, each beside the same call
on Horovod's path, and the refusals of calls that differ between ranks; the same cases as the Gloo job's
(direct_path.py), so both are checked by the same tests (test_direct_path.py). The gradient path stays
Horovod's under MPI: reported, to be checked. With ``without-mpi4py``, ``import mpi4py`` fails (``sys.modules``)
as where it is not installed: the calls keep Horovod's path, and rank 0 says why.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict

import torch
from _report import write
from direct_path import calls, large_calls, shared_memory_calls

import hvdp
from hvdp.backends.torch.direct import allreduce as direct_allreduce


def without_mpi4py() -> None:
    """As a job whose environment lacks mpi4py: rank 0 says once why the calls keep Horovod's path, which works."""
    hvdp.init(framework="torch")
    total = hvdp.allreduce(torch.ones(4) * (hvdp.rank() + 1), op="sum")
    mismatch = ""
    try:
        hvdp.allreduce(torch.ones(2), op="sum" if hvdp.rank() == 0 else "max", name="op")
    except Exception as error:  # Horovod's negotiation refuses it there
        mismatch = f"{type(error).__name__}: {error}"
    write(hvdp.rank(), {"rank": hvdp.rank(), "size": hvdp.size(), "controller": direct_allreduce.controller(),
                        "total": total.tolist(), "mismatch": mismatch, "btl": os.environ.get("OMPI_MCA_btl")})


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
    if sys.argv[1:] == ["without-mpi4py"]:
        sys.modules["mpi4py"] = None  # type: ignore[assignment]  # import mpi4py now raises ImportError
        without_mpi4py()
    else:
        main()
