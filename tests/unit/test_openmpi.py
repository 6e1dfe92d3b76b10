"""What hvdp sets for Open MPI itself (hvdp.backends.openmpi): the OFI transport left out of its jobs."""

from __future__ import annotations

import pytest

from hvdp.backends import openmpi


@pytest.mark.parametrize("given, wanted", [(None, "^ofi"), ("^openib", "^openib,ofi"), ("^openib,ofi", "^openib,ofi"),
                                           ("^ ofi ", "^ ofi "), ("self,vader,tcp", "self,vader,tcp"), ("", "^ofi")])
def test_a_rank_open_mpi_started_leaves_its_ofi_transport_out_unless_the_user_chose_its_transports(given, wanted):
    """Open MPI 4.1's OFI BTL can deadlock in MPI_Init (OMPI_BTL_EXCLUDED): before Horovod's init, a rank of an
    Open MPI job excludes it; a list of transports to use is the user's, and kept."""
    environ = {"OMPI_COMM_WORLD_RANK": "0", **({} if given is None else {"OMPI_MCA_btl": given})}
    openmpi.avoid_ofi_deadlock(environ)
    assert environ["OMPI_MCA_btl"] == wanted
    elsewhere = {} if given is None else {"OMPI_MCA_btl": given}  # not an Open MPI rank: left as it is
    openmpi.avoid_ofi_deadlock(elsewhere)
    assert elsewhere == ({} if given is None else {"OMPI_MCA_btl": given})
