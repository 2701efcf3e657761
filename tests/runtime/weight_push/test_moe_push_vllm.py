"""Mixture-of-experts end to end, FSDP2 trainer (2 ranks on gloo, Ray) -> vLLM rollout (CPU backend): the
streamed weight push of a Qwen3-MoE's expert tensors (the trainer's fused ``mlp.experts.gate_up_proj`` /
``down_proj``, in ~20 KiB buckets that split every MoE layer) lands, as the run's landing check
(``chatlearn/runtime/driver/landing.py``) sees it before and after a training step; and the trainer's
checkpoint merged by ``chatlearn merge`` is a folder vLLM loads with the trainer's log-probs.
"""
from __future__ import annotations

import os

import backend_specs
import numpy as np
import pytest
from test_fsdp_trainer import add_logprobs, hf_logprobs, make_batch
from tiny_moe_models import make_tiny_moe_model

from chatlearn.errors import UserError
from chatlearn.runtime.driver.landing import LandingCheck
from chatlearn.runtime.weight_push import driver as wp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
TOL = 1e-4
PROBE = list(range(5, 45))


def trainer_spec(path: str):
    return backend_specs.trainer_spec(path, lr=1e-2, weight_decay=0.0, train_micro_batch_size=4,
                                      logprob_micro_batch_size=8, train_global_batch_size=8, share_prompt=None)


def rollout_spec(path: str):
    return backend_specs.rollout_spec(path, generation_batch_size=16, max_prompt_tokens_length=48,
                                      max_response_tokens_length=16, cpu_threads=1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pytest.importorskip("vllm")
    import ray
    from omegaconf import OmegaConf

    from chatlearn.runtime.cluster.group import create_group

    root = tmp_path_factory.mktemp("moe_sync")
    old = make_tiny_moe_model(str(root / "old"), "qwen3_moe", seed=0, moe_intermediate_size=48)
    new = make_tiny_moe_model(str(root / "new"), "qwen3_moe", seed=1, moe_intermediate_size=48)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    common = dict(pg=None, bundles=[], gpu_fraction=0, cpus=0, threads=1)
    groups = {"trainer": create_group("policy_trainer", "chatlearn.models.trainer.fsdp:FSDPTrainer",
                                      trainer_spec(new), num_actors=2, distributed=True, **common),
              "vllm": create_group("policy", "chatlearn.models.rollout.vllm:VLLMRollout", rollout_spec(old),
                                   num_actors=1, distributed=False, **common)}
    cfg = OmegaConf.create({"runtime_args": {"coalesced_buffer_mb": 0.02}})  # ~20 KiB: many buckets
    yield {"groups": groups, "new": new, "cfg": cfg, "root": root}
    ray.shutdown()


def _gap(groups) -> float:
    """max |rollout log-prob - trainer log-prob| over the sampled tokens of a fresh batch."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 290, size=int(rng.integers(3, 10))).tolist() for _ in range(8)]
    batch = groups["vllm"].call("generate", prompts, {"temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                                      "max_tokens": 16, "seed": 5})[0][0]
    logp = groups["trainer"].call("compute_logprobs", batch, 1.0)[0][0]
    off, plen = batch["offsets"], batch["prompt_lens"]
    mask = np.zeros(len(logp), bool)
    for i in range(len(plen)):
        mask[off[i] + plen[i]:off[i + 1]] = True
    return float(np.abs(batch["rollout_logprobs"][mask] - logp[mask]).max())


def test_push_of_expert_weights_lands_before_and_after_a_step(cluster):
    groups = cluster["groups"]
    check = LandingCheck(PROBE, trainer_dp=2, configured=None, model=cluster["new"], backend="vllm")
    expected = check.trainer_side(groups["trainer"])
    with pytest.raises(UserError, match="did not land"):  # the engine still holds the old folder's weights
        check.rollout_side(groups["vllm"], expected, when="before the push")
    sync = wp.WeightPush(groups["trainer"], groups["vllm"], plan=None, cfg=cluster["cfg"], transport="shm")
    sync.push()
    names = {e.name: i for i, b in enumerate(sync.buckets) for e in b.entries}
    gate_up = [n for n in names if n.endswith("mlp.experts.gate_up_proj")]
    assert len(gate_up) == 2 and all(names[n] != names[n.replace("gate_up_proj", "down_proj")] for n in gate_up)
    metrics = check.rollout_side(groups["vllm"], check.trainer_side(groups["trainer"]), when="after the push")
    assert metrics["sync/landing_gap_max"] < TOL
    assert _gap(groups) < TOL
    # one training step moves the experts; the next push follows them
    vocab = 320
    batch = make_batch(vocab, seed=0)
    batch = add_logprobs(batch, hf_logprobs(cluster["new"], batch)[0], seed=1)
    groups["trainer"].call("train", batch, 1.0)
    moved = check.trainer_side(groups["trainer"])
    assert np.abs(moved["logprobs"] - expected["logprobs"]).max() > 1e-3
    sync.push()
    metrics = check.rollout_side(groups["vllm"], check.trainer_side(groups["trainer"]), when="after the step")
    assert metrics["sync/landing_gap_max"] < TOL


def test_merged_checkpoint_loads_in_vllm_with_the_trainers_logprobs(cluster, tmp_path):
    from safetensors import safe_open

    from chatlearn.checkpoint.merge import merge_checkpoint
    from chatlearn.models.rollout.vllm import VLLMRollout

    groups = cluster["groups"]
    ckpt, out = str(cluster["root"] / "ckpt"), str(tmp_path / "merged")
    groups["trainer"].call("save_checkpoint", ckpt)
    merge_checkpoint(ckpt, out)
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert any(".mlp.experts." in k for k in keys)
    check = LandingCheck(PROBE, trainer_dp=2, configured=None, model=out, backend="vllm")
    expected = check.trainer_side(groups["trainer"])
    rollout = VLLMRollout(rollout_spec(out))
    try:
        found = rollout.probe_logprobs(PROBE)["logprobs"]
    finally:
        rollout.shutdown()
    assert np.abs(found - expected["logprobs"]).max() < TOL
