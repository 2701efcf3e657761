"""End to end: a run with a judge, a reward model and a rule function colocated (each model's turns in the timeline,
their weighted sum the reward, each source's metrics), and ``chatlearn eval`` scoring with the judge."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

SHORT = ["runtime_args.num_episode=2", "runtime_args.sample_per_episode=32", "runtime_args.train_global_batch_size=32",
         "runtime_args.train_micro_batch_size=32", "models.policy.num_inference_per_prompt=4",
         "runtime_args.eval_episode_interval=2", "runtime_args.enable_eval_before_training=False",
         "models.policy.eval_num_inference_per_prompt=1", "runtime_args.save_episode_interval=0"]
THREE = ["models.reward.functions=[{name: math, path: builtin:math, weight: 0.5}]",
         "models.rm.kind=reward_model", "models.rm.load=assets/tiny_rm", "models.rm.weight=0.25",
         "models.rm.normalize=batch", "runtime_args.colocation=[policy,policy_trainer,ref_policy,judge,rm]",
         "runtime_args.offload_without_gpu=true"]


def _run(*args, timeout=580):
    proc = subprocess.run([sys.executable, "-m", "chatlearn.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _rows(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_judge_reward_model_and_rule_take_turns(tmp_path):
    out = tmp_path / "out"
    _run("run", "template/grpo_judge.yaml", *SHORT, *THREE, f"runtime_args.output_dir={out}")
    rows = _rows(out / "metrics.jsonl")
    assert [r["episode"] for r in rows] == [1, 2]
    for r in rows:
        # one weighted sum: 0.5 x the rule + 1.0 x the judge's P(yes) + 0.25 x the whitened reward model (mean 0)
        expected = 0.5 * r["train/reward/math/score"] + r["train/reward/judge/score"]
        assert r["train/reward_mean"] == pytest.approx(expected, abs=1e-4)
        assert r["train/reward/rm/reward"] == pytest.approx(0.0, abs=1e-5)
        assert 0.0 <= r["train/judge/judge/score_min"] <= r["train/judge/judge/score_max"] <= 1.0
        assert r["train/judge/judge/unparsed"] == 0.0
        assert "train/reward_model/rm/score_mean" in r
    assert "eval/reward/judge/score" in rows[-1] and "eval/judge/judge/unparsed" in rows[-1]
    events = _rows(out / "timeline.jsonl")
    turns = {(e["model"], e["stage"]) for e in events if e["kind"] == "stage"}
    assert {("judge", "judge"), ("rm", "reward_model"), ("reward", "reward"), ("policy", "generate")} <= turns
    # on shared devices, the judge's weights and KV cache leave when another model takes its turn
    moved = [e for e in events if e.get("model") == "judge" and e["kind"] == "transition"]
    assert {e["action"] for e in moved} == {"offload", "onload"}, moved[:5]
    assert {p for e in moved for p in e["parts"]} == {"weights", "kv_cache"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chatlearn_eval_scores_with_the_judge(tmp_path):
    out = tmp_path / "out"
    _run("eval", "template/grpo_judge.yaml", f"runtime_args.output_dir={out}",
         "models.policy.eval_num_inference_per_prompt=1", "runtime_args.rollout_backend=hf")
    found = json.loads((out / "eval" / "metrics.json").read_text())
    flat = found["metrics"]["all"]
    assert "judge/judge/unparsed" in flat and 0.0 <= flat["reward/judge/score"] <= 1.0
    assert flat["reward_mean"] == pytest.approx(flat["reward/judge/score"], abs=1e-5)  # the rule has weight 0
