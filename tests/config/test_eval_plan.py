"""The plan of ``chatlearn eval`` (:func:`make_eval_plan`): the rollout and the reward workers placed and
checked as a training run's plan (:func:`make_plan`) places and checks them."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from chatlearn.config.load import load_config
from chatlearn.config.plan import make_eval_plan, make_plan
from chatlearn.errors import ConfigError

TEMPLATE = "template/grpo_fsdp.yaml"
MICRO8 = ["runtime_args.train_micro_batch_size=8"]  # fits 2 or 4 trainer ranks of the template's batch


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)


@pytest.mark.parametrize("overrides", [
    [],
    ["models.reward.num_cpu=4", "models.reward.cpu_per_process=2"],
    ["models.reward.num_cpu=3", "models.reward.cpu_per_process=null"],
    ["models.policy_trainer.num_gpu=4", "models.policy.tensor_model_parallel_size=2"],
    ["models.policy_trainer.num_gpu=4", "models.policy.tensor_model_parallel_size=2", "runtime_args.colocation=[]"],
])
def test_eval_plan_places_the_rollout_and_the_reward_as_the_run_plan(paths_overrides, overrides):
    cfg = load_config(TEMPLATE, paths_overrides + MICRO8 + overrides)
    run, ev = make_plan(cfg), make_eval_plan(cfg, num_prompts=5, samples_per_prompt=3)
    # the reward workers: on CPUs alike
    assert ev.placements["reward"] == run.placements["reward"]
    # the rollout: the same replicas on the same devices of its group, which in eval is group 0 and its own
    pol, run_pol = ev.placements["policy"], run.placements["policy"]
    assert (pol.num_actors, pol.devices, pol.devices_per_actor, pol.cpus_per_actor) == (
        run_pol.num_actors, run_pol.devices, run_pol.devices_per_actor, run_pol.cpus_per_actor)
    assert pol.device_group == 0 and ev.device_groups == [["policy"]]
    assert ev.devices_per_group == [cfg.models.policy.num_gpu]
    assert ev.rollout_replicas == run.rollout_replicas and ev.rollout_tp == run.rollout_tp
    assert set(ev.placements) == {"policy", "reward"}
    # sizes of the evaluation set; no optimizer step
    assert (ev.group_size, ev.prompts_per_episode, ev.samples_per_episode, ev.steps_per_episode) == (3, 5, 15, 0)
    assert ev.describe()  # the plan describes itself as a run's does


def test_eval_plan_reward_cpu_placement(paths_overrides):
    cfg = load_config(TEMPLATE, paths_overrides + ["models.reward.num_cpu=6", "models.reward.cpu_per_process=3"])
    reward = make_eval_plan(cfg, 1, 1).placements["reward"]
    assert (reward.num_actors, reward.device_group, reward.devices, reward.cpus_per_actor) == (2, -1, [], 3.0)


@pytest.mark.parametrize("num_gpu, tp, words", [(3, 2, ["num_gpu (3)", "tensor_model_parallel_size (2)"]),
                                                (1, 2, ["num_gpu (1)", "tensor_model_parallel_size (2)"])])
def test_eval_plan_num_gpu_error_names_the_key(paths_overrides, num_gpu, tp, words):
    """The config ``chatlearn eval`` was given but not validated for these sizes (``evaluate_only`` called
    with a config of its own): the same error as a run's plan, naming models.policy.num_gpu."""
    cfg = load_config(TEMPLATE, paths_overrides)
    cfg = OmegaConf.merge(cfg, {"models": {"policy": {"num_gpu": num_gpu, "tensor_model_parallel_size": tp}},
                                "runtime_args": {"rollout_backend": "vllm"}})
    with pytest.raises(ConfigError) as info:
        make_eval_plan(cfg, 4, 2)
    msg = str(info.value)
    assert info.value.key == "models.policy.num_gpu" and msg.startswith("models.policy.num_gpu: "), msg
    for w in words:
        assert w in msg, msg
    with pytest.raises(ConfigError) as run_info:
        make_plan(cfg)
    assert run_info.value.key == "models.policy.num_gpu" and str(run_info.value) == msg
