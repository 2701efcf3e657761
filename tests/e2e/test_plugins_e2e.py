"""End to end: a run trains with an advantage estimator and a policy loss of the user's own, from a module outside
the package named in runtime_args.plugins (tests/support/plugins/range_rl.py, the example of docs/architecture.md,
"Plugins"). The plugin leaves a trace of every call: the estimator ran in the driver once per episode, the loss
in the trainer on exactly the advantages the estimator returned."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO

SHORT = ["runtime_args.num_episode=2", "runtime_args.sample_per_episode=16", "runtime_args.train_global_batch_size=16",
         "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
         "runtime_args.eval_episode_interval=0", "runtime_args.enable_eval_before_training=False",
         "runtime_args.rollout_backend=hf"]
PLUGIN = ["runtime_args.plugins=[tests/support/plugins/range_rl.py]",
          "models.policy_trainer.advantage_estimator=group_range", "models.policy_trainer.policy_loss=unclipped",
          "models.reward.functions=[{name: position, path: 'tests/support/plugins/position_reward.py:position_mod_3'}]"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_trains_with_a_plugged_estimator_and_policy_loss(tmp_path):
    trace = tmp_path / "trace.jsonl"
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *SHORT, *PLUGIN,
           f"runtime_args.output_dir={tmp_path / 'out'}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "CHATLEARN_PROBE_LOG": str(trace)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(tmp_path / "out" / "metrics.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["episode"] for r in rows if "train/loss" in r] == [1, 2]
    calls = [json.loads(line) for line in trace.read_text().splitlines()]
    estimated = [c for c in calls if c["what"] == "advantages"]
    losses = [c for c in calls if c["what"] == "loss"]
    assert len(estimated) == 2 and losses, calls  # once per episode; the loss on every micro-batch
    for episode in estimated:
        adv = np.asarray(episode["values"])
        assert adv.shape == (16,) and np.all(np.abs(adv) <= 1) and np.any(adv != 0)  # (r - mean) / range
    # the loss saw the estimator's advantages (as float32), and only them
    given = {float(np.float32(a)) for e in estimated for a in e["values"]}
    seen = {a for c in losses for a in c["values"]}
    assert seen <= given and len(seen) > 1, (seen, given)
    # single process (the default here): the trainer is in the driver's process
    assert {c["pid"] for c in calls} == {estimated[0]["pid"]}
