"""The job-level calls both backends make the same way on their ``horovod.<framework>`` module.

Each backend subclasses :class:`HorovodJob` and names its module in ``_hvd``;
everything framework-specific stays in the backend's own file.
"""

from __future__ import annotations

import os
from typing import Any, List


class HorovodJob:
    """init, process sets, rank and size over the ``horovod.<framework>`` module in ``_hvd``."""

    _hvd: Any

    def init(self, comm: Any, process_sets: List[List[int]], dynamic: bool) -> List[Any]:
        handles = [self._hvd.ProcessSet(ranks) for ranks in process_sets]
        self._hvd.init(comm=comm, process_sets=handles or ("dynamic" if dynamic else None))
        return handles

    def add_process_set(self, ranks: List[int]) -> Any:
        try:
            return self._hvd.add_process_set(ranks)
        except ValueError as exc:
            if "duplicate" in str(exc):
                return None
            raise

    def shutdown(self, join: bool = True) -> None:
        # Horovod's shutdown on one rank ends the job's collectives on every rank, so a rank
        # that finishes first (a process set with less work) would break the others' next
        # collective. join() waits, taking part in no collective and never tripping the stall
        # inspector, until every rank has joined. Elastic jobs end through Horovod's driver.
        if join and self._hvd.is_initialized() and self._hvd.size() > 1 \
                and os.environ.get("HOROVOD_ELASTIC") != "1":
            try:
                self._hvd.join()
            except Exception:  # the job is ending abnormally (a rank died): shut down regardless
                pass
        self._hvd.shutdown()

    def is_initialized(self) -> bool:
        return bool(self._hvd.is_initialized())

    def rank(self) -> int:
        return int(self._hvd.rank())

    def size(self) -> int:
        return int(self._hvd.size())

    def local_rank(self) -> int:
        return int(self._hvd.local_rank())

    def local_size(self) -> int:
        return int(self._hvd.local_size())

    def cross_rank(self) -> int:
        return int(self._hvd.cross_rank())

    def cross_size(self) -> int:
        return int(self._hvd.cross_size())

    def controller(self) -> str:
        return "mpi" if self._hvd.mpi_enabled() else "gloo"
