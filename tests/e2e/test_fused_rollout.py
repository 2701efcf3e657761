"""runtime_args.fuse_rollout: the rollout replicas in the policy trainer's processes train exactly as
separate rollout processes do (vLLM's CPU build, two trainer ranks: each process holds a rank and an
engine, and the in-process push broadcasts rank 0's buckets), with one process per device. (The
transformers engine, fused by default, is compared with separate processes by
tests/e2e/test_placement.py: the colocated run against the partial and disaggregated ones.)"""
from __future__ import annotations

import subprocess
import sys

import pytest
from runs import learning_metrics, metric_rows

from conftest import REPO

SHORT = ["runtime_args.num_episode=2", "runtime_args.sample_per_episode=32", "runtime_args.train_global_batch_size=16",
         "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
         "runtime_args.enable_eval_before_training=False", "runtime_args.eval_episode_interval=0",
         "runtime_args.save_episode_interval=0", "models.policy_trainer.save_hf=false"]


def run(out, *overrides) -> str:
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *SHORT, *overrides,
           f"runtime_args.output_dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend, gpus", [("vllm", 2)])
def test_a_fused_rollout_trains_exactly_as_separate_processes(tmp_path, backend, gpus):
    over = [f"runtime_args.rollout_backend={backend}", f"models.policy_trainer.num_gpu={gpus}"]
    fused = run(tmp_path / "fused", *over)
    assert "in the processes of policy_trainer (fused" in fused
    apart = run(tmp_path / "apart", *over, "runtime_args.fuse_rollout=false")
    assert "in the processes of policy_trainer" not in apart
    assert learning_metrics(tmp_path / "fused") == learning_metrics(tmp_path / "apart")
    rows = {name: metric_rows(tmp_path / name)[-1] for name in ("fused", "apart")}
    # one process holds both: the same peak; apart, the rollout's process has its own
    assert rows["fused"]["memory/policy_peak_mb"] == rows["fused"]["memory/policy_trainer_peak_mb"]
    assert rows["apart"]["memory/policy_peak_mb"] != rows["apart"]["memory/policy_trainer_peak_mb"]
    assert rows["fused"]["sync/bytes"] == rows["apart"]["sync/bytes"] > 0
