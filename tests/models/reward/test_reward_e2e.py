"""End to end: ``chatlearn run`` on the embedded default with user reward functions given by ``.py`` paths."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

SHORT = ["runtime_args.num_episode=2", "runtime_args.sample_per_episode=64", "runtime_args.train_global_batch_size=32",
         "runtime_args.train_micro_batch_size=16", "models.policy.num_inference_per_prompt=4",
         "runtime_args.eval_episode_interval=2", "runtime_args.enable_eval_before_training=False",
         "models.policy.eval_num_inference_per_prompt=1", "runtime_args.rollout_backend=hf",
         "models.reward.num_cpu=2"]

PROBE = '''
def probe(*, prompts, responses, ground_truths, data_sources, extra):
    """Weight 0: only logs what the workers were given."""
    n = len(responses)
    return {"score": [0.0] * n,
            "prompt_is_question": [1.0 if "What is" in p and "<|im_start|>" not in p else 0.0 for p in prompts],
            "has_extra_info": [1.0 if isinstance(x.get("extra_info"), dict) and "index" in x["extra_info"] else 0.0
                               for x in extra],
            "has_truth": [1.0 if str(g).isdigit() else 0.0 for g in ground_truths]}
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_user_reward_functions_train(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "out"
    functions = ("[{name: math, path: builtin:math, weight: 1.0}, {name: format, path: "
                 "examples/custom_reward/reward.py:format_reward, weight: 0.5, kwargs: {max_chars: 20, "
                 f"length_penalty: 0.01}}}}, {{name: probe, path: '{probe}:probe', weight: 0.0}}]")
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", "examples/custom_reward/grpo_custom_reward.yaml", *SHORT,
           f"models.reward.functions={functions}", f"runtime_args.output_dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=580,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["episode"] for r in rows] == [1, 2]
    for r in rows:
        # the logged reward is the weighted sum of the parts (the mean is linear)
        expected = r["train/reward/math/score"] + 0.5 * r["train/reward/format/score"]
        assert r["train/reward_mean"] == pytest.approx(expected, abs=1e-5)
        assert r["train/reward/format/score"] == pytest.approx(
            r["train/reward/format/has_boxed"] - r["train/reward/format/length_penalty"], abs=1e-6)
        assert r["train/reward/probe/score"] == 0.0
        for key in ("prompt_is_question", "has_extra_info", "has_truth"):
            assert r[f"train/reward/probe/{key}"] == 1.0, key
        assert r["train/loss"] == r["train/loss"]  # trained (finite)
    assert "eval/reward/format/has_boxed" in rows[1] and "eval/reward/math/score" in rows[1]
