"""Markers by tier, from where a test lives: ``-m unit`` (one process, fast), ``-m parallel`` (real jobs
under a launcher), ``-m cluster`` (network namespaces, sshd, Slurm; root), ``-m docs`` (the blocks of README.md
and docs/*.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = ("unit", "parallel", "cluster", "docs")


def pytest_collection_modifyitems(items: list) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        try:
            tier = Path(str(item.fspath)).resolve().relative_to(here).parts[0]
        except ValueError:
            continue
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
