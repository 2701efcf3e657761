"""End to end: ``chatlearn run`` on the embedded default, shortened, for each rollout backend (the suite's
shared runs ``short_vllm`` and ``short_hf``: tests/support/shared_runs.py; other tests read the same runs)."""
from __future__ import annotations

import json
import os

import pytest
from shared_runs import finished


def check_console(stdout: str, stderr: str, out, backend: str) -> None:
    """A quiet, informative console (the mechanisms, --verbose included: tests/logging/test_console.py):
    third-party output is in <out>/logs/, not repeated on the console; the plain episode lines estimate
    the time left; the run ends with its summary; every metrics row has its wall-clock time."""
    import re

    lines = (stdout + stderr).splitlines()
    others = [re.sub(r"\d+", "N", ln) for ln in lines
              if ln.strip() and not ln.startswith(("[chatlearn] ", "episode "))]
    assert len(others) == len(set(others)), others
    assert not [ln for ln in others if "vllm" in ln.lower() or "warning" in ln.lower()], others
    assert not [ln for ln in lines if "Failed to load weights" in ln], lines
    episodes = [ln for ln in stdout.splitlines() if ln.startswith("episode")]
    assert ", eta " in episodes[1] and ", eta " in episodes[2] and "eta" not in episodes[3], episodes
    tail = stdout.splitlines()[-4:]
    assert tail[0].startswith("[chatlearn] done: episodes 1..3 in "), tail
    assert re.match(r"\[chatlearn\] eval reward: first [\d.]+ \(episode 0\), last [\d.]+ \(episode 3\), best "
                    r"[\d.]+ \(episode [023]\)$", tail[1]), tail
    assert tail[2].startswith("[chatlearn] time: generate ") and "train " in tail[2] and "eval " in tail[2], tail
    for where in ("metrics.jsonl", "checkpoints", "plots", "samples.jsonl", "logs"):
        assert f" {out / where}" in tail[3], tail
    logs = {p.name: p.read_text(errors="replace") for p in (out / "logs").iterdir()}
    assert "driver.log" in logs and any(name.startswith("worker-") for name in logs), logs.keys()
    if backend == "vllm":
        assert any("WARNING" in text and "vllm" in text.lower() for text in logs.values()), logs
    walls = [r["time/wall"] for r in read_jsonl(out / "metrics.jsonl")]
    assert walls == sorted(walls) and walls[0] > 1.6e9


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_short_run(backend):
    run = finished(f"short_{backend}").check()
    out = run.out
    # one progress line per episode (and one for the eval before training)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("episode")]
    assert len(lines) == 4, run.stdout
    assert "eval" in lines[0] and "reward" in lines[1]
    check_console(run.stdout, run.stderr, out, backend)
    assert run.left_temp_files == []  # vLLM's rendezvous files removed at the end of the run

    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["episode"] for r in rows] == [0, 1, 2, 3]
    assert "eval/reward_mean" in rows[0] and "eval/reward_mean" in rows[2] and "eval/reward_mean" in rows[3]
    for r in rows[1:]:
        for key in ("train/reward_mean", "train/loss", "train/grad_norm", "train/kl", "time/generate",
                    "time/train", "time/weight_push", "sched/transitions"):
            assert key in r, key
        # rollout engine and trainer agree on the log-probs of the sampled tokens: in episode 1 on the
        # initial weights, afterwards on the weights pushed at the end of the previous episode
        assert r["train/logprob_diff_rollout_vs_trainer_max"] < 1e-4, r
        # every push landed (chatlearn/runtime/driver/landing.py): the probe's gap, far within float32's 0.01
        assert r["sync/landing_gap_max"] < 1e-4 and r["perf/weight_push_check_s"] > 0, r
    assert rows[2]["train/kl"] > 0  # the policy moved away from the reference

    # log_samples_interval=2: five decoded samples of episode 2, one per prompt (16 prompts of 4 responses)
    samples = read_jsonl(out / "samples.jsonl")
    assert [s["episode"] for s in samples] == [2] * 5 and [s["sample"] for s in samples] == [0, 4, 8, 12, 16]
    for s in samples:
        assert "What is" in s["prompt"] and isinstance(s["response"], str) and s["response_tokens"] >= 1
        assert 0.0 <= s["reward"] <= 1.0 and s["data_source"] == "arith" and s["ground_truth"].isdigit()
        a, b = (int(x) for x in s["prompt"].split("What is ")[1].split("?")[0].split(" + "))
        assert int(s["ground_truth"]) == a + b, s  # each row's ground truth is its own prompt's

    # checkpoints at save_episode_interval and at the end, with an HF folder transformers loads
    ckpts = sorted(p for p in os.listdir(out / "checkpoints") if p.startswith("episode_"))
    assert ckpts == ["episode_000002", "episode_000003"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "episode_000003"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "episode_000003" / "hf")
    AutoTokenizer.from_pretrained(out / "checkpoints" / "episode_000003" / "hf")

    if backend == "hf":  # no GPU and runtime_args.offload_without_gpu off: the colocated models keep their parts
        assert all(r["sched/transitions"] == 0 for r in rows[1:]) and "no GPU: colocated models keep" in run.stdout
        return
    # runtime_args.offload_without_gpu: the parts move between turns as on GPUs; every transition is
    # recorded, and on the shared device only one model computes at a time
    events = read_jsonl(out / "timeline.jsonl")
    transitions = [e for e in events if e["kind"] == "transition"]
    assert transitions and all(e["seconds"] >= 0 and e["parts"] for e in transitions)
    for e in events:
        if e["kind"] == "stage" and e["model"] != "reward" and e["stage"] != "weight_push":
            others = [m for m, parts in e["resident"].items() if m != e["model"] and
                      set(parts) & {"weights", "optimizer", "kv_cache"}]
            assert not others, e
