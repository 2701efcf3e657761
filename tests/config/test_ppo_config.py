"""PPO's keys (advantage_estimator: gae, models.critic) and the reward model's (models.reward.load):
inheritance from the policy trainer, the plan of five colocated models, and the refusals."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from chatlearn.config.load import load_run
from chatlearn.errors import ConfigError

PPO = "template/ppo_fsdp.yaml"
GRPO = "template/grpo_fsdp.yaml"
FIVE = "runtime_args.colocation=[policy,policy_trainer,critic,ref_policy,reward]"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)


def test_critic_inherits_every_trainer_key_it_does_not_set(paths_overrides):
    cfg, plan = load_run(PPO, paths_overrides + ["models.policy_trainer.optimizer.weight_decay=0.05",
                                                 "models.policy_trainer.gradient_checkpointing=true",
                                                 "models.critic.optimizer.lr=1e-3"])
    c, t = cfg.models.critic, cfg.models.policy_trainer
    assert c.optimizer.lr == 1e-3 and t.optimizer.lr == 1e-4  # set on the critic: it wins
    assert c.optimizer.weight_decay == 0.05 and c.gradient_checkpointing is True  # inherited
    assert c.load == t.load and c.num_gpu == t.num_gpu and c.train_micro_batch_size == t.train_micro_batch_size
    assert c.free_gpu_memory.offload_optimizer_states == t.free_gpu_memory.offload_optimizer_states
    assert plan.uses_critic and "critic" in plan.placements
    assert plan.device_groups[0] == ["policy", "policy_trainer", "critic"]  # ref_policy unused: kl_coef 0


def test_critic_spec_takes_its_own_optimizer_and_value_loss(paths_overrides):
    from chatlearn.models.specs import TrainerSpec

    cfg, plan = load_run(PPO, paths_overrides + ["models.critic.optimizer.lr=1e-3",
                                                 "models.critic.cliprange_value=0.2"])
    spec = TrainerSpec.from_config(cfg, "critic", plan)
    assert spec.role == "critic" and spec.trainable and spec.lr == 1e-3
    assert spec.cliprange_value == 0.2 and spec.value_loss_coef == 0.5
    assert TrainerSpec.from_config(cfg, "policy_trainer", plan).role == "policy"
    assert TrainerSpec.from_config(cfg, "policy_trainer", plan).lr == 1e-4


def test_policy_schedule_spans_the_episodes_after_the_critic_warmup(paths_overrides):
    """The policy takes no step in the critic's warm-up episodes: its learning-rate schedule (decay and
    warmup fraction) spans the episodes after them, so it reaches min_lr at the run's end; the critic's
    spans every episode."""
    from chatlearn.models.specs import TrainerSpec

    cfg, plan = load_run(PPO, paths_overrides + ["runtime_args.num_episode=5", "models.critic.warmup_episodes=2",
                                                 "models.policy_trainer.optimizer.lr_decay_style=linear",
                                                 "models.policy_trainer.optimizer.lr_warmup_fraction=0.5",
                                                 "runtime_args.max_replay_episode=1"])
    per = plan.steps_per_episode
    assert plan.total_steps == per * (1 + 2 + 2 + 2 + 2)  # each episode after the first replays one
    assert plan.policy_steps == per * (2 + 2 + 2)  # episodes 3..5
    policy = TrainerSpec.from_config(cfg, "policy_trainer", plan)
    assert policy.lr_decay_iters == plan.policy_steps and policy.lr_warmup_iters == plan.policy_steps // 2
    assert TrainerSpec.from_config(cfg, "critic", plan).lr_decay_iters == plan.total_steps
    _, grpo = load_run(GRPO, paths_overrides + ["runtime_args.num_episode=5"])
    assert grpo.policy_steps == grpo.total_steps  # no critic: nothing to leave out


def test_five_models_on_one_device_group(paths_overrides, reward_model_dir):
    cfg, plan = load_run(PPO, paths_overrides + [FIVE, "models.policy_trainer.kl_coef=0.01",
                                                 f"models.reward.load={reward_model_dir}", "models.reward.num_gpu=1"])
    assert plan.device_groups == [["policy", "policy_trainer", "critic", "ref_policy", "reward_model"]]
    assert plan.devices_per_group == [1]
    assert {n: p.device_group for n, p in plan.placements.items()} == {
        "policy": 0, "policy_trainer": 0, "critic": 0, "ref_policy": 0, "reward_model": 0, "reward": -1}
    assert plan.reward_models == ["reward_model"] and plan.kind("reward_model").name == "reward_model"
    assert sorted(plan.colocated_with("reward_model")) == ["critic", "policy", "policy_trainer", "ref_policy"]
    assert any("reward_model" in line for line in plan.describe())


def test_reward_model_on_devices_of_its_own(paths_overrides, reward_model_dir):
    cfg, plan = load_run(GRPO, paths_overrides + [f"models.reward.load={reward_model_dir}", "models.reward.num_gpu=1"])
    assert ["reward_model"] in plan.device_groups and plan.total_devices == 2
    assert plan.placements["reward"].device_group == -1  # the functions' workers stay on CPUs


@pytest.mark.parametrize("overrides, key, words", [
    (["models.policy_trainer.advantage_estimator=grpo"],
     "models.critic.cliprange_value", "algorithm: ppo"),  # the template's critic section
    (["models.critic.kl_coef=0.1"], "models.critic.kl_coef", "policy's loss"),
    (["models.critic.cliprange_value=0"], "models.critic.cliprange_value", "> 0"),
    (["models.critic.warmup_episodes=100"], "models.critic.warmup_episodes", "num_episode"),
    (["models.critic.num_gpu=2"], "models.critic.num_gpu", "same devices"),
    (["models.policy_trainer.lam=1.5"], "models.policy_trainer.lam", "[0, 1]"),
    (["models.policy_trainer.filter_equal_groups=true"], "models.policy_trainer.filter_equal_groups", "gae"),
])
def test_ppo_refusals(paths_overrides, overrides, key, words):
    with pytest.raises(ConfigError) as err:
        load_run(PPO, paths_overrides + overrides)
    assert err.value.key == key and words in str(err.value), str(err.value)


def test_grpo_refuses_critic_and_gae_keys(paths_overrides):
    with pytest.raises(ConfigError) as err:
        load_run(GRPO, paths_overrides + ["runtime_args.colocation=[policy,policy_trainer,critic]"])
    assert err.value.key == "runtime_args.colocation" and "algorithm: ppo" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_run(GRPO, paths_overrides + ["models.policy_trainer.gamma=0.9"])
    assert err.value.key == "models.policy_trainer.gamma"


def test_reward_model_refusals(paths_overrides, reward_model_dir, tmp_path):
    base = paths_overrides + [f"models.reward.load={reward_model_dir}"]
    with pytest.raises(ConfigError) as err:  # no devices
        load_run(GRPO, base)
    assert err.value.key == "models.reward.num_gpu" and "num_gpu" in str(err.value)
    with pytest.raises(ConfigError) as err:  # a causal LM is no reward model
        load_run(GRPO, paths_overrides + ["models.reward.load=assets/tiny_qwen2", "models.reward.num_gpu=1"])
    assert err.value.key == "models.reward.load" and "ForSequenceClassification" in str(err.value)
    conf = json.loads(open(os.path.join(reward_model_dir, "config.json")).read())
    short = tmp_path / "short_rm"
    shutil.copytree(reward_model_dir, short)
    (short / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 40}))
    with pytest.raises(ConfigError) as err:  # prompt + response (64 + 16) longer than its context
        load_run(GRPO, paths_overrides + [f"models.reward.load={short}", "models.reward.num_gpu=1"])
    assert err.value.key == "models.reward.load" and "40 tokens" in str(err.value)
    two = tmp_path / "two_labels"
    shutil.copytree(reward_model_dir, two)
    (two / "config.json").write_text(json.dumps({**conf, "num_labels": 2}))
    with pytest.raises(ConfigError) as err:
        load_run(GRPO, paths_overrides + [f"models.reward.load={two}", "models.reward.num_gpu=1"])
    assert "2 labels" in str(err.value)
    bad = tmp_path / "bad_template"
    shutil.copytree(reward_model_dir, bad)
    (bad / "chat_template.jinja").write_text("{{ raise_exception('no assistant turns') }}")
    with pytest.raises(ConfigError) as err:
        load_run(GRPO, paths_overrides + [f"models.reward.load={bad}", "models.reward.num_gpu=1"])
    assert err.value.key == "models.reward.load" and "chat template" in str(err.value)
    with pytest.raises(ConfigError) as err:  # a reward-model key without a reward model
        load_run(GRPO, paths_overrides + ["models.reward.model_weight=2"])
    assert err.value.key == "models.reward.model_weight"
    with pytest.raises(ConfigError) as err:
        load_run(GRPO, base + ["models.reward.num_gpu=1", "runtime_args.dynamic_sampling=true"])
    assert err.value.key == "runtime_args.dynamic_sampling"


def test_a_critic_whose_context_is_too_short_is_refused(paths_overrides, tmp_path):
    from conftest import REPO

    short = tmp_path / "short_critic"
    shutil.copytree(os.path.join(REPO, "assets", "tiny_qwen2"), short)
    conf = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 50}))
    with pytest.raises(ConfigError) as err:  # prompt + response: 64 + 16 tokens
        load_run(PPO, paths_overrides + [f"models.critic.load={short}"])
    assert err.value.key == "models.critic.load" and "50 tokens" in str(err.value)
    with pytest.raises(ConfigError) as err:  # a folder that is no model
        load_run(PPO, paths_overrides + [f"models.critic.load={tmp_path}"])
    assert err.value.key == "models.critic.load"
