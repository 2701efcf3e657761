"""End to end with LoRA (models.policy_trainer.lora): the tiny default, transformers rollout, 2 episodes.

One run checks: the plan starts no ref_policy (the trainer gives the reference log-probs with its
adapters disabled), the adapters learn (non-zero gradient norm, the policy moves away from the
reference), the rollout generates with the trained adapters (the merged weights pushed after episode 1:
episode 2's rollout and trainer log-probs agree), the checkpoint holds only the adapters, and the HF
folder is the merged model."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

RUN = ["runtime_args.num_episode=2", "runtime_args.sample_per_episode=16", "runtime_args.train_global_batch_size=16",
       "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
       "runtime_args.eval_episode_interval=0", "runtime_args.enable_eval_before_training=false",
       "runtime_args.save_episode_interval=2",
       "models.policy_trainer.kl_coef=0.05", "runtime_args.rollout_backend=hf",
       "models.policy_trainer.lora.rank=8", "models.policy_trainer.lora.alpha=16",
       "models.policy_trainer.optimizer.lr=1e-3"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_lora_run(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *RUN,
           f"runtime_args.output_dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=380,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "ref_policy: not started (LoRA" in proc.stdout
    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    train = [r for r in rows if "train/loss" in r]
    assert [r["episode"] for r in train] == [1, 2]
    for r in train:
        assert r["train/grad_norm"] > 0, r
        assert "time/ref_logprobs" in r, r
        assert r["train/logprob_diff_rollout_vs_trainer_max"] < 1e-4, r
    assert train[0]["train/kl"] == 0  # episode 1: the adapters start at B = 0, the policy is the base
    assert train[1]["train/kl"] > 1e-6  # episode 2: trained adapters (also in the rollout, checked above)
    ckpt = out / "checkpoints" / "episode_000002"
    meta = json.loads((ckpt / "trainer" / "chatlearn_checkpoint.json").read_text())
    assert meta["tensors"] and all(".lora_A." in n or ".lora_B." in n for n in meta["tensors"])
    assert meta["lora"]["rank"] == 8 and meta["lora"]["base"]["folder"].endswith("tiny_qwen2")
    from safetensors import safe_open

    with safe_open(str(ckpt / "hf" / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in names and not [n for n in names if "lora" in n]
    # chatlearn merge of an adapter checkpoint: refused in one paragraph pointing at the merged hf/ folder
    merged = subprocess.run([sys.executable, "-m", "chatlearn.cli", "merge", str(ckpt), str(out / "merged")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    said = " ".join(merged.stderr.split())
    assert merged.returncode == 2 and "holds LoRA adapters" in said and "Traceback" not in said, merged.stderr
    assert not (out / "merged").exists()
