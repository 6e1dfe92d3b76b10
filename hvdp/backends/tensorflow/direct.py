"""TensorFlow's gradients by a direct allreduce, without Horovod's per-cycle rounds: a
``DistributedGradientTape``'s and a Keras 3 optimizer's on the TensorFlow backend.

hvdp's build adds the op ``HvdpDirectAllreduce`` (:data:`hvdp.horovod_build.tensorflow_patches.DIRECT_OP`): one
flat tensor's sum over every rank, times a scale, by Gloo's ring on Horovod's own Gloo context, run by the op's
thread. A :class:`DirectGroup` reduces one update's gradients with it, inside the traced step:

- At each call the ranks compare the gradients' layout (dtypes and shapes) by one direct exchange of a digest
  (:func:`compared`; from a small Python function the step calls).
- Where every rank has the same layout and can use it, the gradients of each dtype go end to end
  (``tf.concat``), each dtype is reduced by one op, and they are split again. Where the layouts differ (the
  models differ), every rank raises :class:`hvdp.errors.TensorMismatchError` at that call, naming each rank's
  number of gradients and elements, as torch's calls do. Where a rank cannot use the op (a dtype or shape it does
  not take), that call takes Horovod's path (the grouped allreduces as before; a ``tf.cond`` picks). While an
  ``hvdp.join`` is open every call takes Horovod's path, without the exchange.

The op is stateful, so a traced function runs its calls in the order they were traced, the same on every rank.
A direct call that times out prints Horovod's stall report lines, so ``hvdp run`` names the rank that stalled.
``HVDP_GRADIENT_PATH=horovod`` keeps Horovod's path. Float32 and float64 on CPU, in a Gloo job, the whole job's
process set, average or sum without compression or groups; anything else keeps Horovod's path.
"""

from __future__ import annotations

import ctypes
import zlib
from typing import Any, Callable, List, Optional, Tuple

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdp._state import job
from hvdp.backends import direct
from hvdp.backends.direct import CHANNELS
from hvdp.errors import TensorMismatchError, TrainingMismatchError

#: The direct allreduce's channel for TensorFlow's gradients (a Gloo tag of its own), and the layout exchange's.
GRADIENT_CHANNEL, AGREE_CHANNEL = CHANNELS["tensorflow gradients"], CHANNELS["tensorflow layout"]
_USABLE = (tf.float32, tf.float64)


def _library() -> Any:
    return hvd.mpi_ops._basics.MPI_LIB_CTYPES


def _op() -> Any:
    """The build's ``HvdpDirectAllreduce`` (None in a build without it)."""
    return getattr(hvd.mpi_ops.MPI_LIB, "hvdp_direct_allreduce", None)


def available() -> bool:
    """Built in, a Gloo job, and no GPU (a GPU job's gradients take Horovod's path, on NCCL)."""
    return (_op() is not None and getattr(_library(), "horovod_hvdp_direct_exchange", None) is not None
            and bool(hvd.gloo_enabled()) and not tf.config.list_logical_devices("GPU"))


class DirectGroup:
    """One update's gradients reduced together by the direct op where the ranks agree (module docstring).

    ``scale`` gives the factor of the sum (read at each call: an elastic job's size changes), ``joining``
    whether an ``hvdp.join`` is open. ``counts``: calls on each path, and calls whose layouts differed.
    """

    def __init__(self, scale: Callable[[], float], joining: Callable[[], bool]) -> None:
        self.scale, self.joining = scale, joining
        self.counts = {"direct": 0, "horovod": 0, "differed": 0}

    def ready(self, text: str, usable: bool, size: Tuple[int, int] = (0, 0)) -> float:
        """At each call (Python, from the traced step): the scale of the direct path where every rank has the
        layout ``text`` (``size``: its number of gradients and of elements) and can use it, else 0 (Horovod's
        path); TensorMismatchError on every rank where the layouts differ. While a join is open, 0 without
        asking."""
        go, same = (False, True) if self.joining() else compared(text, usable, size=size)
        direct.quiet_loop(_library(), go)
        self.counts["direct" if go else "horovod"] += 1
        self.counts["differed"] += int(not same)
        job().went_direct = job().went_direct or go
        return float(self.scale()) if go else 0.0

    def __call__(self, tensors: List[Any], horovod_reduce: Callable[[List[Any]], List[Any]]) -> List[Any]:
        """``tensors`` reduced (eagerly, or as ops of the function being traced)."""
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        text = repr([(t.dtype.name, t.shape.as_list()) for t in tensors])
        usable = bool(tensors) and all(t.dtype in _USABLE and t.shape.is_fully_defined() for t in tensors)
        size = (len(tensors), sum(int(t.shape.num_elements() or 0) for t in tensors))
        scale = tf.numpy_function(lambda: np.float64(self.ready(text, usable, size)), [], tf.float64,
                                  stateful=True, name="hvdp_direct_ready")
        scale.set_shape([])
        if not usable:  # never direct on this rank, which still answers the others' question
            with tf.control_dependencies([scale]):
                return list(horovod_reduce([tf.identity(t) for t in tensors]))
        return tf.cond(scale > 0, lambda: _reduced(tensors, scale), lambda: list(horovod_reduce(tensors)))


def _reduced(tensors: List[Any], scale: Any) -> List[Any]:
    """Each dtype's tensors end to end, their sum times ``scale`` by one direct op, split again."""
    results: List[Any] = [None] * len(tensors)
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        mine = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = tf.concat([tf.reshape(tensors[i], [-1]) for i in mine], 0)
        summed = _op()(flat, scale, channel=GRADIENT_CHANNEL, timeout_ms=direct.timeout_ms())
        pieces = tf.split(summed, [int(tensors[i].shape.num_elements()) for i in mine], 0)
        for i, piece in zip(mine, pieces):
            results[i] = tf.reshape(piece, tensors[i].shape)
    return results


def compared(text: str, usable: bool, finished: bool = False, size: Tuple[int, int] = (0, 0)) -> Tuple[bool, bool]:
    """(whether every rank has the layout ``text`` and can use it, whether every rank has ``text``): one direct
    exchange of a digest, so every rank reaches the same answer at the same call. Where the digests differ,
    every rank raises TensorMismatchError naming each rank's ``size`` (gradients, elements): the models differ.

    ``finished``: this rank has left its training loop (:func:`leave`). Where every rank has, the
    answer is (False, True); where some have, the ranks still training raise TrainingMismatchError naming them,
    and so do the ranks that left (the answer True: the others still train).
    """
    exchange = direct.entry(_library(), "horovod_hvdp_direct_exchange", ctypes.c_longlong, ctypes.c_longlong,
                            ctypes.c_int)
    rank, ranks = hvd.rank(), hvd.size()
    inbox = np.zeros((ranks, 5), dtype=np.int64)
    inbox[rank] = (zlib.crc32(text.encode()), int(usable), int(finished), *size)
    error = ctypes.create_string_buffer(1024)
    waited = direct.timeout_ms()
    code = exchange(inbox.ctypes.data, 40, 40, AGREE_CHANNEL, waited, error, len(error))
    if code != 0:
        why = error.value.decode(errors="replace") or "not a Gloo job"
        raise direct.failure(why, f"Horovod (hvdp's direct path) could not compare the gradients between ranks: "
                                  f"{why}. Another rank stopped (see its output); {direct.PATH_ENV}=horovod runs "
                                  f"Horovod's path instead.", "hvdp.direct.tf_layout", rank, ranks)
    if inbox[:, 2].all():
        return False, True
    if inbox[:, 2].any() and not finished:
        left = ", ".join(str(r) for r in np.flatnonzero(inbox[:, 2]))
        raise TrainingMismatchError(f"rank {left} finished its script while this rank ({rank}) still trains: its "
                                    f"gradients' allreduce has no partner there. {SAME_STEPS}")
    if finished:
        return True, True
    if not (inbox[:, 0] == inbox[rank, 0]).all():
        raise TensorMismatchError(models_differ(inbox[:, 3:5]))
    return bool(inbox[:, 1].all()), True


def models_differ(sizes: Any) -> str:
    """The refusal where the ranks' gradients differ, from each rank's (gradients, elements).

    >>> models_differ([(2, 36), (4, 56)])[62:130]
    'rank 0 reduces 2 gradients (36 elements); rank 1 reduces 4 gradients'
    """
    each = "; ".join(f"rank {r} reduces {int(count)} gradients ({int(elements)} elements)"
                     for r, (count, elements) in enumerate(sizes))
    return (f"The ranks reduce different gradients, so their models differ: {each}. A layer or parameter exists, "
            f"is trainable, or has another shape or dtype on some ranks only (built on one rank, frozen on one "
            f"rank, a different architecture). Build the same model on every rank; hvdp.check_consistency(model) "
            f"names the ranks that differ.")


#: The fix, when a rank left its training loop while others still train.
SAME_STEPS = ("Every rank must take the same steps: give every rank the same number of batches "
              "(hvdp.shard(n, drop_remainder=True)), or train inside hvdp.join(model, optimizer).")

def leave() -> None:
    """Before Horovod's join at the end of a job, where this process's gradients went direct: one layout
    exchange saying this rank left its training loop, so that ranks still training are named at once
    (TrainingMismatchError on them and here) instead of waiting out the stall timeout."""
    if not job().went_direct or not hvd.is_initialized() or hvd.size() < 2:
        return
    job().went_direct = False
    if compared("", True, finished=True)[0]:
        me = hvd.rank()
        raise TrainingMismatchError(f"rank {me} finished its script while other ranks still train (their next "
                                    f"gradients' allreduce came after rank {me} had left its training loop). "
                                    f"{SAME_STEPS}")


def direct_group(op: str, prescale: float, postscale: float, compression: str, groups: Any, process_set: Any,
                 joining: Callable[[], bool]) -> Optional[DirectGroup]:
    """The direct path of one gradient reducer, or None where it does not apply: another op than average or sum,
    compression, groups, a process set, :data:`hvdp.backends.direct.PATH_ENV` set to ``horovod``, MPI, a GPU,
    or a build without the op."""
    if direct.chosen_path() != "direct" or op not in ("average", "sum") or compression != "none" or groups:
        return None
    if process_set is not None and process_set != hvd.global_process_set or not available():
        return None
    return DirectGroup(lambda: 1.0 / hvd.size() if op == "average" else prescale * postscale, joining)

