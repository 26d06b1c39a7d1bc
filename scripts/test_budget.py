#!/usr/bin/env python3
"""The suite's time budget, checked after every `make test` (scripts/run_tests.sh).

Reads ctest's JUnit report, prints the slowest tests and the suite's wall time, and exits 1 when
the whole run took longer than its budget or any one test longer than the per-test budget, so a
new feature cannot push CI (90 minutes for set-up, build and suite) past its limit unnoticed. The
budgets are the README's, for the 2-core CI machine: the suite targets 15 minutes (it takes 13 to
15 here) and fails at 20, so that a slow machine does not fail CI while real growth does; no test
may take more than 60 s.
"""
import argparse
import sys
import xml.etree.ElementTree as ET

SUITE_BUDGET_S = 20 * 60
SUITE_TARGET_S = 15 * 60
TEST_BUDGET_S = 60.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--junit", required=True, help="ctest --output-junit file")
    ap.add_argument("--wall", type=float, required=True, help="the ctest run's wall-clock seconds")
    ap.add_argument("--suite-budget", type=float, default=SUITE_BUDGET_S)
    ap.add_argument("--test-budget", type=float, default=TEST_BUDGET_S)
    ap.add_argument("--top", type=int, default=15, help="how many of the slowest tests to list")
    args = ap.parse_args()
    try:
        root = ET.parse(args.junit).getroot()
    except (OSError, ET.ParseError) as e:
        print(f"test budget: cannot read ctest's report {args.junit}: {e}", file=sys.stderr)
        return 1
    times = []
    for case in root.iter("testcase"):
        status = case.get("status", "run")
        times.append((float(case.get("time", "0") or 0), case.get("name", "?"), status))
    times.sort(reverse=True)
    total = sum(t for t, _, _ in times)
    print(f"\ntest budget: {len(times)} tests, wall {args.wall:.0f} s (budget {args.suite_budget:.0f} s), "
          f"sum of test times {total:.0f} s; the slowest:")
    for t, name, status in times[: args.top]:
        flag = "  OVER BUDGET" if t > args.test_budget else ""
        print(f"  {t:7.1f} s  {name}{'' if status == 'run' else f' ({status})'}{flag}")
    over = [(t, n) for t, n, _ in times if t > args.test_budget]
    ok = True
    if over:
        print(f"test budget: {len(over)} test(s) over the per-test budget of {args.test_budget:.0f} s: "
              + ", ".join(f"{n} ({t:.0f} s)" for t, n in over)
              + "; make them smaller (model, steps, layouts per test) or split them", file=sys.stderr)
        ok = False
    if SUITE_TARGET_S < args.wall <= args.suite_budget:
        print(f"test budget: warning: the suite took {args.wall:.0f} s, over its {SUITE_TARGET_S:.0f} s target "
              f"(the budget, {args.suite_budget:.0f} s, fails the run); trim the slowest tests above")
    if args.wall > args.suite_budget:
        print(f"test budget: the suite took {args.wall:.0f} s, over its budget of {args.suite_budget:.0f} s; "
              "see the slowest tests above", file=sys.stderr)
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
