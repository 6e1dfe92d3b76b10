"""The TensorFlow backend, over ``horovod.tensorflow``'s collective ops.

Horovod's Keras layer (``horovod.tensorflow.keras``) is not used: with Keras 3
it runs but does not average gradients. Keras 3 optimizers are wrapped by
:mod:`hvdp.keras`, with the reduction done by Horovod's TensorFlow ops, which
work both eagerly and inside ``tf.function`` (``model.fit``).

Its modules are named as torch's are (:mod:`hvdp.backends.torch`): :mod:`.direct` is TensorFlow's direct
path, one module where torch's is a package, since the build's op runs the whole allreduce in the traced step.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, Dict, List, Optional, Tuple

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdp import profiler
from hvdp.backends import keras as keras_adapter
from hvdp.backends.base import HorovodJob, reduction_plan
from hvdp.backends.tensorflow import direct
from hvdp.backends.tensorflow.direct import direct_group


def _refuse_xla() -> None:
    """Horovod's ops have no XLA kernels unless built with them: fail clearly."""
    from tensorflow.python.ops import control_flow_util

    graph = tf.compat.v1.get_default_graph()
    if control_flow_util.GraphOrParentsInXlaContext(graph):
        raise RuntimeError(
            "hvdp.DistributedOptimizer cannot reduce gradients inside an XLA-compiled "
            "function: Horovod's TensorFlow ops have no XLA kernels in this build. "
            "Compile the model with model.compile(..., jit_compile=False), or use "
            "tf.function(jit_compile=False) in a custom loop."
        )


class _SyncClock:
    """Seconds spent in gradient reduction, summed inside tf.functions and read by hvdp.profiler.step()."""

    variable: Optional[Any] = None

    @classmethod
    def get(cls) -> Any:
        if cls.variable is None:
            with tf.init_scope():  # created once, outside any tf.function being traced
                cls.variable = tf.Variable(0.0, dtype=tf.float64, trainable=False, name="hvdp_sync_seconds")
            profiler.add_source(cls.read_and_reset)
        return cls.variable

    @classmethod
    def read_and_reset(cls) -> float:
        if cls.variable is None:
            return 0.0
        seconds = float(cls.variable.numpy())
        cls.variable.assign(0.0)
        return seconds


def _timed_in_graph(reduce: Any) -> Any:
    """``reduce`` with its duration added to the sync clock, eagerly and inside tf.function.

    The time is taken with ``tf.timestamp()`` ops ordered around the collective, so
    it is the wait as executed, not as traced. Traced only while profiling is on.
    """

    def timed(tensors: List[Any]) -> List[Any]:
        if not profiler.is_enabled():
            return list(reduce(tensors))
        clock = _SyncClock.get()
        start = tf.timestamp()
        with tf.control_dependencies([start]):
            tensors = [tf.identity(t) for t in tensors]
        reduced = reduce(tensors)
        with tf.control_dependencies(reduced):
            update = clock.assign_add(tf.timestamp() - start)
        with tf.control_dependencies([update]):
            return [tf.identity(r) for r in reduced]

    return timed


#: Numbers the Keras optimizers hvdp wraps in this process, in creation order (the same on every rank).
_OPTIMIZER_NUMBERS = itertools.count()

class Backend(HorovodJob):
    """hvdp's contract (:class:`hvdp.backends.base.Backend`) on TensorFlow/Keras 3."""

    _hvd = hvd
    name = "tensorflow"
    extras = ("distributed_gradient_tape",)

    def distributed_optimizer(
        self,
        optimizer: Any,
        model: Any,
        *,
        op: str,
        compression: str,
        backward_passes_per_step: int,
        gradient_predivide_factor: float,
        process_set: Any,
        broadcast_buffers: bool = True,
        sparse_as_dense: bool = False,
        groups: Any = None,
        shard_optimizer_state: bool = False,
    ) -> Any:
        if not keras_adapter.is_keras_optimizer(optimizer):
            raise TypeError(
                f"hvdp.DistributedOptimizer on tensorflow takes a Keras 3 optimizer "
                f"(keras.optimizers.Optimizer), got {type(optimizer).__module__}."
                f"{type(optimizer).__name__}."
            )
        if shard_optimizer_state:
            size = self.size() if process_set is None else int(process_set.size())
            return keras_adapter.shard_optimizer(optimizer, *reduction_plan(op, gradient_predivide_factor, size),
                                                 compression, self._set(process_set), backward_passes_per_step)
        reduce = self._gradient_reducer(op, compression, gradient_predivide_factor, process_set,
                                        keras_adapter.keras_groups(groups))
        wrapped = keras_adapter.wrap_optimizer(optimizer, reduce, backward_passes_per_step)
        wrapped._hvdp_gradient_path = reduce.hvdp_direct_group  # None where the direct path does not apply
        return wrapped

    def _gradient_reducer(self, op: str, compression: str, gradient_predivide_factor: float,
                          process_set: Any, groups: Optional[int] = None) -> Any:
        """A function reducing a list of gradients across ranks (eagerly or in a tf.function)."""
        size = self.size() if process_set is None else int(process_set.size())
        name, prescale, postscale = reduction_plan(op, gradient_predivide_factor, size)
        horovod_op, comp, horovod_set = self._op(name), self._compression(compression), self._set(process_set)
        # Named by the optimizer's number, not (as Horovod does) after the gradient ops, whose
        # names follow Keras's layer-name counters: a model built on one rank only (a teacher, an
        # evaluation copy) shifts those on that rank, and the ranks' tensors would never match.
        label = f"hvdp.gradients.{next(_OPTIMIZER_NUMBERS)}"

        def reduce(tensors: List[Any]) -> List[Any]:
            _refuse_xla()
            tensors = [tf.convert_to_tensor(t) for t in tensors]
            if name == "adasum":
                return [hvd.allreduce(t, op=horovod_op, compression=comp, name=f"{label}.{i}", ignore_name_scope=True)
                        for i, t in enumerate(tensors)]
            return [reduced for g, group in enumerate(keras_adapter.in_groups(tensors, groups))
                    for reduced in grouped(group, f"{label}.g{g}")]

        def grouped(group: List[Any], name: str) -> List[Any]:
            # One grouped allreduce per dtype: Horovod's op takes tensors of one dtype (a tape's float32 and
            # float64 gradients failed with a TypeError). One dtype keeps Horovod's names as they were.
            kinds = list(dict.fromkeys(t.dtype for t in group))
            results: List[Any] = [None] * len(group)
            for kind in kinds:
                mine = [i for i, t in enumerate(group) if t.dtype == kind]
                for i, reduced in zip(mine, hvd.grouped_allreduce(
                        [group[i] for i in mine], op=horovod_op, compression=comp,
                        name=name if len(kinds) == 1 else f"{name}.{kind.name}", ignore_name_scope=True,
                        prescale_factor=prescale, postscale_factor=postscale, process_set=horovod_set)):
                    results[i] = reduced
            return results

        # Where every rank's gradients agree, a direct allreduce without Horovod's rounds (where it applies).
        path = direct_group(name, prescale, postscale, compression, groups, process_set, lambda: self.joining)
        timed = _timed_in_graph(reduce if path is None else functools.partial(path, horovod_reduce=reduce))
        timed.hvdp_direct_group = path
        return timed

    def broadcast_state(self, model: Any, optimizer: Any, root_rank: int, process_set: Any) -> None:
        horovod_set = self._set(process_set)
        if keras_adapter.is_keras_model(model):
            keras_adapter.broadcast_state(
                model, optimizer, root_rank,
                lambda value, root, name: hvd.broadcast(tf.convert_to_tensor(value), root, name=name,
                                                        process_set=horovod_set),
            )
            return
        if isinstance(model, (list, tuple)) and all(isinstance(v, tf.Variable) for v in model):
            for index, variable in enumerate(model):
                variable.assign(hvd.broadcast(variable, root_rank, name=f"hvdp.state.{index}",
                                              process_set=horovod_set))
            return
        raise TypeError(
            f"broadcast_state on tensorflow takes a Keras 3 model or a list of tf.Variable, "
            f"got {type(model).__name__}."
        )

    def _to_tensor(self, value: Any, caller: str) -> Tuple[Any, bool]:
        if isinstance(value, np.ndarray):
            return tf.constant(value), True
        if isinstance(value, (tf.Tensor, tf.Variable)):
            return value, False
        raise TypeError(
            f"{caller} on tensorflow takes a tf.Tensor, a NumPy array or a Python number, "
            f"got {type(value).__name__}."
        )

    def _from_tensor(self, result: Any, as_numpy: bool) -> Any:
        return result.numpy() if as_numpy else result

    def _write_out(self, result: Any, out: Any) -> Any:
        # TensorFlow tensors are immutable: out= is a variable (assigned) or a NumPy array (the base class).
        if isinstance(out, tf.Tensor):
            raise TypeError(
                "allreduce on tensorflow cannot write into a tf.Tensor (TensorFlow tensors are immutable). "
                "Fix: pass a tf.Variable (or a NumPy array) as out=, or drop out= and use the result."
            )
        if isinstance(out, np.ndarray) or not hasattr(out, "assign"):
            return super()._write_out(result, out)
        out.assign(result)
        return out

    def allgather_object(self, obj: Any, process_set: Any) -> List[Any]:
        return list(hvd.allgather_object(obj, name="hvdp.allgather_object", process_set=self._set(process_set)))

    def join(self) -> int:
        if not self.joining:  # the end of the job: ranks still training on the direct path are named at once
            direct.leave()
        # Horovod registers HorovodJoin as stateless, so eager TensorFlow reuses the first call's
        # result: every later join returned at once, without waiting for the other ranks. Run in
        # a function of its own, it waits every time.
        return int(tf.function(hvd.join)())

    def barrier(self, process_set: Any) -> None:
        # horovod.tensorflow 0.28 has no barrier op; a one-element allreduce is one.
        hvd.allreduce(tf.zeros([1]), op=hvd.Sum, name="hvdp.barrier", process_set=self._set(process_set))

    def named_parameters(self, model: Any) -> List[Tuple[str, np.ndarray]]:
        if keras_adapter.is_keras_model(model):
            return keras_adapter.named_parameters(model, lambda value: np.asarray(value))
        if isinstance(model, (list, tuple)) and all(isinstance(v, tf.Variable) for v in model):
            return [(v.name, v.numpy()) for v in model]
        raise TypeError(f"expected a Keras 3 model or a list of tf.Variable, got {type(model).__name__}.")

    def export_state(self, model: Any, optimizer: Any) -> Tuple[Dict[str, np.ndarray], Any]:
        if not keras_adapter.is_keras_model(model):
            raise TypeError(f"checkpoints on tensorflow take a Keras 3 model, got {type(model).__name__}.")
        return keras_adapter.export_state(model, optimizer, lambda value: np.asarray(value))

    def import_state(self, model: Any, optimizer: Any, arrays: Dict[str, np.ndarray], optimizer_state: Any) -> None:
        keras_adapter.import_state(model, optimizer, arrays, optimizer_state)

    def elastic_run(self, func: Callable[..., Any]) -> Callable[..., Any]:
        import horovod.tensorflow.elastic as hvd_elastic
        from horovod.common.exceptions import HorovodInternalError

        @functools.wraps(func)
        def translated(*args: Any, **kwargs: Any) -> Any:
            # Horovod's own translation knows only HorovodAllreduce/Allgather/Broadcast and returns
            # None on any other UnknownError, so a failed HorovodGroupedAllreduce (the Keras
            # optimizer's) would silently end training: any op error from a Horovod op is a failed collective.
            try:
                return func(*args, **kwargs)
            except tf.errors.OpError as exc:
                if "Horovod" not in str(exc):
                    raise
                raise HorovodInternalError(exc) from exc

        return hvd_elastic.run(translated)

    # Framework-specific extras (beside the neutral names).

    def distributed_gradient_tape(self, tape: Any, op: str, compression: str,
                                  process_set: Any) -> "DistributedGradientTape":
        if not isinstance(tape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(tape).__name__}.")
        return DistributedGradientTape(tape, self._gradient_reducer(op, compression, 1.0, process_set))


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient()`` returns gradients reduced across ranks.

    Works with Keras 3 variables (Horovod's own DistributedGradientTape does not);
    a source without a gradient on this rank contributes zeros, so no rank waits.
    Every other attribute is the wrapped tape's.
    """

    def __init__(self, tape: Any, reduce: Any) -> None:
        self._tape = tape
        self._reduce = reduce

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def __enter__(self) -> "DistributedGradientTape":
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tape.__exit__(*exc)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None) -> Any:
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat = [tf.zeros(s.shape, dtype=s.dtype) if g is None else g
                for g, s in zip(tf.nest.flatten(grads), flat_sources)]
        return tf.nest.pack_sequence_as(grads, self._reduce(flat))
