"""bench/overlap.py's summary (no run started): medians, the ratio and the eval difference; the
recorded result holds no absolute path."""
from __future__ import annotations

import json
import os
import sys

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import overlap  # noqa: E402


def test_summary_of_interleaved_runs():
    runs = [{"max_staleness": 0, "samples_per_s": 100.0, "eval_reward_mean": 0.30},
            {"max_staleness": 1, "samples_per_s": 120.0, "eval_reward_mean": 0.31},
            {"max_staleness": 0, "samples_per_s": 110.0, "eval_reward_mean": 0.30},
            {"max_staleness": 1, "samples_per_s": 130.0, "eval_reward_mean": 0.31}]
    s = overlap.summarize(runs)
    assert s["on_policy_samples_per_s_median"] == 105.0 and s["stale1_samples_per_s_median"] == 125.0
    assert s["speedup_stale1_over_on_policy"] == round(125 / 105, 3)
    assert s["eval_difference_stale1_minus_on_policy"] == 0.01


def test_recorded_result_has_relative_paths_only():
    path = os.path.join(REPO, "bench", "results", "overlap.json")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    result = json.loads(text)
    assert REPO not in text and "/tmp" not in text
    assert [r["max_staleness"] for r in result["runs"]] == [0, 1] * (len(result["runs"]) // 2)
    assert all(r["staleness_max"] <= r["max_staleness"] for r in result["runs"])
