#!/usr/bin/env bash
# Set up .venv (first time only) and train the embedded default: GRPO on a tiny model, on CPU.
# Extra arguments are passed on as config overrides, e.g. runtime_args.rollout_backend=hf
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec .venv/bin/chatlearn run template/grpo_fsdp.yaml "$@"
