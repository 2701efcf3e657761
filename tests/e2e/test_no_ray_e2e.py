"""End to end: the default run without Ray (runtime_args.single_process, the default where every model
fits in the driver's process) learns exactly as it does with Ray, and leaves nothing behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

SHORT = ["runtime_args.num_episode=2", "runtime_args.sample_per_episode=32", "runtime_args.train_global_batch_size=16",
         "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
         "runtime_args.eval_episode_interval=2", "models.policy.eval_num_inference_per_prompt=1",
         "models.policy_trainer.kl_coef=0.01", "runtime_args.save_episode_interval=2"]
# what differs between two runs of the same math: times, memory, the bytes pushed (a copy in one process)
VOLATILE = ("time/", "perf/", "memory/", "sync/", "sched/")


def run(out, *over) -> tuple[subprocess.CompletedProcess, list[dict]]:
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *SHORT,
           f"runtime_args.output_dir={out}", *over]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        return proc, [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_default_run_without_ray_equals_the_run_with_ray(tmp_path):
    from chatlearn.runtime.cluster.leftovers import orphaned_processes, temp_files

    before = temp_files()
    alone, rows = run(tmp_path / "alone")
    assert "no Ray (runtime_args.single_process)" in alone.stdout
    start = rows[1]
    assert start["perf/startup/ray_s"] < 0.5 and start["perf/startup/policy_trainer/ray_worker_s"] == 0, start
    # the driver's log, its native output's (the models in it) and the reward worker's
    logs = sorted(p.name for p in (tmp_path / "alone" / "logs").iterdir())
    assert "driver.log" in logs and len([n for n in logs if n.startswith("worker-")]) == 2, logs
    # vLLM's console handler and the libraries' native warnings stay off the console: they are in the logs
    lines = (alone.stdout + alone.stderr).splitlines()
    assert not [ln for ln in lines if not ln.startswith(("[chatlearn] ", "episode "))], lines
    assert temp_files() - before == set() and orphaned_processes() == []

    ray, ray_rows = run(tmp_path / "ray", "runtime_args.single_process=false")
    assert "no Ray" not in ray.stdout and ray_rows[1]["perf/startup/ray_s"] > 0.5
    assert len(rows) == len(ray_rows) == 3
    for a, b in zip(rows, ray_rows):
        learned = {k: v for k, v in a.items() if not k.startswith(VOLATILE)}
        assert learned == {k: v for k, v in b.items() if not k.startswith(VOLATILE)}
        assert "train/kl" not in a or a["episode"] == 0 or a["train/kl"] >= 0
    assert rows[2]["train/kl"] > 0 and "eval/reward_mean" in rows[2]
