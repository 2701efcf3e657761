"""PPO end to end: six models taking turns on one device group (the policy's rollout engine, the policy
trainer, the critic, the reference and two reward models: ``models.reward.load``'s and ``rm_style``, a
model of kind reward_model of the user's naming, both beside the reward function; with
``runtime_args.offload_without_gpu`` so that their parts move as on GPUs): every model's turns in the
timeline with the residency invariant after each, the critic's warm-up, its metrics and each reward
model's; a copy of the run as a SIGKILL while the critic's checkpoint is written leaves it, then an exact
resume; ``chatlearn merge`` of the critic. PPO on the Megatron trainers: tests/e2e/test_megatron_e2e.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import runs
from shared_runs import rewound_copy
from test_placement import read_jsonl

from conftest import REPO
from chatlearn.runtime.driver.scheduler import residency_violations

SIX = ["policy", "policy_trainer", "critic", "ref_policy", "reward_model", "rm_style"]
RUN = ["runtime_args.num_episode=2", "runtime_args.sample_per_episode=32", "runtime_args.train_global_batch_size=16",
       "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
       "runtime_args.eval_episode_interval=2", "models.policy.eval_num_inference_per_prompt=1",
       "runtime_args.save_episode_interval=1", "models.policy_trainer.save_hf=false",
       "models.policy_trainer.kl_coef=0.01", "models.policy_trainer.kl_in_reward=true",
       "models.critic.warmup_episodes=1", "runtime_args.rollout_backend=hf",
       "runtime_args.colocation=[policy,policy_trainer,critic,ref_policy,reward,rm_style]",
       "models.reward.load=assets/tiny_rm", "models.reward.num_gpu=1", "models.reward.model_weight=0.5",
       # a second reward model, of the user's naming: whitened over the batch, a quarter of its score
       "models.rm_style.kind=reward_model", "models.rm_style.load=assets/tiny_rm", "models.rm_style.weight=0.25",
       "models.rm_style.normalize=batch", "runtime_args.offload_without_gpu=true"]


def command(out, *extra):
    return [sys.executable, "-m", "chatlearn.cli", "run", "template/ppo_fsdp.yaml", *RUN,
            f"runtime_args.eval_data_path={runs.small_eval_set(os.path.dirname(out))}",
            f"runtime_args.output_dir={out}", *extra]


def finish(out, *extra):
    proc = subprocess.run(command(out, *extra), cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_six_models_take_turns_and_resume_exactly(tmp_path):
    ref = tmp_path / "uninterrupted"
    stdout = finish(ref)
    assert "device group 0 (device 0): policy, policy_trainer, critic, ref_policy, reward_model, rm_style" in stdout
    events = read_jsonl(ref / "timeline.jsonl")
    rows = runs.metric_rows(ref)
    for e in events:  # the invariant after every transition and during every stage
        assert not residency_violations([SIX], e["resident"]), e

    def stages(episode):
        return [(e["model"], e["stage"]) for e in events if e["kind"] == "stage" and e["episode"] == episode]

    # a steady episode: every model's turn, in the order of the schedule
    assert [s for s in stages(2) if s[1] not in ("reward", "eval")] == [
        ("policy", "generate"), ("reward_model", "reward_model"), ("rm_style", "reward_model"),
        ("ref_policy", "ref_logprobs"),
        ("policy_trainer", "old_logprobs"), ("critic", "values"), ("critic", "train"), ("policy_trainer", "train"),
        ("policy_trainer", "checkpoint"), ("policy", "weight_push")]
    onloads = {e["model"] for e in events
               if e["kind"] == "transition" and e["episode"] == 2 and e["action"] == "onload"}
    assert onloads == set(SIX)
    # the critic's warm-up (episode 1): it trains alone, the policy's weights stay and are not pushed
    assert ("policy_trainer", "train") not in stages(1) and ("critic", "train") in stages(1)
    assert ("policy", "weight_push") not in stages(1)
    assert "train/loss" not in rows[1] and "train/critic/value_loss" in rows[1]
    for r in rows[2:]:
        assert r["train/loss"] == r["train/loss"] and r["train/critic/value_loss"] > 0  # a number
        for key in ("train/critic/explained_variance", "train/critic/value_clip_frac", "train/critic/grad_norm",
                    "train/reward_model/score_mean", "train/reward_model/score_std", "train/kl_in_reward_penalty",
                    "train/reward_model/rm_style/score_mean", "train/reward_model/rm_style/score_std",
                    "time/reward_model", "time/values"):
            assert key in r, key
    # each reward model's share of the reward: model_weight x its score; rm_style's whitened over the episode's
    # samples, so its mean share is 0 whatever its scores, and the total is the functions' plus both shares
    for r in rows[1:]:
        assert abs(r["train/reward_model/reward_mean"] - 0.5 * r["train/reward_model/score_mean"]) < 1e-6
        assert abs(r["train/reward_model/rm_style/reward_mean"]) < 1e-6 < r["train/reward_model/rm_style/score_std"]
        assert abs(r["train/reward_mean"] - r["train/reward/math/score"] - r["train/reward_model/reward_mean"]) < 1e-5
    for r in rows[2:]:  # the evaluation scores with both (raw scores: no whitening)
        assert abs(r["eval/reward_model/rm_style/reward_mean"] - 0.25 * r["eval/reward_model/rm_style/score_mean"]) < 1e-6
    assert [e["model"] for e in events if e["kind"] == "stage" and e["stage"] == "reward_model"
            and e["episode"] == 1] == ["reward_model", "rm_style"]
    expected = runs.learning_metrics(ref)
    assert [r["episode"] for r in expected] == [0, 1, 2]

    # as killed while checkpoint 2 was written (shared_runs.rewound_copy: its .tmp folder with the critic's folder in
    # it; a real SIGKILL in the middle of a save: tests/e2e/test_resume.py): checkpoint 1 stays the latest, and
    # the rerun trains episode 2 again exactly (the critic and its optimizer state included)
    out = rewound_copy(ref, tmp_path / "killed", 1)
    assert (out / "checkpoints" / "episode_000002.tmp" / "critic").is_dir()
    assert "episode 1)" in finish(out)
    assert runs.learning_metrics(out) == expected
    assert not (out / "checkpoints" / "episode_000002.tmp").exists()

    # the critic as a Hugging Face folder (a token-classification model with one label)
    merged = tmp_path / "critic_hf"
    proc = subprocess.run([sys.executable, "-m", "chatlearn.cli", "merge",
                           str(ref / "checkpoints" / "episode_000002" / "critic"), str(merged)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from transformers import AutoModelForTokenClassification

    critic = AutoModelForTokenClassification.from_pretrained(merged)
    assert critic.config.num_labels == 1 and critic.score.weight.shape[0] == 1

