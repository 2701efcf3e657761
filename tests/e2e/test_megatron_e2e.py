"""End to end: ``chatlearn run template/ppo_megatron.yaml`` (PPO: the policy trainer and the critic
both on the Megatron trainer; the policy's loss and passes are GRPO's with per-token advantages, so
this covers template/grpo_megatron.yaml's path too) for one episode with tensor parallelism 2, then
a resumed run for a second episode with sequence packing, on a machine without a GPU.

megatron-core calls CUDA directly, so the trainer actors run under the test-only CPU device
shim: the run's environment puts ``tests/support/megatron_cpu_site`` on ``PYTHONPATH`` and
sets ``CHATLEARN_TEST_MEGATRON_CPU_SHIM=1``; its ``sitecustomize`` wraps ``MegatronTrainer``'s
methods in ``megatron_shim.cpu_device_shim`` in every Ray actor that imports the trainer.
The package itself is unchanged.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -e '.[megatron]' -c requirements/constraints-cpu.txt)")

SHORT = ["runtime_args.sample_per_episode=32", "runtime_args.train_global_batch_size=16",
         "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
         "runtime_args.eval_episode_interval=0", "runtime_args.enable_eval_before_training=False",
         "runtime_args.rollout_backend=hf", "models.policy_trainer.kl_coef=0.01",
         "models.policy_trainer.num_gpu=2", "models.policy_trainer.tensor_model_parallel_size=2",
         "models.critic.warmup_episodes=0"]


def run(out, episodes: int, extra: tuple = ()) -> str:
    site = os.path.join(REPO, "tests", "support", "megatron_cpu_site")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CHATLEARN_TEST_MEGATRON_CPU_SHIM": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", "template/ppo_megatron.yaml", *SHORT,
           f"runtime_args.num_episode={episodes}", f"runtime_args.output_dir={out}", *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=280, env=env,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_episode_with_megatron_tp2_then_resume_with_packing(tmp_path):
    out = tmp_path / "out"
    stdout = run(out, episodes=1)
    assert "critic: 2 actor(s) on device group 0" in stdout
    lines = [ln for ln in stdout.splitlines() if ln.startswith("episode")]
    assert len(lines) == 1 and "reward" in lines[0], stdout

    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["episode"] for r in rows] == [1]
    row = rows[0]
    for key in ("train/loss", "train/grad_norm", "train/kl", "train/reward_mean", "time/train",
                "time/weight_push"):
        assert key in row, key
    assert row["train/grad_norm"] > 0 and row["train/kl"] > 0  # two steps: the policy moved
    assert row["train/critic/value_loss"] > 0 and row["train/critic/grad_norm"] > 0  # and the critic learned
    # the Megatron trainer (TP=2) and the rollout engine agree on the sampled tokens' log-probs
    assert row["train/logprob_diff_rollout_vs_trainer_max"] < 1e-4, row

    # the checkpoint of episode 1: the trainer's shards and a Hugging Face folder
    ckpt = out / "checkpoints" / "episode_000001"
    for folder in ("trainer", "critic"):
        assert sorted(p.name for p in (ckpt / folder).glob("rank_*.safetensors")) == [
            "rank_00000.safetensors", "rank_00001.safetensors"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(ckpt / "hf")
    AutoTokenizer.from_pretrained(ckpt / "hf")

    # a second run with one more episode resumes from it (load_checkpoint) and trains on, with sequence
    # packing (TP=2, no sequence parallelism: no padding)
    stdout = run(out, episodes=2, extra=("models.policy_trainer.packing=true",
                                         "models.policy_trainer.max_token_in_packing=256"))
    assert "resuming from" in stdout and "episode 1)" in stdout, stdout
    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["episode"] for r in rows] == [1, 2]
    row = rows[1]
    assert row["train/logprob_diff_rollout_vs_trainer_max"] < 1e-4, row
    assert rows[0]["train/pad_token_frac"] > 0  # padded
    assert row["train/pad_token_frac"] == 0.0 and row["perf/logprob_pad_token_frac"] == 0.0
    assert row["train/micro_steps"] >= 1 and row["train/grad_norm"] > 0
    assert row["train/critic/pad_token_frac"] == 0.0 and row["train/critic/grad_norm"] > 0  # packed too


OPD = ["models.policy_trainer.algorithm=opd", "models.policy.num_inference_per_prompt=8",
       "models.policy_trainer.optimizer.lr=1e-4", "models.policy_trainer.num_gpu=2", "models.teacher.num_gpu=2",
       "runtime_args.num_episode=1", "runtime_args.eval_episode_interval=0",
       "runtime_args.enable_eval_before_training=False", "runtime_args.sample_per_episode=32",
       "runtime_args.train_global_batch_size=32", "runtime_args.train_micro_batch_size=16"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_on_policy_distillation_with_a_megatron_teacher_equals_fsdp(tmp_path):
    """``template/distill.yaml`` with ``algorithm: opd``, the student and the teacher on the Megatron trainer at TP 2
    (under the test shim) and on FSDP2: the same first episode (the same samples from the hf rollout, so the same
    teacher log-probs, argmax agreement, loss and gradient norm)."""
    site = os.path.join(REPO, "tests", "support", "megatron_cpu_site")
    shim = {**os.environ, "HF_HUB_OFFLINE": "1", "CHATLEARN_TEST_MEGATRON_CPU_SHIM": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)}
    megatron = ["runtime_args.train_backend=megatron", "models.policy_trainer.tensor_model_parallel_size=2",
                "models.teacher.tensor_model_parallel_size=2"]
    rows = {}
    for name, extra, env in (("fsdp", [], {**os.environ, "HF_HUB_OFFLINE": "1"}), ("megatron", megatron, shim)):
        out = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "chatlearn.cli", "run", "template/distill.yaml", *OPD, *extra,
                               f"runtime_args.output_dir={out}"], cwd=REPO, capture_output=True, text=True,
                              timeout=280, env=env, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        with open(out / "metrics.jsonl", encoding="utf-8") as f:
            rows[name] = [json.loads(line) for line in f][-1]
    keys = ["train/distill/teacher_logprob", "train/distill/student_logprob", "train/distill/reverse_kl",
            "train/distill/top1_agreement", "train/loss", "train/grad_norm"]
    for key in keys:
        assert rows["megatron"][key] == pytest.approx(rows["fsdp"][key], rel=1e-4, abs=1e-5), key
    assert 0 < rows["megatron"]["train/distill/top1_agreement"] < 1
