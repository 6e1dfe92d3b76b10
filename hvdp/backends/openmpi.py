"""What hvdp sets for Open MPI itself, read by its ``MPI_Init``: for ``hvdp run --mpi`` (horovodrun's flags,
:mod:`hvdp.launch.horovodrun`) and for a rank Open MPI started some other way (``hvdp.init``, before Horovod's
``MPI_Init``)."""

from __future__ import annotations

import os
from typing import Optional

#: Open MPI's transports (BTLs) as horovodrun excludes them (``-mca btl ^openib``), and the OFI one too.
#: Open MPI 4.1's OFI BTL can deadlock in ``MPI_Init``: both ranks of a 2-process job here were found waiting
#: for ever on a mutex in ``opal_common_ofi_export_memory_monitor`` (called from ``mca_btl_ofi``'s init, under
#: ``MPI_Init_thread`` in Horovod's background thread), about one job in 150 on a loaded machine. hvdp's jobs
#: run on TCP and shared memory (``pml ob1``), which it leaves untouched.
OMPI_BTL_EXCLUDED = "^openib,ofi"


def without_ofi_btl(value: Optional[str]) -> Optional[str]:
    """Open MPI's ``btl`` setting (``OMPI_MCA_btl``, None where unset) with its OFI transport left out, or
    None where it is to stay as it is: an exclusion list (``^a,b``) gains ``ofi``; an unset one excludes it
    alone; a list of transports to use is the user's choice, kept (name ``ofi`` there to have it).

    Example:
        >>> without_ofi_btl(None), without_ofi_btl("^openib"), without_ofi_btl("^openib,ofi")
        ('^ofi', '^openib,ofi', None)
        >>> without_ofi_btl("self,vader,tcp") is None
        True
    """
    if value is None or not value.strip():
        return "^ofi"
    if not value.startswith("^"):
        return None
    names = [name.strip() for name in value[1:].split(",") if name.strip()]
    return None if "ofi" in names else "^" + ",".join([*names, "ofi"])


def avoid_ofi_deadlock(environ: "os._Environ[str] | dict") -> None:
    """Before Horovod initializes MPI in a process Open MPI started: leave the OFI BTL out
    (:func:`without_ofi_btl`; Open MPI reads ``OMPI_MCA_btl`` in ``MPI_Init``). Any other process is left as it is."""
    if "OMPI_COMM_WORLD_RANK" not in environ:
        return
    changed = without_ofi_btl(environ.get("OMPI_MCA_btl"))
    if changed is not None:
        environ["OMPI_MCA_btl"] = changed
