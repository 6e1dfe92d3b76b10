"""A Keras 3 optimizer on Keras's torch backend: its gradients reduced by Horovod's torch collectives.

One update's gradients go as Horovod grouped allreduces (``groups`` of them), or, once the ranks
agree on their layout, as one direct Gloo allreduce per dtype
(:class:`hvdp.backends.torch.direct.allreduce.DirectGroup`); Adasum reduces each gradient alone.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

import horovod.torch as hvd

from hvdp import profiler
from hvdp.backends import keras as keras_adapter
from hvdp.backends.torch.direct.allreduce import direct_group


def keras_optimizer(optimizer: Any, plan: Tuple[str, float, float], horovod_op: Any, compression: str,
                    horovod_compression: Any, groups: Any, horovod_set: Any, backward_passes_per_step: int,
                    joining: Callable[[], bool]) -> Any:
    """``optimizer`` wrapped (:func:`hvdp.backends.keras.wrap_optimizer`) to reduce its gradients across the job.

    ``plan`` is :func:`hvdp.backends.base.reduction_plan`'s (op, prescale, postscale). The wrapped
    optimizer's ``_hvdp_gradient_path`` is its direct group (None where the direct path does not apply).
    """
    name, prescale, postscale = plan
    parts = keras_adapter.keras_groups(groups)

    # Named: Horovod's torch names for unnamed tensors count per process, not per set.
    def reduce(tensors: List[Any]) -> List[Any]:
        if name == "adasum":
            return [hvd.allreduce(t, op=horovod_op, compression=horovod_compression, name=f"hvdp.gradients.{i}")
                    for i, t in enumerate(tensors)]
        return [reduced for g, group in enumerate(keras_adapter.in_groups(tensors, parts)) for reduced in
                hvd.grouped_allreduce(group, op=horovod_op, compression=horovod_compression,
                                      name=f"hvdp.gradients.g{g}", prescale_factor=prescale,
                                      postscale_factor=postscale, process_set=horovod_set)]

    direct = direct_group(plan, compression, groups, horovod_set, joining)
    if direct is None:
        return keras_adapter.wrap_optimizer(optimizer, profiler.timed(reduce), backward_passes_per_step)

    def reduce_directly(tensors: List[Any]) -> List[Any]:
        return direct(tensors, reduce)

    wrapped = keras_adapter.wrap_optimizer(optimizer, profiler.timed(reduce_directly), backward_passes_per_step)
    wrapped._hvdp_gradient_path = direct
    return wrapped
