"""ZeRO stage 1 for Keras 3 optimizers, on both Keras backends: each replica keeps 1/N of the optimizer state.

``hvdp.DistributedOptimizer(keras_opt, shard_optimizer_state=True)``. The model's trainable
variables, flattened in order into one vector, are split as torch's sharded optimizer
splits a param group: rank r of n owns the elements :func:`bounds` gives. This rank's part
is cut at the variables' boundaries into *pieces*, one Keras variable each, and the
optimizer is built on the pieces, so its slots (Adam's moments) hold 1/n of the model's
elements. Each update reduce-scatters the flattened gradients, gives the pieces the
model's current values, steps them with their part of the reduced gradient, and
all-gathers the updated parts into every replica's variables. Keras's elementwise
optimizers update an element from its own gradient and state alone, so this is the
unsharded update; what reads a whole variable (``clipnorm``, ``global_clipnorm``, the
weight-decay exclusions) is computed per model variable, across the ranks.

The whole state (``_hvdp_export``, for checkpoints) is in the unsharded optimizer's order
(:func:`hvdp.backends.keras.parts.unsharded_order`). Nothing here imports a framework at
import time; the collectives are Horovod's for the Keras backend's framework.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from hvdp.backends.keras.parts import Layout, Tag, Wire, accumulate, guard_update, unsharded_order

#: Keras's optimizers whose update of an element reads that element's gradient and state only.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam", "Lion", "Ftrl")


def check_optimizer(optimizer: Any) -> None:
    """Refuse what a sharded Keras update would change, naming it and the fix."""
    import keras

    name = type(optimizer).__name__
    fix = "Fix: shard_optimizer_state=False."
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError("shard_optimizer_state=True with a keras.optimizers.LossScaleOptimizer: its overflow check "
                         f"and skipped steps are not sharded in this version. {fix}")
    if not any(isinstance(optimizer, getattr(keras.optimizers, kind)) for kind in ELEMENTWISE):
        raise ValueError(
            f"hvdp.DistributedOptimizer(shard_optimizer_state=True) takes Keras's elementwise optimizers "
            f"({', '.join(ELEMENTWISE)}), got {type(optimizer).__module__}.{name}: each rank steps a slice of the "
            f"flattened variables, which would change a rule that reads a whole variable (Lamb's trust ratio, "
            f"Muon's orthogonalization). {fix}")
    if optimizer.use_ema:
        raise ValueError(f"shard_optimizer_state=True with use_ema=True: the moving averages would belong to this "
                         f"rank's part, not the model. {fix}")


class Sharding:
    """A sharded Keras optimizer's own state, in one plain object (Keras tracks the variables in an
    optimizer's list attributes as its own)."""

    def __init__(self, cls: type, wire: Wire) -> None:
        self.cls, self.wire = cls, wire  # the user's optimizer class; the collectives
        self.layout: Optional[Layout] = None  # once built
        self.model: List[Any] = []  # the model's trainable variables
        self.pieces: List[Any] = []  # this rank's pieces of them, the variables the optimizer is built on
        self.piece_of: Dict[int, int] = {}  # id of a piece: its number
        self.slots: Dict[int, Tuple[int, str]] = {}  # id of a slot variable: (its piece, its name)
        self.owner: Dict[Any, Any] = {}  # a piece's variable key: the model variable it is part of
        self.order: Optional[List[Tuple[Tag, Tuple[int, ...]]]] = None  # the unsharded order, once asked for
        self.loaded: Optional[List[Any]] = None  # the whole state last loaded, until the next update
        self.prepared: Optional[List[Any]] = None  # the whole state gathered for rank 0's save
        self.current: Any = None  # 1 while the pieces are the optimizer's; 0 once laid out anew (an elastic change)


class ShardedKeras:
    """The methods a sharded Keras optimizer's class gets over the user's optimizer class."""

    _hvdp_distributed = True
    _hvdp_shards: Sharding
    built: bool

    def build(self, variables: Sequence[Any]) -> None:
        import keras
        from keras import ops

        if self.built:
            return
        variables = list(variables)
        dtypes = sorted({str(v.dtype) for v in variables})
        if len(dtypes) > 1:
            raise ValueError(f"hvdp.DistributedOptimizer(shard_optimizer_state=True): the trainable variables mix "
                             f"{dtypes}; they are laid out in one vector. Fix: one dtype for the trainable variables "
                             f"(a mixed-precision policy keeps them float32), or shard_optimizer_state=False.")
        own = self._hvdp_shards
        layout = Layout(variables, own.wire.members, own.wire.index)
        own.model, own.slots, own.owner, own.order = variables, {}, {}, None
        own.pieces = [keras.Variable(ops.reshape(variables[v].value, [-1])[first:last], dtype=variables[v].dtype,
                                     trainable=True, name=f"hvdp_part_{v}") for v, first, last in layout.pieces]
        own.piece_of = {id(piece): p for p, piece in enumerate(own.pieces)}
        own.current = keras.Variable(1, dtype="int32", trainable=False, name="hvdp_layout_current")
        super().build(own.pieces)  # type: ignore[misc]
        for piece, (v, _, _) in zip(own.pieces, layout.pieces):
            own.owner[self._var_key(piece)] = variables[v]  # type: ignore[attr-defined]
        own.layout = layout

    def add_variable_from_reference(self, reference_variable: Any, name: Optional[str] = None,
                                    initializer: Any = "zeros") -> Any:
        created = super().add_variable_from_reference(reference_variable, name, initializer)  # type: ignore[misc]
        own = self._hvdp_shards
        if id(reference_variable) in own.piece_of:
            own.slots[id(created)] = (own.piece_of[id(reference_variable)], name or "var")
        return created

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> Any:
        own = self._hvdp_shards
        if not self.built:
            if trainable_variables is None:
                raise ValueError("A sharded optimizer's first apply needs the trainable variables: "
                                 "optimizer.apply(grads, model.trainable_variables).")
            self.build(list(trainable_variables))
        members, index = own.wire.live()
        if (members, index) != (own.wire.members, own.wire.index):
            raise ValueError(
                f"hvdp.DistributedOptimizer(shard_optimizer_state=True) laid out its state over "
                f"{own.wire.members} workers, and the job has {members} now. Fix: hold the model and "
                f"optimizer in an hvdp.elastic.State and train in a function decorated with hvdp.elastic.run, "
                f"which lays the state out again over the new workers.")
        check = _still_current(own)
        if check is None:
            self._hvdp_apply(grads, trainable_variables)
            return
        import tensorflow as tf

        with tf.control_dependencies([check]):  # before any collective of this step
            self._hvdp_apply(grads, trainable_variables)

    def _hvdp_apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]]) -> None:
        from keras import ops

        own = self._hvdp_shards
        model, layout = own.model, own.layout
        assert layout is not None
        given = model if trainable_variables is None else list(trainable_variables)
        if [id(v) for v in given] != [id(v) for v in model]:
            raise ValueError(f"hvdp.DistributedOptimizer(shard_optimizer_state=True) was built on {len(model)} "
                             f"variables and steps all of them at once, in that order; got {len(given)} others. Fix: "
                             f"pass model.trainable_variables, the list it was built on.")
        dtype = model[0].dtype if model else "float32"
        flat = ops.concatenate([ops.reshape(ops.zeros(v.shape, dtype) if g is None else ops.cast(g, dtype), [-1])
                                for g, v in zip(grads, model)])
        part = own.wire.scatter(flat)
        piece_grads, at = [], 0
        for piece, (v, first, last) in zip(own.pieces, layout.pieces):
            piece.assign(ops.reshape(model[v].value, [-1])[first:last])  # the model's values now
            piece_grads.append(part[at:at + last - first])
            at += last - first
        if own.pieces:
            super().apply(piece_grads, own.pieces)  # type: ignore[misc]
        else:
            self._iterations.assign_add(1)  # type: ignore[attr-defined]
        whole = own.wire.gather(_flat([p.value for p in own.pieces], dtype))
        for variable, offset, size, shape in zip(model, layout.offsets, layout.sizes, layout.shapes):
            variable.assign(ops.reshape(whole[offset:offset + size], shape))
            if variable.constraint is not None:
                variable.assign(variable.constraint(variable))
        own.loaded = None
        guard_update(self, model)

    def _clip_gradients(self, grads: List[Any]) -> List[Any]:
        """Keras's clipping of the reduced gradients, over whole model variables (the pieces' norms summed)."""
        from keras import ops

        if self.gradient_accumulation_steps:  # type: ignore[attr-defined]
            # Keras averaged the accumulated passes; hvdp's contract sums them.
            grads = [g * self.gradient_accumulation_steps for g in grads]  # type: ignore[attr-defined]
        own = self._hvdp_shards
        assert own.layout is not None
        clipnorm, global_clipnorm = self.clipnorm, self.global_clipnorm  # type: ignore[attr-defined]
        if clipnorm and clipnorm > 0:
            squares = [ops.zeros((), "float32") for _ in own.layout.sizes]
            for g, (v, _, _) in zip(grads, own.layout.pieces):
                squares[v] = ops.sum(ops.square(ops.cast(g, "float32")))
            norms = ops.sqrt(own.wire.total(ops.stack(squares)))
            return [g * ops.cast(clipnorm / ops.maximum(norms[v], clipnorm), g.dtype)
                    for g, (v, _, _) in zip(grads, own.layout.pieces)]
        if global_clipnorm and global_clipnorm > 0:
            local = ops.sum(ops.stack([ops.sum(ops.square(ops.cast(g, "float32"))) for g in grads])) if grads \
                else ops.zeros((), "float32")
            norm = ops.sqrt(own.wire.total(ops.reshape(local, [1])))[0]
            scale = global_clipnorm * ops.minimum(1.0 / norm, 1.0 / global_clipnorm)
            return [g * ops.cast(scale, g.dtype) for g in grads]
        return super()._clip_gradients(grads)  # type: ignore[misc]

    def _use_weight_decay(self, variable: Any) -> bool:
        """A piece decays as the model variable it is part of (``exclude_from_weight_decay`` names those)."""
        owner = self._hvdp_shards.owner.get(self._var_key(variable))  # type: ignore[attr-defined]
        return bool(super()._use_weight_decay(variable if owner is None else owner))  # type: ignore[misc]

    # The whole state, in the unsharded optimizer's order.

    def _hvdp_order(self) -> List[Tuple[Tag, Tuple[int, ...]]]:
        """(tag, shape) of each variable an unsharded optimizer of this class and config would hold."""
        own = self._hvdp_shards
        if own.order is None:
            own.order = unsharded_order(own.cls, self.get_config(), own.model)  # type: ignore[attr-defined]
        return own.order

    def _hvdp_relayout(self) -> bool:
        """After the workers changed (an elastic job's new world), this rank's part laid out over them
        anew, to take its state with :meth:`_hvdp_import` next; steps compiled for the old layout are
        refused when they run. False if the workers are the same."""
        own = self._hvdp_shards
        if not self.built or not own.wire.moved():
            return False
        own.current.assign(0)
        _unbuild(self, len(self._hvdp_own()))
        self.build(own.model)
        return True

    def _hvdp_own(self) -> List[Any]:
        """The optimizer's variables that are no piece's slot (the iteration count, a learning rate)."""
        return [v for v in self.variables if id(v) not in self._hvdp_shards.slots]  # type: ignore[attr-defined]

    def _hvdp_export(self, to_numpy: Any) -> List[Any]:
        """The whole state, every rank's part gathered (a collective: call it on every rank)."""
        from keras import ops

        own, order = self._hvdp_shards, self._hvdp_order()
        layout = own.layout
        assert layout is not None
        slots = {own.slots[id(v)]: v for v in self.variables if id(v) in own.slots}  # type: ignore[attr-defined]
        names = list(dict.fromkeys(name for (kind, _, name), _ in order if kind == "slot"))
        dtype = own.model[0].dtype if own.model else "float32"
        wholes = {name: to_numpy(own.wire.gather(_flat([ops.reshape(slots[p, name].value, [-1])
                                                        for p in range(len(own.pieces))], dtype), f"state.{n}"))
                  for n, name in enumerate(names)}
        others = self._hvdp_own()
        return [wholes[name][layout.offsets[k]:layout.offsets[k] + layout.sizes[k]].reshape(shape)
                if kind == "slot" else to_numpy(others[k].value) for (kind, k, name), shape in order]

    def _hvdp_import(self, whole: Sequence[Any]) -> None:
        """Take this rank's part of ``whole`` (the unsharded optimizer's variables, in its order)."""
        import numpy as np

        own, order = self._hvdp_shards, self._hvdp_order()
        layout = own.layout
        assert layout is not None
        if len(whole) != len(order):
            from hvdp.errors import CheckpointError

            raise CheckpointError(f"the optimizer state holds {len(whole)} variables but this "
                                  f"{type(self).__name__} has {len(order)} unsharded: load it with the optimizer "
                                  f"class and config that saved it.")
        by_slot = {(k, name): np.asarray(value) for ((kind, k, name), _), value in zip(order, whole)
                   if kind == "slot"}
        for variable in self.variables:  # type: ignore[attr-defined]
            if id(variable) in own.slots:
                p, name = own.slots[id(variable)]
                v, first, last = layout.pieces[p]
                variable.assign(by_slot[v, name].reshape(-1)[first:last])
        others = self._hvdp_own()
        for ((kind, k, _), _), value in zip(order, whole):
            if kind == "own":
                others[k].assign(value)
        own.loaded = list(whole)

    def save_own_variables(self, store: Any) -> None:
        """Keras's saving (``model.save``): the whole state in the unsharded order, which ``load_model`` reads."""
        import numpy as np

        own = self._hvdp_shards
        if own.prepared is None and own.wire.members > 1:
            raise ValueError(
                f"model.save / save_weights of a model whose optimizer is sharded over {own.wire.members} ranks: this "
                f"rank holds 1/{own.wire.members} of the optimizer state, and gathering the rest needs every rank. "
                f"Fix: hvdp.save_checkpoint(path, model, optimizer) (call it on every rank), or "
                f"hvdp.keras.ModelCheckpoint, which gathers on every rank first.")
        whole = own.prepared if own.prepared is not None else self._hvdp_export(np.asarray)
        for i, value in enumerate(whole):
            store[str(i)] = value
        own.prepared = None

    def load_own_variables(self, store: Any) -> None:
        self._hvdp_import([store[str(i)] for i in range(len(store.keys()))])

    def _hvdp_prepare_save(self) -> None:
        """Gather the whole state on every rank, for rank 0's ``save_own_variables`` next."""
        from keras import ops

        self._hvdp_shards.prepared = self._hvdp_export(ops.convert_to_numpy)


def _flat(values: List[Any], dtype: Any) -> Any:
    from keras import ops

    return ops.concatenate(values) if values else ops.zeros((0,), dtype)


def _unbuild(optimizer: Any, kept: int) -> None:
    """``optimizer`` as before its build: its first ``kept`` variables (made in its constructor) only."""
    del optimizer._variables[kept:]
    optimizer._trainable_variables, optimizer._trainable_variables_indices = [], {}
    optimizer.built = False


def _still_current(own: Sharding) -> Any:
    """While TensorFlow traces a step: an op that fails if the pieces it steps are no longer the optimizer's
    (the trace outlived a change of workers); None when the step runs eagerly (it reads the layout each time)."""
    import keras

    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    if tf.executing_eagerly():
        return None
    return tf.debugging.assert_equal(
        own.current.value, 1, message="hvdp.DistributedOptimizer(shard_optimizer_state=True): this step was "
        "compiled (tf.function) before the workers of the job changed, for the old layout of the optimizer state. "
        "Fix: make the tf.function inside the function hvdp.elastic.run decorates (it runs again after each "
        "change); model.fit and train_on_batch compile again by themselves.")  # no quote: TensorFlow escapes it


def shard(optimizer: Any, wire: Wire, backward_passes_per_step: int) -> Any:
    """``optimizer`` sharded over ``wire``'s process set (module docstring), in place: same class name."""
    from keras import ops

    check_optimizer(optimizer)
    accumulate(optimizer, backward_passes_per_step)
    cls = type(optimizer)
    whole, model = None, None
    if optimizer.built:  # e.g. keras.models.load_model's: its whole state is taken apart below
        whole = [ops.convert_to_numpy(v.value) for v in optimizer.variables]
        model = list(optimizer._trainable_variables)
        _unbuild(optimizer, len(cls.from_config(optimizer.get_config()).variables))  # those made before build
    sharded = type(cls.__name__, (ShardedKeras, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    optimizer.__class__ = sharded
    optimizer._hvdp_shards = Sharding(cls, wire)
    if model is not None:
        optimizer.build(model)
        optimizer._hvdp_import(whole)
    return optimizer


def broadcast_loaded(optimizer: Any, root_rank: int, broadcast: Any) -> None:
    """The whole state ``root_rank`` last loaded, if it did (``hvdp.load_checkpoint`` reads on rank 0 alone),
    sent to every rank to take its part of. ``broadcast(tensor, root, name)`` is broadcast_state's."""
    import numpy as np
    from keras import ops

    own = optimizer._hvdp_shards
    flag = broadcast(ops.convert_to_tensor(np.array([own.loaded is not None], np.int32)), root_rank, "hvdp.zero.loaded")
    if not int(ops.convert_to_numpy(flag)[0]):
        return
    others, dtype = optimizer._hvdp_own(), str(own.model[0].dtype) if own.model else "float32"
    whole = []
    for i, ((kind, k, _), shape) in enumerate(optimizer._hvdp_order()):
        kind_dtype = dtype if kind == "slot" else str(others[k].dtype)
        value = np.asarray(own.loaded[i], kind_dtype) if own.loaded is not None else np.zeros(shape, kind_dtype)
        whole.append(ops.convert_to_numpy(broadcast(ops.convert_to_tensor(value), root_rank, f"hvdp.zero.whole.{i}")))
    optimizer._hvdp_import(whole)
