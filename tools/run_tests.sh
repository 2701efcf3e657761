#!/usr/bin/env bash
# Set up .venv (first time only) and run the test suite. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh || exit 1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Two test processes (pytest-xdist, one per core; a test file stays in one process, so its shared runs
# are made once): most of a run's time is single-threaded start-up and waiting, which the other process
# fills. Files go out in collection order, the longest first (tests/conftest.py), not xdist's order by
# number of tests. CHATLEARN_TEST_WORKERS=0 runs everything in this process.
WORKERS=${CHATLEARN_TEST_WORKERS:-2}
if [ "$WORKERS" -gt 0 ]; then
  PARALLEL=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
else
  PARALLEL=()
fi
.venv/bin/python -m pytest tests "${PARALLEL[@]}" --durations=30 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
