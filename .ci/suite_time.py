"""The suite's time from pytest's JUnit XML: the slowest tests, the time per file, the total; exit 1 when
the total passes the budget by more than the margin (the suite has grown: group its new checks).

Usage: python .ci/suite_time.py JUNIT.xml [--budget SECONDS] [--margin FRACTION] [--top N]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import xml.etree.ElementTree as ET

#: The suite's budget on this machine kind (2 cores): .ci/run's 30 minutes less its set-up (docs/contributing.md).
BUDGET_S = 1800.0
#: These machines vary up to 2x from day to day (the same Horovod build took 235 s and 499 s): a total
#: up to BUDGET_S * (1 + MARGIN) passes (60 min: with a Horovod build, still well within CI's 90);
#: past it the suite has grown, whatever the day.
MARGIN = 1.0


def module_path(classname: str) -> str:
    """``tests.parallel.test_core`` (or ``tests.unit.test_x.TestY``) as the file ``tests/parallel/test_core.py``."""
    if not classname:  # a report of the collection (a module skipped or failing to import)
        return "(collection)"
    parts = classname.split(".")
    if len(parts) > 1 and parts[-1][:1].isupper():  # a test class inside the module
        parts = parts[:-1]
    return "/".join(parts) + ".py"


#: Lines of a failed test's report worth showing when only part of the output is kept: an error Horovod
#: logged (``[2026-12-02 18:44:49.081: E .../operations.cc:697] ...``), hvdp's summary of a failed job,
#: a Python exception, a timeout.
CAUSE = re.compile(r"\d: E |hvdp: |Error: |Error\(|Timeout|timed out")


def causes(case: ET.Element, most: int = 8) -> list:
    """The first lines of a failed or errored test's report that say why, each cut to 300 characters."""
    found = []
    for outcome in list(case.iter("failure")) + list(case.iter("error")):
        for line in [outcome.get("message", ""), *(outcome.text or "").splitlines()]:
            line = line.strip()
            if line and CAUSE.search(line) and line[:300] not in found:
                found.append(line[:300])
    return found[:most]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit")
    parser.add_argument("--budget", type=float, default=BUDGET_S)
    parser.add_argument("--margin", type=float, default=MARGIN)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    root = ET.parse(args.junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = sum(float(s.get("time", 0)) for s in suites)
    cases = [(float(c.get("time", 0)), f"{c.get('classname', '')}::{c.get('name', '')}")
             for s in suites for c in s.iter("testcase")]
    per_file: collections.Counter = collections.Counter()
    for seconds, name in cases:
        per_file[module_path(name.split("::")[0])] += seconds
    print(f"[ci] the suite's slowest {args.top} tests (setup and teardown of shared fixtures counted once, "
          "in the test that ran them):")
    for seconds, name in sorted(cases, reverse=True)[:args.top]:
        print(f"[ci] {seconds:8.1f} s  {name}")
    print("[ci] time per file:")
    for name, seconds in per_file.most_common():
        print(f"[ci] {seconds:8.1f} s  {name}")
    failed = [(f"{c.get('classname', '')}::{c.get('name', '')}", causes(c)) for s in suites for c in s.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    if failed:
        print(f"[ci] {len(failed)} test(s) failed or errored, with the lines that say why:")
        for name, lines in failed:
            print(f"[ci] FAILED {name}")
            for line in lines:
                print(f"[ci]     {line}")
    limit = args.budget * (1 + args.margin)
    lanes = sum(seconds for seconds, _ in cases)
    print(f"[ci] the suite: {len(cases)} tests in {total:.0f} s of wall time (budget {args.budget:.0f} s, "
          f"failing above {limit:.0f} s); their own times add up to {lanes:.0f} s (the lanes side by side)")
    if total > limit:
        print(f"[ci] FAILED: the suite took {total:.0f} s, over its budget of {args.budget:.0f} s by more than "
              f"{args.margin:.0%}. Group the new checks into shared jobs (docs/contributing.md) or raise the budget "
              "in .ci/suite_time.py with the reason.")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
