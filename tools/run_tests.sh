#!/usr/bin/env bash
# Set up .venv (first time only) and run the test suite. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh || exit 1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/python -m pytest tests --durations=30 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
