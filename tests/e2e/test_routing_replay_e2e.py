"""End to end: routing replay through a whole run (a tiny random Qwen3-MoE, the transformers rollout, the FSDP2
trainer and its reference, a KL term): the rollout's routes reach every trainer forward (the agreement is
reported, the rollout-vs-trainer gap is float rounding), and with replay off the gap is reported alone."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

RUN = ["runtime_args.num_episode=2", "runtime_args.sample_per_episode=32", "runtime_args.train_global_batch_size=16",
       "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
       "runtime_args.eval_episode_interval=0", "runtime_args.enable_eval_before_training=false",
       "runtime_args.save_episode_interval=0", "models.policy_trainer.kl_coef=0.01", "runtime_args.rollout_backend=hf"]


def run(tmp_path, model: str, replay: str) -> list[dict]:
    out = tmp_path / replay
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *RUN,
           f"models.policy_trainer.load={model}", f"models.policy_trainer.routing_replay={replay}",
           f"runtime_args.output_dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        return [r for r in (json.loads(line) for line in f if line.strip()) if "train/loss" in r]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_replays_the_rollouts_routes(tmp_path):
    from tiny_moe import make_tiny_moe

    model = make_tiny_moe(str(tmp_path / "moe"), seed=0)
    on = run(tmp_path, model, "rollout")
    assert len(on) == 2
    for row in on:
        assert 0.9 < row["train/moe/routing_agreement"] <= 1.0
        assert row["train/moe/logprob_gap"] == row["train/logprob_diff_rollout_vs_trainer_mean"] < 1e-5
    off = run(tmp_path, model, "off")
    assert all("train/moe/routing_agreement" not in row and row["train/moe/logprob_gap"] < 1e-5 for row in off)
