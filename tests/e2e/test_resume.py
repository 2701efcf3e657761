"""Exact resume: SIGKILL during a checkpoint save, rerun, same metrics (a kill during an episode:
tests/reliability/test_reliability_e2e.py::test_kill_after_a_checkpoint_torn_rows_then_resume).

The run is a multi-turn one (an environment from a file answers every model turn, its reward added
to the math reward) with a KL term, distilled from a teacher (algorithm: opd, a model of kind teacher taking
turns with the others; it scores the model's tokens only): the most state a resumed run must restore exactly,
and a model that holds none but whose log-probs enter every update. Single-turn
runs are resumed by the end-to-end tests of reliability, max_staleness, dynamic sampling and Megatron."""
from __future__ import annotations

import os
import sys

import pytest
import runs


RUN = ["runtime_args.num_episode=3", "runtime_args.keep_last_checkpoints=2", "runtime_args.sample_per_episode=32",
       "runtime_args.train_global_batch_size=16",
       "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
       "runtime_args.eval_episode_interval=2", "models.policy.eval_num_inference_per_prompt=1",
       "runtime_args.save_episode_interval=1", "runtime_args.rollout_backend=hf", "models.policy_trainer.kl_coef=0.01",
       "models.policy.max_response_tokens_length=64",
       "models.policy.multi_turn.environment=tests/support/multiturn_envs.py:CountdownEnv",
       "models.policy.multi_turn.environment_kwargs={turns: 2}", "models.policy.multi_turn.max_turn_tokens=12",
       "models.reward.functions=[{name: math, path: 'builtin:math'}]",
       "models.policy_trainer.algorithm=opd", "models.teacher.kind=teacher", "models.teacher.load=assets/tiny_qwen2_teacher",
       "runtime_args.colocation=[policy,policy_trainer,ref_policy,teacher]"]


def command(out):
    return [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *RUN,
            f"runtime_args.eval_data_path={runs.small_eval_set(os.path.dirname(out))}", f"runtime_args.output_dir={out}"]


def run_and_kill(out, when, env=None):
    """Start a run, SIGKILL it once ``when()`` is true, and wait for it to die."""
    runs.run_and_kill(command(out), when, env)


def finish(out):
    return runs.finish(command(out))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_sigkill_during_a_save_resumes_exactly(tmp_path):
    ref = tmp_path / "uninterrupted"
    finish(ref)
    expected = runs.learning_metrics(ref)
    assert [r["episode"] for r in expected] == [0, 1, 2, 3]
    assert all(r["train/env/turns_mean"] > 1 for r in expected[1:])  # really multi-turn
    assert all(r["train/distill/reverse_kl"] != 0 for r in expected[1:])  # really distilled (a teacher's log-probs)

    # killed in the middle of writing checkpoint 2 (episode 2 trained): checkpoint 1 stays usable, and the
    # rerun trains episodes 2 and 3 again exactly
    out = tmp_path / "killed_in_save"
    tmp_ckpt = out / "checkpoints" / "episode_000002.tmp"
    run_and_kill(out, lambda: (tmp_ckpt / "trainer").exists(), env={"CHATLEARN_CHECKPOINT_TEST_DELAY": "5@2"})
    ckpts = out / "checkpoints"
    assert tmp_ckpt.exists() and not (ckpts / "episode_000002").exists()
    assert (ckpts / "latest").read_text().strip() == "episode_000001"
    assert (ckpts / "episode_000001" / "COMPLETE").exists()
    stdout = finish(out)
    assert "episode 1)" in stdout
    assert runs.learning_metrics(out) == expected
    assert not tmp_ckpt.exists()
    kept = sorted(p.name for p in ckpts.iterdir() if p.name.startswith("episode_"))
    assert kept == ["episode_000002", "episode_000003"]  # keep_last_checkpoints=2
