"""algorithm: gkd end to end: a multi-turn run (an environment from a file answers every model turn) whose
student trains LoRA adapters on the generalized JSD to a teacher's top-k, killed by SIGKILL after its first
checkpoint and rerun: the same metrics as the uninterrupted run, episode for episode (exact resume), the loss
really the divergence to the teacher (train/gkd_jsd > 0) and the adapters really learning."""
from __future__ import annotations

import os
import subprocess
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
    proc = subprocess.run(command(out), cwd=REPO, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


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
