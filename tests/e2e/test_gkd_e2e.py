"""algorithm: gkd end to end: a multi-turn run (an environment from a file answers every model turn) whose
student trains LoRA adapters on the generalized JSD to a teacher's top-k, killed by SIGKILL after its first
checkpoint and rerun: the same metrics as the uninterrupted run, episode for episode (exact resume), the loss
really the divergence to the teacher (train/gkd_jsd > 0) and the adapters really learning."""
from __future__ import annotations

import os
import sys

import pytest
import runs

from conftest import REPO

RUN = ["runtime_args.num_episode=3", "runtime_args.sample_per_episode=32", "runtime_args.train_global_batch_size=16",
       "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
       "runtime_args.eval_episode_interval=3", "models.policy.eval_num_inference_per_prompt=1",
       "runtime_args.save_episode_interval=1", "models.policy.max_response_tokens_length=64",
       "models.policy.multi_turn.environment=tests/support/multiturn_envs.py:CountdownEnv",
       "models.policy.multi_turn.environment_kwargs={turns: 2}", "models.policy.multi_turn.max_turn_tokens=12",
       "models.policy_trainer.algorithm=gkd", "models.policy_trainer.distill_topk=8",
       "models.policy_trainer.gkd_beta=0.5", "models.policy_trainer.optimizer.lr=1e-3",
       "models.policy_trainer.lora.rank=8", "models.policy_trainer.lora.alpha=16"]


def command(out):
    return [sys.executable, "-m", "chatlearn.cli", "run", "template/distill.yaml", *RUN,
            f"runtime_args.eval_data_path={runs.small_eval_set(os.path.dirname(out))}", f"runtime_args.output_dir={out}"]


def finish(out):
    return runs.finish(command(out))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_gkd_lora_multi_turn_resumes_exactly(tmp_path):
    ref = tmp_path / "uninterrupted"
    finish(ref)
    expected = runs.learning_metrics(ref)
    assert [r["episode"] for r in expected] == [0, 1, 2, 3]
    assert all(r["train/env/turns_mean"] > 1 for r in expected[1:])  # really multi-turn
    assert all(r["train/gkd_jsd"] > 0 and r["train/grad_norm"] > 0 for r in expected[1:])  # the adapters learn

    out = tmp_path / "killed"
    ckpts = out / "checkpoints"
    runs.run_and_kill(command(out), lambda: (ckpts / "episode_000001" / "COMPLETE").exists())
    finish(out)
    assert runs.learning_metrics(out) == expected


# gkd_lambda 0.5 (TRL's lmbda): single-turn, on the arith conversations (each row's last message is the reference
# response); with runtime_args.seed 1234 episode 1 trains on the data's responses, 2 on the student's samples, 3 on
# the data's (chatlearn.algorithms.gkd.on_policy)
MIXED = ["runtime_args.num_episode=3", "runtime_args.sample_per_episode=16", "runtime_args.train_global_batch_size=8",
         "runtime_args.train_micro_batch_size=8", "runtime_args.eval_episode_interval=3",
         "models.policy.eval_num_inference_per_prompt=1", "runtime_args.save_episode_interval=1",
         "runtime_args.data_path=assets/arith_sft/train.jsonl", "runtime_args.prompt_key=messages",
         "models.policy_trainer.gkd_lambda=0.5", "models.policy_trainer.distill_topk=8"]


def mixed_command(out):
    """The run into ``out``; its evaluation set: the first 16 conversations of assets/arith_sft/eval.jsonl (read with
    the same prompt_key, their answers taken off)."""
    evald = os.path.join(os.path.dirname(out), "eval_messages.jsonl")
    with open(os.path.join(REPO, "assets", "arith_sft", "eval.jsonl"), encoding="utf-8") as f:
        rows = f.readlines()[:16]
    with open(evald, "w", encoding="utf-8") as f:
        f.write("".join(rows))
    return [sys.executable, "-m", "chatlearn.cli", "run", "template/distill.yaml", *MIXED,
            f"runtime_args.eval_data_path={evald}", f"runtime_args.output_dir={out}"]


def finish_mixed(out):
    runs.finish(mixed_command(out))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_gkd_lambda_mixes_the_data_responses_and_resumes_exactly(tmp_path):
    ref = tmp_path / "uninterrupted"
    finish_mixed(ref)
    expected = runs.learning_metrics(ref)
    assert [r["train/gkd_offpolicy_frac"] for r in expected[1:]] == [1.0, 0.0, 1.0]
    assert all(r["train/gkd_jsd"] > 0 for r in expected[1:])
    # the data's responses are the right answers: the episodes trained on them are rewarded 1 per sample
    assert [r["train/reward_mean"] == 1.0 for r in expected[1:]] == [True, False, True]

    out = tmp_path / "killed"
    ckpts = out / "checkpoints"
    runs.run_and_kill(mixed_command(out), lambda: (ckpts / "episode_000001" / "COMPLETE").exists())
    finish_mixed(out)
    assert runs.learning_metrics(out) == expected
