"""How torch's gradients are cut into buckets, for every path that sends them in buckets: the direct gradient path
(:mod:`hvdp.backends.torch.direct.buckets`, in the order backward made them) and the sharded optimizer
(:mod:`hvdp.backends.torch.sharded_buckets`, each param group's buffer from its last parameter). One rule,
as DDP's reducer has: a bucket closes once it holds :data:`FIRST` elements or more (the first one, so that
the first allreduce starts early in backward) or :data:`BUCKET` (the others).

Example:
    >>> filler = Filler(first=4, cap=8)
    >>> [filler.add(i, size) for i, size in enumerate([3, 2, 5, 4, 1])]
    [None, [0, 1], None, [2, 3], None]
    >>> filler.rest()
    [4]
"""

from __future__ import annotations

from typing import Generic, List, Optional, TypeVar

#: Elements of the first bucket (the last layers' gradients, ready first): 1 MiB of float32.
FIRST = 1 << 18
#: Elements of the other buckets: 16 MiB of float32.
BUCKET = 1 << 22

T = TypeVar("T")


class Filler(Generic[T]):
    """Items (parameters, or their indices) taken one at a time into the bucket being filled; :meth:`add` gives
    the bucket back once it is full. ``first`` and ``cap`` default to :data:`FIRST` and :data:`BUCKET`, read
    when the filler is made (a test may set smaller ones)."""

    def __init__(self, first: Optional[int] = None, cap: Optional[int] = None) -> None:
        self.bound = FIRST if first is None else first
        self.cap = BUCKET if cap is None else cap
        self.items: List[T] = []
        self.size = 0

    def add(self, item: T, size: int) -> Optional[List[T]]:
        """Take ``item`` of ``size`` elements; the bucket it closes, or None while the bucket has room."""
        self.items.append(item)
        self.size += size
        if self.size < self.bound:
            return None
        full, self.items, self.size, self.bound = self.items, [], 0, self.cap
        return full

    def rest(self) -> List[T]:
        """The items of the bucket not full yet (empty when there are none); the filler starts a new bucket."""
        rest, self.items, self.size = self.items, [], 0
        return rest
