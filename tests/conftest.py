"""Markers by tier, from where a test lives: ``-m unit`` (one process, fast), ``-m parallel`` (real jobs
under a launcher), ``-m cluster`` (network namespaces, sshd, Slurm; root), ``-m docs`` (the blocks of README.md
and docs/*.md).

``make test`` runs the suite in two lanes (pytest-xdist, ``-n 2 --dist loadfile``): each test file is one
group, run whole by one lane, so a module's shared job or fixture is made once; the files that start a
cluster engine or own machine-wide names (tests/cluster: network namespaces, sshd, Slurm, podman, Ray's
``ray start``; tests/parallel/test_ray.py: a local Ray cluster) are one group, run one after another in
one lane, never beside each other; the files that compare the ranks' timings (``ALONE_FILES``) run last, with
the other lane idle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

TIERS = ("unit", "parallel", "cluster", "docs")
#: The lane group of the files that start a cluster engine or own machine-wide names (see above).
ENGINES = "engines"
#: Files outside tests/cluster that belong to the engines' group.
ENGINE_FILES = ("parallel/test_ray.py",)
#: The lane group of the files that compare the ranks' timings, which another lane's jobs would skew: they run
#: last, with the other lane idle.
ALONE = "alone"
ALONE_FILES = ("parallel/test_profiler_balanced.py",)
#: The order the groups start in: the engines' (the longest), then the tiers of jobs, the one-process files last,
#: where they even out the two lanes' ends; within a tier the group of the most tests first.
TIER_ORDER = ("cluster", "parallel", "docs", "unit")


def lane_group(relative: Path) -> str:
    """The lane group of a test file given relative to tests/: the file, the engines' group or the one run alone."""
    if relative.parts[0] == "cluster" or relative.as_posix() in ENGINE_FILES:
        return ENGINES
    if relative.as_posix() in ALONE_FILES:
        return ALONE
    return relative.as_posix()


def pytest_collection_modifyitems(items: list) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        try:
            tier = Path(str(item.fspath)).resolve().relative_to(here).parts[0]
        except ValueError:
            continue
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` (make test's): xdist's scheduling by file, with the engines' files as one group."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    def rank(scope: str) -> int:  # a stable sort: within a tier, xdist's order (the group of most tests first)
        tier = "cluster" if scope == ENGINES else scope.split("/", 1)[0]
        if scope == ALONE:
            return len(TIER_ORDER) + 1
        return TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER)

    class LaneScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = Path(nodeid.split("::", 1)[0])
            return lane_group(path.relative_to("tests") if path.parts[:1] == ("tests",) else path)

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # xdist queued the groups by size: put them in TIER_ORDER, the one run alone last
                for scope in sorted(self.workqueue, key=rank):
                    self.workqueue.move_to_end(scope)
                self.ordered = True
            if next(iter(self.workqueue)) == ALONE and node is not self.keeper:
                return  # the group run alone goes to the keeper only, once the other lanes are down
            super()._assign_work_unit(node)

        ordered = False
        #: The lane that runs the group run alone, once the other lanes are shut down.
        keeper: Any = None

        def _reschedule(self, node: Any) -> None:
            if not self.workqueue or node.shutting_down or next(iter(self.workqueue)) != ALONE:
                return super()._reschedule(node)
            # A lane keeps its last test until it gets more or is shut down (pytest needs the next item to tear
            # down): every lane at its last test means the other groups are all out; end the other lanes.
            if self.keeper is None and all(self._pending_of(work) <= 1 for work in self.assigned_work.values()):
                self.keeper = node
                for other in self.nodes:
                    if other is not node:
                        other.shutdown()
            self._run_alone()
            return None

        def remove_node(self, node: Any) -> Any:
            crashed = super().remove_node(node)
            self._run_alone()
            return crashed

        def _run_alone(self) -> None:
            if self.keeper is not None and self.nodes == [self.keeper] and self.workqueue:
                self._assign_work_unit(self.keeper)

    return LaneScheduling(config, log)
