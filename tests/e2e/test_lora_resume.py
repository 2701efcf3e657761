"""Exact resume of a LoRA run (models.policy_trainer.lora): SIGKILL during a checkpoint save, rerun with
the same command, the same learning metrics and the same adapters as an uninterrupted run (the
full-weight counterpart: tests/e2e/test_resume.py).

What a LoRA run must restore beyond a full-weight one: the adapters alone on top of the base model read
from ``load`` again, the optimizer state of the adapters only, the random state of the adapters' dropout
(``lora.dropout`` > 0: every training forward draws from it), the reference log-probs given by the trainer
with its adapters disabled (a KL term, no ref_policy), and the merged weights pushed into the rollout
after the resume (episode 2's rollout then samples with episode 1's adapters). Two optimizer steps per
episode, so the resumed Adam moments and step count matter."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import runs

from conftest import REPO

RUN = ["runtime_args.num_episode=2", "runtime_args.sample_per_episode=16", "runtime_args.train_global_batch_size=8",
       "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
       "runtime_args.eval_episode_interval=0", "runtime_args.enable_eval_before_training=false",
       "runtime_args.save_episode_interval=1", "runtime_args.rollout_backend=hf",
       "models.policy_trainer.kl_coef=0.05", "models.policy_trainer.lora.rank=8",
       "models.policy_trainer.lora.alpha=16", "models.policy_trainer.lora.dropout=0.1",
       "models.policy_trainer.optimizer.lr=1e-3"]


def command(out):
    return [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *RUN,
            f"runtime_args.output_dir={out}"]


def finish(out):
    proc = subprocess.run(command(out), cwd=REPO, capture_output=True, text=True, timeout=500,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def checkpoint_tensors(ckpt) -> dict:
    """Every tensor of a checkpoint's ``trainer/`` (the adapters and their optimizer state), flattened."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(ckpt / "trainer"), os.path.join(tmp, "state.pt"))
        state = torch.load(os.path.join(tmp, "state.pt"), weights_only=False)
    flat = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}/{k}", v)
        elif torch.is_tensor(node):
            flat[prefix] = node
    walk("", state)
    return flat


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_lora_sigkill_during_a_save_resumes_exactly(tmp_path):
    ref = tmp_path / "uninterrupted"
    finish(ref)
    expected = runs.learning_metrics(ref)
    assert [r["episode"] for r in expected] == [1, 2]
    assert expected[1]["train/kl"] > 0  # episode 2 samples and trains with episode 1's adapters

    # killed while checkpoint 2 is being written (episode 2 trained and logged): checkpoint 1 stays, the rerun
    # resumes from it and trains episode 2 again
    out = tmp_path / "killed_in_save"
    tmp_ckpt = out / "checkpoints" / "episode_000002.tmp"
    runs.run_and_kill(command(out), lambda: (tmp_ckpt / "trainer").exists(),
                      env={"CHATLEARN_CHECKPOINT_TEST_DELAY": "5@2", "HF_HUB_OFFLINE": "1"})
    assert (out / "checkpoints" / "latest").read_text().strip() == "episode_000001"
    stdout = finish(out)
    assert "(episode 1)" in stdout  # resumed from checkpoint 1
    assert runs.learning_metrics(out) == expected

    # the final adapters (and their optimizer state) are the uninterrupted run's, bit for bit
    final = "checkpoints/episode_000002"
    want, got = checkpoint_tensors(ref / final), checkpoint_tensors(out / final)
    adapters = [k for k in want if k.startswith("/model/")]
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters), sorted(want)[:5]
    assert any(k.startswith("/optimizer/") for k in want)
    assert sorted(got) == sorted(want)
    assert [k for k in want if not bool((want[k] == got[k]).all())] == []
