"""The contract of a gradient path: how an optimizer wrapper has its gradients averaged, whichever way they go."""

from __future__ import annotations

from typing import Any, Callable, Dict, Protocol


class GradientPath(Protocol):
    """How one optimizer's gradients are averaged, as the optimizer wrapper uses it
    (:func:`hvdp.backends.torch.gradients.reduce_at_backward_end`), in the manner of DDP's communication
    hooks: the wrapper says when a pass starts, which passes reduce and when the averages must be there;
    the path moves the gradients. Horovod's path and the direct path are its two peers
    (:class:`hvdp.backends.torch.gradients.HorovodPath`,
    :class:`hvdp.backends.torch.direct.gradients.DirectGradients`); neither wrapper nor path reaches into
    the other's internals.

    ``name`` is ``horovod`` or ``direct``; ``mode`` what the path does now (``horovod``, ``learn`` or
    ``direct`` for the direct path); ``counts`` the steps taken on each (``direct``, ``horovod``) and the
    graph changes seen (``changes``).
    """

    name: str
    mode: str
    counts: Dict[str, int]

    def reduces(self) -> bool:
        """Whether this optimizer's gradients are reduced at all (a one-process job's are not)."""

    def watch(self, final_pass: Callable[[], bool], pass_started: Callable[[], None]) -> None:
        """Register the gradient hooks: each calls ``pass_started()`` first; ``final_pass()`` says whether the
        pass now running completes ``backward_passes_per_step`` passes (and so reduces)."""

    def synchronize(self) -> Any:
        """Wait for the pass's reductions: ``.grad`` then holds the averages."""

    def hold(self) -> None:
        """``no_sync()`` begins: the passes from now on accumulate locally."""

    def release(self) -> None:
        """``no_sync()`` ends: the next final pass reduces what was accumulated."""
