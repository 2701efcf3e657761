"""End to end: ``chatlearn run`` with a Hub model id and a Hub dataset id, both from a Hugging Face
cache built offline (HF_HOME=<tmp>, HF_HUB_OFFLINE=1), as a user with a downloaded model and dataset."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO
from hub_cache import add_dataset, add_model, commit_of, gsm_rows

SHORT = ["runtime_args.num_episode=2", "runtime_args.sample_per_episode=64", "runtime_args.train_global_batch_size=32",
         "runtime_args.train_micro_batch_size=16", "models.policy.num_inference_per_prompt=4",
         "runtime_args.eval_episode_interval=2", "runtime_args.save_episode_interval=2",
         "models.policy.eval_num_inference_per_prompt=1", "runtime_args.rollout_backend=hf"]
HUB = ["models.policy_trainer.load=acme/tiny-chat", "runtime_args.data_path=acme/gsm-tiny",
       "runtime_args.eval_data_path=acme/gsm-tiny", "runtime_args.data_subset=main",
       "runtime_args.prompt_key=question", "runtime_args.ground_truth_key=answer",
       "runtime_args.ground_truth_pattern='####\\s*(-?[0-9.,]+)'",
       "runtime_args.prompt_instruction='Answer within \\boxed{}.'"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hub_model_and_dataset_train_offline(tmp_path, tiny_model_dir):
    home = tmp_path / "hf"
    snap = add_model(str(home / "hub"), "acme/tiny-chat", tiny_model_dir)
    add_dataset(str(home / "hub"), "acme/gsm-tiny", {"main": {"train": gsm_rows(64), "test": gsm_rows(16, 100)}})
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HF_DATASETS_CACHE", None)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *SHORT, *HUB,
           f"runtime_args.output_dir={out}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=580, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["episode"] for r in rows] == [0, 1, 2] and "eval/reward_mean" in rows[0]
    assert all("train/loss" in r for r in rows[1:])
    # config.yaml records where the model and the data came from, pinned to their commits
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["models"]["policy"]["load"] == snap
    assert cfg["models"]["policy_trainer"]["hub_id"] == f"acme/tiny-chat@{commit_of('acme/tiny-chat')}"
    assert cfg["runtime_args"]["data_path"] == f"acme/gsm-tiny@{commit_of('acme/gsm-tiny')}"
    # the prompts were tokenized into the datasets cache under HF_HOME
    assert os.listdir(home / "datasets" / "chatlearn_prompts")

    # an id the cache does not hold: one paragraph, exit 2, before anything starts
    proc = subprocess.run([*cmd[:-1], f"runtime_args.output_dir={tmp_path / 'out2'}",
                           "models.policy_trainer.load=acme/elsewhere"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "hf download acme/elsewhere" in " ".join(proc.stderr.split())
