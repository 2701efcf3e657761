"""End to end: ``chatlearn run`` with ``rollout_backend=sglang`` against the fake SGLang engine.

The run's environment puts ``tests/support/fake_sglang`` on ``PYTHONPATH`` (as the Megatron
end-to-end test does with its CPU shim), so that the rollout actors' ``import sglang`` finds
the fake; the package itself is unchanged.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO
from runs import small_eval_set

SHORT = ["runtime_args.num_episode=2", "runtime_args.sample_per_episode=32",
         "runtime_args.train_global_batch_size=16", "runtime_args.train_micro_batch_size=8",
         "models.policy.num_inference_per_prompt=4", "runtime_args.eval_episode_interval=0",
         "runtime_args.enable_eval_before_training=True", "models.policy.eval_num_inference_per_prompt=1",
         "models.policy_trainer.kl_coef=0.01", "runtime_args.rollout_backend=sglang"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_episodes_with_the_sglang_adapter(tmp_path):
    out = tmp_path / "out"
    fake = os.path.join(REPO, "tests", "support", "fake_sglang")
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (fake, os.environ.get("PYTHONPATH")) if p)}
    env.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *SHORT,
           f"runtime_args.eval_data_path={small_eval_set(tmp_path)}", f"runtime_args.output_dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=580, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("episode")]
    assert len(lines) == 3 and "eval" in lines[0] and "reward" in lines[1], proc.stdout

    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["episode"] for r in rows] == [0, 1, 2]
    assert "eval/reward_mean" in rows[0]
    for row in rows[1:]:
        for key in ("train/reward_mean", "train/loss", "time/generate", "time/weight_push"):
            assert key in row, key
        # the engine's log-probs agree with the trainer's: in episode 2 after the weight push
        # (update_weights_from_tensor) and the release/resume of the colocated engine
        assert row["train/logprob_diff_rollout_vs_trainer_max"] < 1e-4, row
    assert rows[2]["train/kl"] > 0  # the policy moved: the pushed weights were new
