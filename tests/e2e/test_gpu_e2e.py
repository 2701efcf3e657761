"""On CUDA: ``chatlearn run`` end to end with the transformers rollout, bf16 by default, the models
taking turns on one GPU with real offload/onload, and the memory each turn gives back read from
the timeline. Skipped without CUDA."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHORT = ["runtime_args.num_episode=3", "runtime_args.sample_per_episode=64", "runtime_args.train_global_batch_size=32",
         "runtime_args.train_micro_batch_size=16", "models.policy.num_inference_per_prompt=4",
         "runtime_args.eval_episode_interval=3", "runtime_args.save_episode_interval=3",
         "models.policy.eval_num_inference_per_prompt=1", "models.policy_trainer.kl_coef=0.01",
         "runtime_args.rollout_backend=hf"]
# After a model's turn ends, what its process still holds on the GPU (torch's reserved memory, MiB):
# the CUDA context is not counted there; the caching allocator must have returned its blocks and the
# cuBLAS workspaces (32 MiB each on Hopper) must be gone (chatlearn.models.stash.release_device_memory);
# what stays is rotary buffers, RNG state and allocator rounding of a 1M-parameter model.
OFFLOADED_RESERVED_MB = 16


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.timeout(900)
def test_run_on_cuda_with_turns_and_memory(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *SHORT,
           f"runtime_args.output_dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=880,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = read_jsonl(out / "metrics.jsonl")
    train = [r for r in rows if "train/loss" in r]
    assert len(train) == 3
    for r in train:
        assert r["train/grad_norm"] == r["train/grad_norm"]  # finite
        # bf16 on both sides (auto): the engine and the trainer agree to bf16 precision
        assert r["train/logprob_diff_rollout_vs_trainer_mean"] < 0.05, r
        for model in ("policy", "policy_trainer", "ref_policy"):
            assert r[f"memory/{model}_gpu_reserved_mb"] > 0, model

    events = read_jsonl(out / "timeline.jsonl")
    moves = [e for e in events if e["kind"] == "transition"]
    assert moves and all("gpu_memory" in e for e in moves)
    # models whose workers share a process (the transformers rollout is fused into the policy
    # trainer's processes by default): the numbers are the process's, so a model's offload is
    # checked when no model of its process is still resident
    pids = {m: {d["pid"] for w in workers for d in w} for e in moves for m, workers in e["gpu_memory"].items()}
    checked = 0
    for e in moves:
        if e["action"] != "offload":
            continue
        sharing = {m for m, p in pids.items() if p & pids[e["model"]]}
        if sharing & set(e["resident"]):
            continue
        # the models of that process left the GPU entirely: the process holds (almost) nothing there
        for worker in e["gpu_memory"][e["model"]]:
            for dev in worker:
                assert dev["reserved_mb"] <= OFFLOADED_RESERVED_MB, (e["model"], dev)
                checked += 1
    assert checked > 0
