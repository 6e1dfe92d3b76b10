"""One change to Horovod's source (:class:`Patch`), and the text of the modules a change inserts.

The patches themselves are listed by what they change: :mod:`.patches` (every build),
:mod:`.torch_patches`, :mod:`.tensorflow_patches`; the inserted modules are in ``inserted/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Patch:
    """One textual change to Horovod's source, which must match exactly once."""

    path: str
    old: str
    new: str
    why: str


def insertion(name: str) -> str:
    """The text of hvdp/horovod_build/inserted/NAME.py, which a patch inserts into a Horovod module."""
    return "\n\n" + (Path(__file__).parent / "inserted" / f"{name}.py").read_text()
