"""torch's ``GradScaler`` (AMP) with a sharded optimizer (``shard_optimizer_state=True``).

``GradScaler.unscale_`` (which ``scaler.step`` calls, or a script before clipping) unscales the
gradients of the optimizer's ``param_groups`` and records whether any is inf or NaN. A sharded
optimizer's ``param_groups`` are this rank's parts, whose reduced gradients its reduce-scatter
makes, and each rank sees only its part: one rank could find an overflow the others do not,
skip a step they take, and halve a scale they keep. So, with a sharded optimizer, ``unscale_``
reduce-scatters first, and the ranks agree on the found-inf flags after (the largest over the
optimizer's process set: one 1-element allreduce per step, with AMP only). Every rank then
takes or skips the step alike and updates its scale alike, as an unsharded optimizer's ranks do.
"""

from __future__ import annotations

from typing import Any, Dict

import horovod.torch as hvd
import torch


def agree_on_overflow() -> None:
    """Make ``torch.amp.GradScaler`` reduce a sharded optimizer's gradients before it unscales them, and agree
    the ranks' found-inf flags after (module docstring). Installed once; other optimizers are left alone."""
    from torch.amp import GradScaler

    original = GradScaler._unscale_grads_
    if getattr(original, "_hvdp_agrees", False):
        return

    def _unscale_grads_(self: Any, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> Dict[torch.device, torch.Tensor]:
        shards = getattr(optimizer, "_hvdp_shards", None)
        if shards is None or not hasattr(shards, "reduce"):
            return original(self, optimizer, inv_scale, found_inf, allow_fp16)
        shards.reduce()  # the parts' .grad: this step's reduced gradients (step() does not reduce again)
        found: Dict[torch.device, torch.Tensor] = original(self, optimizer, inv_scale, found_inf, allow_fp16)
        if shards.members > 1:
            for i, (device, flag) in enumerate(sorted(found.items(), key=lambda item: str(item[0]))):
                agreed = hvd.allreduce(flag.detach().reshape(1).cpu(), op=hvd.Max, name=f"hvdp.zero.found_inf.{i}",
                                       process_set=shards.set)
                flag.copy_(agreed.reshape(()).to(device))
        return found

    _unscale_grads_._hvdp_agrees = True  # type: ignore[attr-defined]
    GradScaler._unscale_grads_ = _unscale_grads_  # type: ignore[method-assign]
