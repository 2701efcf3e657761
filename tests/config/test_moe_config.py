"""The mixture-of-experts keys before any process starts: a dense model with one of them set, routing replay on
a dense model or with an engine that does not report its routing, experts not divisible by the expert-parallel
size, expert parallelism on FSDP, and bad values: one paragraph naming the key and the fix."""
from __future__ import annotations

import os
import shutil

import pytest

from chatlearn.config.load import load_run
from chatlearn.config.moe_keys import MOE_KEYS, Experts, experts_of
from chatlearn.errors import ConfigError

GRPO = "template/grpo_fsdp.yaml"
HF = "runtime_args.rollout_backend=hf"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    """A tiny random Qwen3-MoE (6 experts, top 2) with the toy's tokenizer."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from conftest import REPO

    out = tmp_path_factory.mktemp("moe")
    dense = os.path.join(REPO, "assets", "tiny_qwen2")
    for name in os.listdir(dense):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(dense, name), out / name)
    torch.manual_seed(0)
    conf = Qwen3MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                          num_experts=6, num_experts_per_tok=2, max_position_embeddings=256)
    Qwen3MoeForCausalLM(conf).save_pretrained(out)
    return str(out)


def _refused(*overrides) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_run(GRPO, [HF, *overrides])
    return info.value


def test_experts_are_read_from_config_json(moe_folder):
    assert experts_of(moe_folder) == Experts(count=6, top_k=2)
    assert experts_of("assets/tiny_qwen2") is None
    assert experts_of("/nonexistent") is None and experts_of(None) is None


@pytest.mark.parametrize("override", [
    "models.policy_trainer.moe_aux_loss_coeff=0.01", "models.policy_trainer.moe_z_loss_coeff=0.001",
    "models.policy_trainer.moe_router_force_load_balancing=true", "models.policy_trainer.groupgemm=true",
    "models.policy_trainer.moe_token_dispatcher_type=allgather", "models.policy_trainer.moe_layer_recompute=true",
    "models.policy_trainer.moe_shared_expert_overlap=true", "models.policy_trainer.expert_model_parallel_size=2",
])
def test_an_moe_key_on_a_dense_model_is_refused(override):
    err = _refused(override)
    assert err.key == override.split("=")[0]
    assert "dense model" in str(err) and "tiny_qwen2" in str(err) and "Remove the key" in str(err)


def test_every_moe_key_is_checked_on_a_dense_model():
    # the list the check walks holds every MoE key of the trainer sections
    from dataclasses import fields

    from chatlearn.config.schema import TrainerModel

    names = {f.name for f in fields(TrainerModel)}
    assert set(MOE_KEYS) <= names
    assert {n for n in names if n.startswith("moe_") or "expert" in n} <= set(MOE_KEYS)


def test_routing_replay_on_a_dense_model_or_an_engine_without_routing():
    err = _refused("models.policy_trainer.routing_replay=rollout")
    assert err.key == "models.policy_trainer.routing_replay" and "dense model" in str(err)
    err = _refused("models.policy_trainer.routing_replay=always")
    assert err.key == "models.policy_trainer.routing_replay" and "off, rollout" in str(err)


def test_an_moe_model_takes_the_keys(moe_folder):
    load = f"models.policy_trainer.load={moe_folder}"
    cfg, _ = load_run(GRPO, [HF, load, "models.policy_trainer.moe_aux_loss_coeff=0.01",
                             "models.policy_trainer.moe_z_loss_coeff=0.001",
                             "models.policy_trainer.routing_replay=rollout"])
    assert cfg.models.ref_policy.load == moe_folder
    err = _refused(load, "models.policy_trainer.routing_replay=rollout",
                   "models.policy_trainer.moe_router_force_load_balancing=true")
    assert err.key == "models.policy_trainer.routing_replay" and "forced balancing" in str(err)
    err = _refused(load, "models.policy_trainer.routing_replay=rollout", "runtime_args.rollout_backend=sglang")
    assert err.key == "models.policy_trainer.routing_replay" and "sglang" in str(err)


def test_experts_not_divisible_by_the_expert_parallel_size(moe_folder):
    load = f"models.policy_trainer.load={moe_folder}"
    err = _refused(load, "runtime_args.train_backend=megatron", "models.policy_trainer.expert_model_parallel_size=4")
    assert err.key == "models.policy_trainer.expert_model_parallel_size"
    assert "6 experts" in str(err) and "1, 2, 3, 6" in str(err)


def test_expert_parallelism_on_fsdp_is_refused(moe_folder):
    err = _refused(f"models.policy_trainer.load={moe_folder}", "models.policy_trainer.expert_model_parallel_size=2")
    assert err.key == "models.policy_trainer.expert_model_parallel_size" and "train_backend: megatron" in str(err)


@pytest.mark.parametrize("override, words", [
    ("models.policy_trainer.moe_aux_loss_coeff=-1", "0 (off) or positive"),
    ("models.policy_trainer.moe_z_loss_coeff=-0.1", "0 (off) or positive"),
    ("models.policy_trainer.moe_token_dispatcher_type=alltoal", "Did you mean 'alltoall'"),
    ("models.policy_trainer.expert_model_parallel_size=0", "set 1"),
])
def test_bad_values(moe_folder, override, words):
    err = _refused(f"models.policy_trainer.load={moe_folder}", override)
    assert err.key == override.split("=")[0] and words in str(err)


def test_a_bare_off_that_yaml_reads_as_false_is_off(moe_folder, tmp_path):
    cfg, _ = load_run(GRPO, [HF, f"models.policy_trainer.load={moe_folder}", "models.policy_trainer.routing_replay=off"])
    assert cfg.models.policy_trainer.routing_replay == "off"
    path = tmp_path / "run.yaml"
    path.write_text(open(GRPO).read().replace("  policy_trainer:\n", "  policy_trainer:\n    routing_replay: off\n", 1))
    cfg, _ = load_run(str(path), [HF])
    assert cfg.models.policy_trainer.routing_replay == "off"
