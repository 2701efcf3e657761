"""A weight push that does not land (tests/reliability/stale_push_site: the transformers engine's weight
load made a no-op inside the workers) stops a real run after the push of episode 1, with exit 2 and one
paragraph naming the model, the replica, the gap and the tolerance, before any episode trains on the
stale rollout's samples. The passing case (a landed push, its gap metric small) is checked in the runs
of tests/e2e/test_train_e2e.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO

SITE = os.path.join(REPO, "tests", "reliability", "stale_push_site")
RUN = ["runtime_args.num_episode=2", "runtime_args.sample_per_episode=16", "runtime_args.train_global_batch_size=16",
       "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
       "runtime_args.eval_episode_interval=0", "runtime_args.enable_eval_before_training=false",
       "runtime_args.save_episode_interval=0", "models.policy_trainer.kl_coef=0", "runtime_args.rollout_backend=hf"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_push_that_does_not_land_stops_the_run(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CHATLEARN_TEST_STALE_PUSH": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *RUN,
                           f"runtime_args.output_dir={out}"], cwd=REPO, capture_output=True, text=True,
                          timeout=280, env=env)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said[-5000:]
    assert "Traceback" not in said, said[-5000:]
    text = " ".join(said.split())
    for part in ("the weight push after episode 1 did not land in the rollout engine", "its only replica",
                 "hf rollout of", "tiny_qwen2", "nats, above the tolerance 0.01 (float32's default",
                 "runtime_args.weight_push_check_tolerance", "runtime_args.weight_push_check=false"):
        assert part in text, (part, said[-5000:])
    rows = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    assert not [r for r in rows if '"train/loss"' in r], rows  # no episode trained on, nor logged, the stale samples
