"""An episode's checkpoint and its metrics row are one unit: a run SIGKILLed at any point between the
checkpoint's save and the episode's row (after the save, after the weight push, after the evaluation,
after the row itself) leaves no committed checkpoint of an episode without its row, and the rerun
writes every episode's row once, evaluation included (tests/reliability/kill_at_site patches the
driver to kill itself at the point)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from runs import metric_rows, small_eval_set

from conftest import REPO

SITE = os.path.join(REPO, "tests", "reliability", "kill_at_site")
RUN = ["runtime_args.num_episode=2", "runtime_args.sample_per_episode=8", "runtime_args.train_global_batch_size=8",
       "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
       "runtime_args.enable_eval_before_training=False", "runtime_args.eval_episode_interval=1",
       "models.policy.eval_num_inference_per_prompt=1", "runtime_args.save_episode_interval=1",
       "runtime_args.rollout_backend=hf", "models.policy_trainer.save_hf=false"]
POINTS = ("saved", "pushed", "evaluated", "logged")


def committed(out) -> list[int]:
    """The episodes of the committed checkpoints in ``out`` (``episode_N``, complete; not ``episode_N.tmp``)."""
    root = os.path.join(out, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(int(n.split("_")[1]) for n in names
                  if re.fullmatch(r"episode_\d+", n) and os.path.isfile(os.path.join(root, n, "COMPLETE")))


@pytest.mark.slow  # five starts of a 2-episode run
@pytest.mark.timeout(900)
def test_a_kill_between_a_checkpoint_and_its_metrics_row_loses_nothing(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *RUN,
           f"runtime_args.output_dir={out}", f"runtime_args.eval_data_path={small_eval_set(str(tmp_path), 4)}"]
    site = os.pathsep.join(p for p in (SITE, os.environ.get("PYTHONPATH")) if p)
    for point in POINTS:  # the same folder, killed at each point of episode 1's window in turn
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": site, "CHATLEARN_TEST_KILL_AT": f"{point}@1"}
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
                              start_new_session=True)
        assert proc.returncode == -9, (point, proc.returncode, proc.stderr[-3000:])
        logged = [r["episode"] for r in metric_rows(out)]
        for episode in committed(out):  # a committed checkpoint's episode has its row
            assert episode in logged, (point, committed(out), logged)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = metric_rows(out)
    assert [r["episode"] for r in rows] == [1, 2], [r["episode"] for r in rows]
    for row in rows:  # each episode's training and evaluation metrics, once
        assert "train/loss" in row and any(k.startswith("eval/") for k in row), json.dumps(row)[:2000]
    assert committed(out)[-1] == 2
