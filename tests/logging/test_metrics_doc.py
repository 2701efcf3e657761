"""docs/metrics.md documents the metrics the engine computes (a run's full set: test_monitoring_run.py)."""
from __future__ import annotations

import numpy as np

from chatlearn.logging.perf import throughput
from chatlearn.logging.plots import PANELS, STAGES
from chatlearn.runtime.driver.observe import rollout_metrics
from metrics_doc import documented_patterns, undocumented

# what the trainers return from one optimizer step (FSDPTrainer.train; the Megatron trainer matches)
TRAINER_KEYS = ("loss", "policy_loss", "kl", "entropy", "clip_frac", "num_tokens", "grad_norm", "lr")


def fake_batch():
    return {"offsets": np.array([0, 5, 9]), "prompt_lens": np.array([3, 2]), "finish_reasons": np.array([1, 0])}


def test_docs_have_a_table_row_per_metric_family():
    names = documented_patterns()
    assert len(names) >= 30
    for prefix in ("train/", "eval/", "time/", "sched/", "perf/", "memory/"):
        assert any(n.startswith(prefix) for n in names), prefix


def test_engine_metrics_are_documented():
    keys = [f"train/{k}" for k in TRAINER_KEYS]
    keys += list(rollout_metrics(fake_batch(), np.array([1.0, 0.0]), prefix="train"))
    keys += list(rollout_metrics(fake_batch(), np.array([1.0, 0.0]), prefix="eval"))
    keys += ["eval/gsm8k/reward_mean", "eval/math-500/reward_mean",
             "train/logprob_diff_rollout_vs_trainer_mean", "train/logprob_diff_rollout_vs_trainer_max"]
    keys += [f"time/{s}" for s in STAGES] + ["time/transitions", "time/episode", "sched/transitions",
                                            "sched/bytes_moved"]
    keys += list(throughput(fake_batch(), {"time/generate": 1.0, "time/train": 2.0}, epochs=1))
    keys += [f"memory/{m}_peak_mb" for m in ("policy", "policy_trainer", "ref_policy", "reward")]
    assert not undocumented(keys)
    # and the plots draw documented metrics only
    assert not undocumented([k.replace("<model>", "policy").replace("<data_source>", "x")
                             for p in PANELS for k in p.keys])
