"""End to end: ``chatlearn run template/grpo_moe_megatron.yaml`` (the MoE toy on the Megatron trainer with
expert parallelism 2, the hf rollout) for one short episode on a machine without a GPU, with routing replay
off and on: the experts' weights reach the rollout (the weight push of the fused expert tensors), the MoE
metrics are logged, and a checkpoint merges into a folder transformers loads.

As in test_megatron_e2e.py, the trainer actors run under the test-only CPU device shim
(``tests/support/megatron_cpu_site``, ``CHATLEARN_TEST_MEGATRON_CPU_SHIM=1``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytest.importorskip("megatron.core", reason="megatron-core is not installed "
                    "(pip install -e '.[megatron]' -c requirements/constraints-cpu.txt)")

TEMPLATE = "template/grpo_moe_megatron.yaml"
ASSET = os.path.join(REPO, "assets", "tiny_qwen3_moe")
SHORT = ["runtime_args.sample_per_episode=32", "runtime_args.train_global_batch_size=16",
         "runtime_args.train_micro_batch_size=8", "models.policy.num_inference_per_prompt=4",
         "runtime_args.eval_episode_interval=0", "runtime_args.enable_eval_before_training=False",
         "runtime_args.num_episode=1", "runtime_args.save_episode_interval=1"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.path.isdir(ASSET), reason="the MoE toy assets/tiny_qwen3_moe is not built "
                    "(python tools/build_default_assets.py)")
@pytest.mark.parametrize("replay", ["off", "rollout"])
def test_one_episode_of_the_moe_template_with_expert_parallelism(tmp_path, replay):
    if replay == "rollout" and importlib.util.find_spec("chatlearn.models.moe") is None:
        pytest.skip("routing replay's rollout capture (chatlearn.models.moe) is not in this build")
    out = tmp_path / "out"
    site = os.path.join(REPO, "tests", "support", "megatron_cpu_site")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CHATLEARN_TEST_MEGATRON_CPU_SHIM": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", TEMPLATE, *SHORT, f"runtime_args.output_dir={out}",
           f"models.policy_trainer.routing_replay={replay}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=500, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        row = [json.loads(line) for line in f if line.strip()][-1]
    for key in ("train/loss", "train/grad_norm", "time/weight_push", "train/moe/load_imbalance"):
        assert key in row, key
    assert ("train/moe/routing_agreement" in row) == (replay == "rollout")

    from chatlearn.checkpoint.merge import merge_checkpoint

    from transformers import AutoModelForCausalLM

    episode = out / "checkpoints" / "episode_000001"
    merged = str(tmp_path / "merged")
    merge_checkpoint(str(episode), merged)  # the EP-sharded trainer checkpoint (its trainer/ folder)
    for folder in (merged, str(episode / "hf")):  # and the trainer's own save_hf
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert model.config.num_experts == 8 and model.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 128, 128)
