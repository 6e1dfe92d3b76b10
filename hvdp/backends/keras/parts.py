"""The parts of a sharded Keras optimizer (:mod:`hvdp.backends.keras.sharded`): where this rank's
elements lie (:class:`Layout`), the collectives that move them (:class:`Wire`), and the order of
the whole state an unsharded optimizer would hold (:func:`unsharded_order`).

Nothing here imports a framework at import time: the collectives are Horovod's for the
Keras backend's framework, imported when a :class:`Wire` is made.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from hvdp.backends.base import bounds

Tag = Tuple[str, int, str]  # ("slot", model variable, slot name) or ("own", k-th own variable, "")


class Wire:
    """Horovod's collectives for the Keras backend's framework, within one process set."""

    def __init__(self, op: str, compression: str, prescale: float, postscale: float, process_set: Any,
                 label: str) -> None:
        import keras

        self.tf = keras.backend.backend() == "tensorflow"
        if self.tf:
            import horovod.tensorflow as hvd
        else:
            import horovod.torch as hvd
        self.hvd, self.set, self.label = hvd, process_set, label
        self.op = {"average": hvd.Average, "sum": hvd.Sum}[op]
        self.compression, self.prescale, self.postscale = compression, prescale, postscale
        self.members, self.index = int(process_set.size()), int(process_set.rank())

    def live(self) -> Tuple[int, int]:
        """The process set's size and this rank's index in it now (an elastic job's world changes)."""
        return int(self.set.size()), int(self.set.rank())

    def moved(self) -> bool:
        """True if the process set's members changed since (an elastic job's new world): then they are taken."""
        if self.live() == (self.members, self.index):
            return False
        self.members, self.index = self.live()
        return True

    def _named(self, what: str) -> Dict[str, Any]:
        name = {"name": f"{self.label}.{what}", "process_set": self.set}
        return {**name, "ignore_name_scope": True} if self.tf else name

    def scatter(self, flat: Any) -> Any:
        """This rank's part of the sum (or average) of ``flat`` over the ranks."""
        from keras import ops

        sent = ops.cast(flat, "float16") if self.compression == "fp16" else flat
        if self.members == 1:
            reduced = sent * (self.prescale * self.postscale)
        else:
            reduced = self.hvd.reducescatter(sent, op=self.op, prescale_factor=self.prescale,
                                             postscale_factor=self.postscale, **self._named("gradients"))
        return ops.cast(reduced, flat.dtype)

    def gather(self, part: Any, what: str = "parts") -> Any:
        """Every rank's ``part``, in rank order."""
        return part if self.members == 1 else self.hvd.allgather(part, **self._named(what))

    def total(self, vector: Any) -> Any:
        """The sum of ``vector`` over the ranks."""
        return vector if self.members == 1 else self.hvd.allreduce(vector, op=self.hvd.Sum, **self._named("norms"))


class Layout:
    """Where each model variable's elements lie in the flat vector, and this rank's pieces of them."""

    def __init__(self, variables: Sequence[Any], members: int, index: int) -> None:
        self.shapes = [tuple(v.shape) for v in variables]
        self.sizes = [int(_count(shape)) for shape in self.shapes]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.total = sum(self.sizes)
        self.start, self.end = bounds(self.total, members, index)
        # (model variable, first, last + 1) within that variable's flat elements
        self.pieces: List[Tuple[int, int, int]] = []
        for v, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
            first, last = max(offset, self.start), min(offset + size, self.end)
            if last > first:
                self.pieces.append((v, first - offset, last - offset))


def _count(shape: Tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def unsharded_order(cls: Any, config: Dict[str, Any], model: Sequence[Any]) -> List[Tuple[Tag, Tuple[int, ...]]]:
    """The variables of a ``cls(**config)`` built on ``model``, as tags: one built on one-element stand-ins
    records which model variable and slot each of its variables is."""
    import keras

    made: Dict[int, Tuple[int, str]] = {}
    stand_ins = [keras.Variable([0.0], dtype=v.dtype, name=f"stand_in_{i}") for i, v in enumerate(model)]
    which = {id(s): i for i, s in enumerate(stand_ins)}

    def record(self: Any, reference_variable: Any, name: Optional[str] = None, initializer: Any = "zeros") -> Any:
        created = cls.add_variable_from_reference(self, reference_variable, name, initializer)
        if id(reference_variable) in which:
            made[id(created)] = (which[id(reference_variable)], name or "var")
        return created

    recorder: Any = type(cls.__name__, (cls,), {"add_variable_from_reference": record})
    template = recorder.from_config(config)
    template.build(stand_ins)
    order: List[Tuple[Tag, Tuple[int, ...]]] = []
    own = 0
    for variable in template.variables:
        if id(variable) in made:
            v, name = made[id(variable)]
            order.append((("slot", v, name), tuple(model[v].shape)))
        else:
            order.append((("own", own, ""), tuple(variable.shape)))
            own += 1
    return order


def accumulate(optimizer: Any, backward_passes_per_step: int) -> None:
    """Set a Keras optimizer's ``gradient_accumulation_steps`` for ``backward_passes_per_step`` > 1 (one update,
    and one reduction, per that many passes), refusing a contradicting setting or a built optimizer."""
    if backward_passes_per_step <= 1:
        return
    existing = optimizer.gradient_accumulation_steps
    if existing not in (None, backward_passes_per_step):
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step} contradicts the optimizer's "
                         f"gradient_accumulation_steps={existing}; set only one of them.")
    if optimizer.built and existing is None:
        raise ValueError("backward_passes_per_step > 1 needs gradient accumulators, which a built optimizer "
                         "lacks: wrap the optimizer before its first step or broadcast_state().")
    optimizer.gradient_accumulation_steps = backward_passes_per_step


def guard_update(optimizer: Any, variables: Sequence[Any]) -> None:
    """After an update a custom loop applied (``fit`` runs the guard from a callback): the optimizer's drift
    guard, with ``variables``' values, if it has one and this runs eagerly (not while TensorFlow traces)."""
    after_step = getattr(optimizer, "_hvdp_after_step", None)
    if after_step is None or getattr(optimizer, "_hvdp_in_fit", False) or not _runs_eagerly():
        return
    from keras import ops

    after_step(lambda: [(v.path, ops.convert_to_numpy(v.value)) for v in variables])


def _runs_eagerly() -> bool:
    """True unless this runs while TensorFlow traces a function (where Python runs once, not each step)."""
    import keras

    if keras.backend.backend() != "tensorflow":
        return True
    import tensorflow as tf

    return bool(tf.executing_eagerly())
