"""runtime_args.single_process: which layouts run every model in the driver's process, without Ray."""
from __future__ import annotations

import pytest

from chatlearn.config.load import load_run
from chatlearn.config.plan import make_eval_plan
from chatlearn.errors import ConfigError

TEMPLATE = "template/grpo_fsdp.yaml"
KEY = "runtime_args.single_process"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)


def single(paths_overrides, *over) -> bool:
    _, plan = load_run(TEMPLATE, paths_overrides + list(over))
    assert any("no Ray (runtime_args.single_process)" in line for line in plan.describe()) == plan.single_process
    return plan.single_process


def test_one_process_where_every_model_fits_in_it(paths_overrides):
    assert single(paths_overrides)  # the default: one trainer rank, its fused vLLM replica, the reward workers
    assert single(paths_overrides, "runtime_args.rollout_backend=hf")
    assert single(paths_overrides, "models.policy_trainer.kl_coef=0.01")  # the reference model colocated
    assert single(paths_overrides, "models.reward.num_cpu=2")  # reward workers are processes either way
    assert not single(paths_overrides, f"{KEY}=false")
    assert not single(paths_overrides, "runtime_args.fuse_rollout=false")
    assert not single(paths_overrides, "runtime_args.rollout_backend=hf", "models.policy_trainer.num_gpu=2",
                      "models.policy.num_gpu=2")


def test_a_cluster_to_join_keeps_ray(paths_overrides, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert not single(paths_overrides)


@pytest.mark.parametrize("over, why", [
    (["runtime_args.fuse_rollout=false"], "not fused into the trainer's process"),
    (["runtime_args.rollout_backend=hf", "models.policy_trainer.num_gpu=2", "models.policy.num_gpu=2"],
     "the trainer has 2 ranks"),
    (["models.policy_trainer.kl_coef=0.01", "runtime_args.colocation=[policy,policy_trainer]",
      "models.ref_policy.num_gpu=1"], "ref_policy is not one rank on the policy trainer's device"),
])
def test_required_where_it_cannot_be_is_refused_naming_why(paths_overrides, over, why):
    with pytest.raises(ConfigError) as err:
        load_run(TEMPLATE, paths_overrides + over + [f"{KEY}=true"])
    assert err.value.key == KEY and why in str(err.value)


def test_an_evaluation_runs_its_one_replica_in_the_driver(paths_overrides):
    cfg, _ = load_run(TEMPLATE, paths_overrides)
    assert make_eval_plan(cfg, 10, 2).single_process
    cfg, _ = load_run(TEMPLATE, paths_overrides + ["runtime_args.rollout_backend=sglang", "runtime_args.fuse_rollout=false"])
    assert not make_eval_plan(cfg, 10, 2).single_process  # SGLang's engine runs in processes of its own
