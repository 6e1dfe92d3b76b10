"""The exceptions hvdp raises.

Every hvdp error derives from :class:`HvdpError`, so ``except hvdp.HvdpError``
catches all of them. Errors about bad arguments also derive from the matching
built-in (``ValueError``/``RuntimeError``) so generic handlers keep working.
"""

from __future__ import annotations


class HvdpError(Exception):
    """Base class of every error raised by hvdp."""


class FrameworkError(HvdpError, ValueError):
    """The framework asked for is unknown, not installed, not built into Horovod,
    or contradicts another setting."""


class NotInitializedError(HvdpError, RuntimeError):
    """An hvdp call that needs a running job was made before ``hvdp.init()``."""


class BuildError(HvdpError, RuntimeError):
    """Building or installing Horovod failed; the message says how to fix it."""


class LaunchError(HvdpError, ValueError):
    """``hvdp run`` was given arguments it cannot turn into a job."""


class ReplicaMismatchError(HvdpError, RuntimeError):
    """Replicas that should be identical are not."""


class TensorMismatchError(HvdpError, ValueError):
    """Ranks passed tensors of different shapes or dtypes to the same collective."""


class TrainingMismatchError(HvdpError, ValueError):
    """Ranks run different trainings (``model.fit`` with other epochs or batches per epoch), so some
    would wait for the others in a collective."""


class StallError(HvdpError, RuntimeError):
    """A direct call waited past the job's stall timeout (``hvdp run --stall-timeout``): another rank stopped
    or stalled. On torch it is also Horovod's ``HorovodInternalError``, so an elastic job resets as on
    Horovod's path."""


class CheckpointError(HvdpError, ValueError):
    """A checkpoint is missing, corrupt, truncated, from the other framework or another architecture."""


class JobFailedError(HvdpError, RuntimeError):
    """A rank of the job died or stopped taking part in collectives; the job was ended."""


class ProcessSetError(HvdpError, ValueError):
    """A communicator or process set was defined or used wrongly (``hvdp.init(comm=...)``,
    ``hvdp.ProcessSet``, ``process_set=``)."""


class BenchError(HvdpError, ValueError):
    """``hvdp bench`` was given bad options, or a benchmark job failed."""


class ReportError(HvdpError, ValueError):
    """``hvdp report`` cannot read the records it was given, or cannot draw its plot."""
