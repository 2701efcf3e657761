"""``chatlearn eval``: one JSONL line per sample, rewards consistent with the aggregate metrics."""
from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from chatlearn.runtime.driver.evaluate import pass_at_k
from conftest import REPO


def test_pass_at_k_reference():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 4) == 1.0


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_eval_only(backend, tmp_path):
    k = 2
    cmd = [sys.executable, "-m", "chatlearn.cli", "eval", "template/grpo_fsdp.yaml", f"runtime_args.output_dir={tmp_path}",
           f"runtime_args.rollout_backend={backend}", f"models.policy.eval_num_inference_per_prompt={k}",
           "--checkpoint", "assets/tiny_qwen2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "eval all: reward" in proc.stdout
    samples = [json.loads(line) for line in open(tmp_path / "eval" / "samples.jsonl", encoding="utf-8")]
    assert len(samples) == 200 * k
    for s in samples:
        assert set(s) >= {"prompt", "response", "reward", "ground_truth", "data_source"}
        assert s["reward"] in (0.0, 1.0)
    metrics = json.load(open(tmp_path / "eval" / "metrics.json", encoding="utf-8"))["metrics"]
    by_prompt = defaultdict(list)
    for i, s in enumerate(samples):
        by_prompt[i // k].append(s["reward"])
    mean = sum(s["reward"] for s in samples) / len(samples)
    assert metrics["all"]["reward_mean"] == pytest.approx(mean)
    assert metrics["arith"]["reward_mean"] == pytest.approx(mean)
    assert metrics["all"]["pass@1"] == pytest.approx(mean)
    assert metrics["all"][f"pass@{k}"] == pytest.approx(sum(max(v) for v in by_prompt.values()) / len(by_prompt))
    assert metrics["all"]["num_prompts"] == 200
