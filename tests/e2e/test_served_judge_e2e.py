"""End to end with a served judge: template/grpo_judge.yaml with its judge served over HTTP by a server process on
127.0.0.1 (tests/support/openai_server.py, the tiny judge): the run survives the server being killed and restarted
mid-run, ``chatlearn eval`` scores with it, and a run whose server stays down stops with one paragraph."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO
from openai_server import free_port, spawn

SHORT = ["runtime_args.sample_per_episode=32", "runtime_args.train_global_batch_size=32",
         "runtime_args.train_micro_batch_size=32", "models.policy.num_inference_per_prompt=4",
         "runtime_args.enable_eval_before_training=False", "models.policy.eval_num_inference_per_prompt=1",
         "runtime_args.save_episode_interval=0", "runtime_args.colocation=[policy,policy_trainer,ref_policy]"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": REPO}


def serve(port: int) -> subprocess.Popen:
    """The tiny judge served on 127.0.0.1:``port`` by a process of its own, once it answers."""
    return spawn(os.path.join(REPO, "assets", "tiny_judge"), port, env=ENV, wait_s=60)


def served(port: int, down_timeout_s: float) -> list[str]:
    return [f"models.judge.endpoint=http://127.0.0.1:{port}/v1", "models.judge.max_concurrency=4",
            f"models.judge.down_timeout_s={down_timeout_s}", "models.judge.retry_backoff_s=0.2",
            "models.judge.retry_backoff_max_s=1"]


def _rows(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_served_judge_run_survives_a_server_restart_and_scores_in_eval(tmp_path):
    port, out = free_port(), tmp_path / "out"
    server = serve(port)
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_judge.yaml", *SHORT, *served(port, 120),
           "runtime_args.num_episode=3", "runtime_args.eval_episode_interval=3", f"runtime_args.output_dir={out}"]
    run = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(run.stdout), daemon=True)
    reader.start()
    try:
        while not _rows(out / "metrics.jsonl") and run.poll() is None:  # episode 1 done
            time.sleep(0.2)
        server.send_signal(signal.SIGKILL)
        server.wait()
        while not any("retrying for up to 120 s" in line for line in lines) and run.poll() is None:
            time.sleep(0.2)  # episode 2's judge finds the server down: its requests fail and are retried
        time.sleep(2)
        server = serve(port)
        run.wait(timeout=800)
        reader.join(timeout=10)
    finally:
        run.kill()
    log = "".join(lines)
    assert run.returncode == 0, log[-5000:]
    rows = _rows(out / "metrics.jsonl")
    assert [r["episode"] for r in rows] == [1, 2, 3]
    assert rows[0]["train/judge/judge/retries"] == 0 and rows[1]["train/judge/judge/retries"] > 0
    for r in rows:
        assert r["train/judge/judge/unparsed"] == 0.0
        assert 0.0 <= r["train/judge/judge/score_min"] <= r["train/judge/judge/score_max"] <= 1.0
        assert r["train/reward_mean"] == pytest.approx(r["train/reward/judge/score"], abs=1e-4)  # the rule: weight 0
    assert "eval/reward/judge/score" in rows[-1]
    events = _rows(out / "timeline.jsonl")
    assert any(e["kind"] == "stage" and e["model"] == "judge" and e["stage"] == "judge" for e in events)
    assert not [e for e in events if e.get("model") == "judge" and e["kind"] == "transition"]  # no turns
    try:
        proc = subprocess.run([sys.executable, "-m", "chatlearn.cli", "eval", "template/grpo_judge.yaml",
                               *served(port, 60), f"runtime_args.output_dir={out}", SHORT[-1],
                               "models.policy.eval_num_inference_per_prompt=1", "runtime_args.rollout_backend=hf"],
                              cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    finally:
        server.kill()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    flat = json.loads((out / "eval" / "metrics.json").read_text())["metrics"]["all"]
    assert flat["judge/judge/unparsed"] == 0.0 and 0.0 <= flat["reward/judge/score"] <= 1.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_whose_served_judge_stays_down_stops_with_one_paragraph(tmp_path):
    port, out = free_port(), tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_judge.yaml", *SHORT,
                           *served(port, 2), "runtime_args.num_episode=2", "runtime_args.eval_episode_interval=0",
                           f"runtime_args.output_dir={out}"], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=580)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert "models.judge.endpoint: the served judge 'judge' cannot reach its endpoint" in text
    assert "down_timeout_s 2" in text and "Traceback" not in text
    assert not _rows(out / "metrics.jsonl")
