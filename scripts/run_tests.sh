#!/usr/bin/env bash
# `make test`'s suite: every ctest test (unit, multi-rank, faults, parity, ux, cuda), two at a time
# where ctest's PROCESSORS allow (a multi-rank test takes both cores and runs alone), then the time
# budget check (scripts/test_budget.py): the slowest tests, and a failure when the suite or any one
# test is over budget. Extra arguments go to ctest, e.g. `scripts/run_tests.sh build -L unit`.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=$(realpath "${1:-build}")
shift || true
JOBS=${CTEST_JOBS:-$(nproc)}
SECONDS=0
ctest --test-dir "$BUILD" --output-on-failure --timeout 600 -j "$JOBS" --output-junit "$BUILD/ctest-junit.xml" "$@"
rc=$?
wall=$SECONDS
PYTHON=python3
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
if ! "$PYTHON" scripts/test_budget.py --junit "$BUILD/ctest-junit.xml" --wall "$wall"; then
  [ "$rc" -eq 0 ] && rc=1
fi
exit "$rc"
