""".ci/suite_time.py, the guard against the suite's regrowth: it reads pytest's JUnit report, prints the
slowest tests and the time per file, and fails when the total passes the budget by more than the margin."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def report(path: Path, seconds: float, cases: dict) -> Path:
    body = "".join(f'<testcase classname="tests.parallel.{module}" name="{name}" time="{t}"/>'
                   for (module, name), t in cases.items())
    path.write_text(f'<testsuites><testsuite name="pytest" tests="{len(cases)}" time="{seconds}">{body}'
                    "</testsuite></testsuites>")
    return path


def suite_time(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / ".ci" / "suite_time.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_total_within_the_margin_passes_and_past_it_fails_saying_what_to_do(tmp_path):
    junit = report(tmp_path / "junit.xml", 1000.0, {("test_core", "a"): 500.0, ("test_core", "b"): 200.0,
                                                     ("test_data_path", "c"): 300.0})
    within = suite_time(junit, "--budget", "600", "--margin", "1.0")
    assert within.returncode == 0, within.stdout
    assert ("the suite: 3 tests in 1000 s of wall time (budget 600 s, failing above 1200 s); their own times add "
            "up to 1000 s") in within.stdout
    assert "700.0 s  tests/parallel/test_core.py" in within.stdout  # the time per file
    assert within.stdout.index("500.0 s  tests.parallel.test_core::a") < within.stdout.index("300.0 s")
    past = suite_time(junit, "--budget", "400", "--margin", "1.0")
    assert past.returncode == 1, past.stdout
    assert "FAILED: the suite took 1000 s, over its budget of 400 s by more than 100%" in past.stdout
    assert "Group the new checks into shared jobs" in past.stdout


def test_failed_and_errored_tests_are_listed_with_the_lines_that_say_why(tmp_path):
    error = ('<testcase classname="tests.parallel.test_sets" name="test_a[gloo]" time="3">'
             '<error message="AssertionError: process_sets.py exited 1">job output:\n'
             "[1] [2026-12-02 18:44:49: E horovod/common/operations.cc:697] Gloo all-reduce failed\n"
             "an ordinary line\n</error></testcase>")
    failure = ('<testcase classname="tests.unit.test_x" name="test_b" time="1">'
               '<failure message="assert 1 == 2">plain text only</failure></testcase>')
    passed = '<testcase classname="tests.unit.test_x" name="test_c" time="1"/>'
    junit = tmp_path / "junit.xml"
    junit.write_text(f'<testsuites><testsuite name="pytest" tests="3" time="5">{error}{failure}{passed}'
                     '<testcase classname="" name="tests.unit.test_gone" time="0"/></testsuite></testsuites>')
    out = suite_time(junit, "--budget", "600").stdout
    assert "[ci] 2 test(s) failed or errored, with the lines that say why:" in out
    assert "[ci] FAILED tests.parallel.test_sets::test_a[gloo]" in out
    assert "E horovod/common/operations.cc:697] Gloo all-reduce failed" in out
    assert "an ordinary line" not in out  # only the lines that say why
    assert "[ci] FAILED tests.unit.test_x::test_b" in out
    assert "test_c" not in out.split("failed or errored")[1]
    assert "(collection)" in out and "\n[ci]      0.0 s  .py" not in out  # a report without a module


def test_two_lanes_the_wall_time_is_the_total(tmp_path):
    junit = report(tmp_path / "junit.xml", 600.0, {("test_core", "a[gloo]"): 500.0, ("test_ray", "b"): 300.0})
    out = suite_time(junit, "--budget", "500", "--margin", "0.5")
    assert out.returncode == 0, out.stdout  # 600 s of wall time, within 750, though the tests add up to 800
    assert "2 tests in 600 s of wall time" in out.stdout and "add up to 800 s (the lanes side by side)" in out.stdout
    assert "500.0 s  tests.parallel.test_core::a[gloo]\n" in out.stdout


def test_each_file_is_a_lane_group_the_engines_share_one_and_the_timing_comparison_runs_alone():
    spec = importlib.util.spec_from_file_location("suite_conftest", REPO / "tests" / "conftest.py")
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    assert conftest.lane_group(Path("parallel/test_core.py")) == "parallel/test_core.py"
    assert conftest.lane_group(Path("unit/test_lint.py")) == "unit/test_lint.py"
    assert {conftest.lane_group(Path(p)) for p in ("cluster/test_compose.py", "cluster/test_slurm.py",
                                                   "parallel/test_ray.py")} == {"engines"}
    assert conftest.lane_group(Path("parallel/test_profiler_balanced.py")) == "alone"
