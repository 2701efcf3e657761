"""``models.policy.expert_model_parallel_size``: vLLM's expert parallelism (``enable_expert_parallel``, whole
experts spread over every rank of an engine, so its size is the engine's tensor parallel size here), a
warning on the rollouts it does not act on, and the error that names the key otherwise."""
from __future__ import annotations

import pytest

from chatlearn.config.load import load_config
from chatlearn.config.plan import make_plan
from chatlearn.config.schema import compat_warning
from chatlearn.errors import ConfigError

TEMPLATE = "template/grpo_fsdp.yaml"
MICRO8 = ["runtime_args.train_micro_batch_size=8"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from tiny_moe_models import make_tiny_moe_model

    return make_tiny_moe_model(str(tmp_path_factory.mktemp("moe") / "m"), "qwen3_moe")


def _cfg(paths_overrides, moe_dir, *overrides):
    return load_config(TEMPLATE, paths_overrides + MICRO8 + [f"models.policy_trainer.load={moe_dir}", *overrides])


def test_vllm_expert_parallel_over_the_engine_ranks(paths_overrides, moe_dir):
    cfg = _cfg(paths_overrides, moe_dir, "models.policy_trainer.num_gpu=4", "models.policy.tensor_model_parallel_size=2",
               "models.policy.expert_model_parallel_size=2")
    plan = make_plan(cfg)
    assert plan.rollout_replicas == 2
    assert compat_warning(cfg) is None or "expert_model_parallel_size" not in compat_warning(cfg)


@pytest.mark.parametrize("overrides, words", [
    (["models.policy.expert_model_parallel_size=2"], ["tensor_model_parallel_size = 1", "enable_expert_parallel"]),
    (["models.policy_trainer.num_gpu=4", "models.policy.tensor_model_parallel_size=2",
      "models.policy.expert_model_parallel_size=4"], ["is 4", "or to 2"]),
    (["models.policy.expert_model_parallel_size=0"], ["positive integer"]),
])
def test_vllm_expert_parallel_errors_name_the_key(paths_overrides, moe_dir, overrides, words):
    with pytest.raises(ConfigError) as info:
        make_plan(_cfg(paths_overrides, moe_dir, *overrides))
    msg = str(info.value)
    assert info.value.key == "models.policy.expert_model_parallel_size", msg
    for w in words:
        assert w in msg, msg


def test_hf_rollout_warns_that_it_holds_every_expert(paths_overrides, moe_dir):
    cfg = _cfg(paths_overrides, moe_dir, "runtime_args.rollout_backend=hf", "models.policy.expert_model_parallel_size=2")
    make_plan(cfg)
    msg = compat_warning(cfg)
    assert "models.policy.expert_model_parallel_size=2 (acts on the vLLM rollout only" in msg
    assert compat_warning(_cfg(paths_overrides, moe_dir, "runtime_args.rollout_backend=hf")) is None
