"""End to end: runtime_args.max_staleness=1 on two logical devices (rollout and trainer apart):
every trained sample is at most one version old (exactly one from episode 2 on), the correction
resolves to decoupled, and a run cut after a checkpoint (a copy of the run left so) resumes to the same
metrics as the uninterrupted one (the checkpoint keeps the rollout generated ahead)."""
from __future__ import annotations

import os
import sys

import pytest
from runs import finish as finish_run
from runs import learning_metrics, metric_rows, small_eval_set
from shared_runs import rewound_copy


RUN = ["runtime_args.num_episode=4", "runtime_args.sample_per_episode=32", "runtime_args.train_global_batch_size=16",
       "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
       "runtime_args.eval_episode_interval=2", "models.policy.eval_num_inference_per_prompt=1",
       "runtime_args.save_episode_interval=1", "runtime_args.rollout_backend=hf", "runtime_args.colocation=[]",
       "runtime_args.max_staleness=1"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def command(out):
    return [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *RUN,
            f"runtime_args.eval_data_path={small_eval_set(os.path.dirname(out))}", f"runtime_args.output_dir={out}"]


def finish(out):
    return finish_run(command(out), env=ENV)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_stale_rollouts_stay_within_the_bound_and_resume_exactly(tmp_path):
    whole = tmp_path / "whole"
    stdout = finish(whole)
    assert "overlap: max_staleness 1" in stdout and "rollout correction: decoupled" in stdout
    trained = [r for r in metric_rows(whole) if r["episode"] > 0]
    assert [r["episode"] for r in trained] == [1, 2, 3, 4]
    for r in trained:
        e = r["episode"]
        # the trainer is at version e - 1; episode e's samples come from version e - 2 (the first two: 0)
        assert r["train/policy_version"] == max(0, e - 2)
        assert r["train/staleness_max"] == r["train/staleness_mean"] == min(1, e - 1) <= 1
        assert "train/is_masked_frac" in r  # decoupled correction in the loss
        assert r["time/overlapped"] >= 0 and r["time/rollout_wait"] >= 0

    # as killed once episode 2 was logged and checkpointed, in the middle of episode 3's save (shared_runs.rewound_copy):
    # checkpoint 2 holds episode 3's rollout, generated ahead, as arrays (no pickle); the rerun resumes from it
    cut = rewound_copy(whole, tmp_path / "cut", 2)
    assert (cut / "checkpoints" / "episode_000002" / "rollouts_ahead.npz").exists()
    stdout = finish(cut)
    assert "resuming from" in stdout and "(episode 2)" in stdout
    assert learning_metrics(cut) == learning_metrics(whole)
