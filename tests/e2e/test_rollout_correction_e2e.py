"""End to end: short runs with the rollout corrections (tis; mis with the rollout engine's log-probs
as the old ones, DAPO's dynamic sampling and overlong shaping; decoupled's formula is tested in
tests/algorithms): their metrics are logged and plotted, and a run with dynamic sampling resumes
exactly."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from shared_runs import rewound_copy

from conftest import REPO

SHORT = ["runtime_args.sample_per_episode=32", "runtime_args.train_global_batch_size=16",
         "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
         "runtime_args.eval_episode_interval=0", "runtime_args.enable_eval_before_training=False",
         "runtime_args.save_episode_interval=1", "runtime_args.rollout_backend=hf"]


def run(out, *overrides, episodes=2):
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *SHORT, *overrides,
           f"runtime_args.num_episode={episodes}", f"runtime_args.output_dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()], proc.stdout


CASES = {
    "tis-token": (["models.policy_trainer.rollout_correction=tis"], "is_clip_frac"),
    "mis-geometric-rollout-old-dapo": (
        ["models.policy_trainer.rollout_correction=mis", "models.policy_trainer.rollout_correction_level=geometric",
         "models.policy_trainer.old_logprobs=rollout", "runtime_args.dynamic_sampling=true",
         "runtime_args.dynamic_sampling_max_rounds=3", "models.reward.overlong_buffer_len=8",
         "models.policy_trainer.pos_clip_ratio=0.28"], "is_masked_frac"),
}  # decoupled (mis with no lower bound) at the sequence level: tests/algorithms/test_rollout_correction.py


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_corrected_runs_log_and_plot_their_metrics(case, tmp_path):
    overrides, frac = CASES[case]
    rows, stdout = run(tmp_path / "out", *overrides)
    assert [r["episode"] for r in rows] == [1, 2]
    assert "rollout correction: " + case.split("-")[0] in stdout
    for r in rows:
        for key in ("train/is_weight_mean", "train/is_weight_max", "train/is_mismatch_kl", f"train/{frac}",
                    "train/mismatch_kl", "train/logprob_diff_rollout_vs_trainer_mean", "train/loss"):
            assert key in r, (key, sorted(r))
        assert 0 <= r[f"train/{frac}"] <= 1 and r["train/is_weight_max"] >= r["train/is_weight_mean"] * 0.999
    if "rollout-old" in case:
        assert "old log-probs: the rollout engine's, for every optimizer step" in stdout
        assert all("time/old_logprobs" not in r for r in rows)  # no pass ran
        for r in rows:
            assert r["train/dynamic_sampling_rounds"] >= 1 and r["train/dynamic_sampling_prompts_drawn"] >= 8
            assert r["train/dynamic_sampling_prompts_drawn"] == 8 * r["train/dynamic_sampling_rounds"]
            assert "train/overlong_penalty_mean" in r and r["train/overlong_penalty_mean"] <= 0
    plots = set(os.listdir(tmp_path / "out" / "plots"))
    assert {"mismatch.png", "rollout_correction.png"} <= plots, plots
    if "dapo" in case:
        assert "dynamic_sampling.png" in plots


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dynamic_sampling_resumes_exactly(tmp_path):
    """Three episodes at once, and a copy of that run resumed from its second checkpoint: the same
    metrics (the extra prompts the rounds drew are part of the saved data position)."""
    dapo = ["runtime_args.dynamic_sampling=true", "runtime_args.dynamic_sampling_max_rounds=4"]
    whole, _ = run(tmp_path / "a", *dapo, episodes=3)
    rewound_copy(tmp_path / "a", tmp_path / "b", 2)  # as cut in the middle of checkpoint 3's save
    resumed, stdout = run(tmp_path / "b", *dapo, episodes=3)
    assert "resuming from" in stdout and "(episode 2)" in stdout
    assert any(r["train/dynamic_sampling_rounds"] > 1 for r in whole)  # the rounds were exercised

    def learning(rows):
        return [{k: v for k, v in r.items() if k == "episode" or k.startswith("train/")} for r in rows]

    assert learning(resumed) == learning(whole)
