"""The end of tools/run_tests.sh: the suite's wall time and its ten slowest tests, read from pytest's
JUnit XML report (``python tools/test_report.py REPORT WALL_SECONDS [N]``: the N slowest, 10 by default;
each test's time is its set-up, call and teardown together, so a run made by a
fixture counts in the first test that asks for it)."""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

from chatlearn.logging.progress import format_seconds


def main(report: str, wall_s: str, top: str = "10") -> int:
    try:
        root = ET.parse(report).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"[tests] no report to read ({e})")
        return 1
    cases = [(float(tc.get("time") or 0), f"{tc.get('classname')}::{tc.get('name')}") for tc in root.iter("testcase")]
    total = sum(t for t, _ in cases)
    print(f"[tests] wall time {format_seconds(float(wall_s))} for {len(cases)} tests ({format_seconds(total)} of test time "
          "over the test processes)")
    print(f"[tests] the {'ten' if top == '10' else top} slowest:")
    for seconds, name in sorted(cases, reverse=True)[:int(top)]:
        print(f"[tests] {seconds:7.1f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
