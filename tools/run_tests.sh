#!/usr/bin/env bash
# Set up .venv (first time only) and run the test suite. Extra arguments go to pytest.
#   bash tools/run_tests.sh          the whole suite (before submitting; at most 20 minutes on 2 cores)
#   bash tools/run_tests.sh --fast   the tests not marked slow: unit, parity, config and contract tests
#                                    (while working; at most 5 minutes on 2 cores)
# The tiers, the budget and how to add an end-to-end check: docs/testing.md.
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh || exit 1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SELECT=()
ARGS=()
for arg in "$@"; do
  if [ "$arg" = "--fast" ]; then
    SELECT=(-m "not slow")
  else
    ARGS+=("$arg")
  fi
done
# Two test processes (pytest-xdist, one per core; a test file stays in one process, so its module-scoped
# runs are made once; runs shared between files are made once per suite: tests/support/shared_runs.py):
# most of a run's time is single-threaded start-up and waiting, which the other process fills. Files go
# out in collection order, the longest first (tests/conftest.py), not xdist's order by number of tests.
# CHATLEARN_TEST_WORKERS=0 runs everything in this process.
WORKERS=${CHATLEARN_TEST_WORKERS:-2}
if [ "$WORKERS" -gt 0 ]; then
  PARALLEL=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
else
  PARALLEL=()
fi
# CHATLEARN_TEST_REPORT=FILE keeps pytest's JUnit XML report (every test's time) in FILE
REPORT=${CHATLEARN_TEST_REPORT:-}
if [ -z "$REPORT" ]; then
  REPORT=$(mktemp -t chatlearn-tests-XXXXXX.xml)
  trap 'rm -f "$REPORT"' EXIT
fi
start=$(date +%s)
.venv/bin/python -m pytest tests "${PARALLEL[@]}" "${SELECT[@]}" --durations=30 --junitxml="$REPORT" "${ARGS[@]}"
rc=$?
# the suite's wall time and its ten slowest tests (set-up, call and teardown together: a module's shared
# run counts in the first test that asks for it)
.venv/bin/python tools/test_report.py "$REPORT" "$(( $(date +%s) - start ))" || true
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
