"""Models as data: every model has a kind (chatlearn/config/kinds.py), models of the user's naming
(reward models, any number), the algorithm named (chatlearn/config/algorithms.py), and the refusals
of a bad cast before anything starts."""
from __future__ import annotations

import ast
import os

import pytest

from chatlearn.batch import COLUMNS
from chatlearn.config.registry import ALGORITHMS
from chatlearn.config.kinds import DEFAULT_MODELS, KINDS, REWARD_MODEL, model_kinds
from chatlearn.config.load import load_run
from chatlearn.errors import ConfigError
from conftest import REPO

GRPO = "template/grpo_fsdp.yaml"
PPO = "template/ppo_fsdp.yaml"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


def two_reward_models(reward_model_dir):
    return ["models.rm_math.kind=reward_model", f"models.rm_math.load={reward_model_dir}", "models.rm_math.weight=0.7",
            "models.rm_style.kind=reward_model", f"models.rm_style.load={reward_model_dir}", "models.rm_style.weight=0.3",
            "models.rm_style.normalize=batch", "runtime_args.colocation=[policy,policy_trainer,rm_math,rm_style]"]


def test_every_kind_is_declared_whole():
    """Each kind's columns are batch columns, a kind the user may name models of has a section schema
    with a kind key, and today's names keep their kinds."""
    for kind in KINDS.values():
        assert set(kind.columns) <= set(COLUMNS), kind
        if kind.schema is not None:
            assert kind.schema.__dataclass_fields__["kind"].default == kind.name
    assert {n: k.name for n, k in DEFAULT_MODELS.items()} == {
        "policy": "rollout", "policy_trainer": "trainer", "ref_policy": "reference", "critic": "critic",
        "reward": "reward"}
    assert len({k.build_rank for k in KINDS.values()}) == len(KINDS)  # one build order


def test_two_reward_models_of_the_users_naming_are_placed_and_take_turns(paths_overrides, reward_model_dir):
    cfg, plan = load_run(GRPO, paths_overrides + two_reward_models(reward_model_dir))
    assert plan.device_groups == [["policy", "policy_trainer", "rm_math", "rm_style"]]
    assert plan.reward_models == ["rm_math", "rm_style"]
    assert plan.kind("rm_math") is REWARD_MODEL and plan.placements["rm_style"].device_group == 0
    assert sorted(plan.colocated_with("rm_math")) == ["policy", "policy_trainer", "rm_style"]
    assert not plan.single_process  # reward models on devices: Ray
    described = "\n".join(plan.describe())
    assert "rm_math: reward model, scores every sample (models.rm_math)" in described
    assert cfg.models.rm_style.weight == 0.3 and cfg.models.rm_style.normalize == "batch"
    assert cfg.models.rm_math.num_gpu == cfg.models.policy_trainer.num_gpu  # the schema's default follows it
    assert list(model_kinds(cfg))[-2:] == ["rm_math", "rm_style"]


def test_reward_model_of_models_reward_load_keeps_its_name(paths_overrides, reward_model_dir):
    """ChatLearn's models.reward.load is the reward model reward_model (named reward in colocation), beside
    one of the user's naming."""
    cfg, plan = load_run(GRPO, paths_overrides + [
        f"models.reward.load={reward_model_dir}", "models.reward.num_gpu=1", "models.rm2.kind=reward_model",
        f"models.rm2.load={reward_model_dir}", "runtime_args.colocation=[policy,policy_trainer,reward,rm2]"])
    assert plan.device_groups == [["policy", "policy_trainer", "reward_model", "rm2"]]
    assert plan.reward_models == ["reward_model", "rm2"]


@pytest.mark.parametrize("overrides, key, words", [
    (["models.rm.kind=reward_modle", "models.rm.load=x"], "models.rm.kind", ["not a kind of model",
                                                                              "Did you mean 'reward_model'"]),
    (["models.policy2.kind=rollout"], "models.policy2.kind", ["second model of kind rollout", "models.policy"]),
    (["models.polcy.load=x"], "models.polcy.kind", ["says no kind", "Did you mean models.policy"]),
    (["models.policy.kind=trainer"], "models.policy.kind", ["its kind is fixed"]),
    (["runtime_args.colocation=[policy,policy_trainer,rm_nope]"], "runtime_args.colocation",
     ["'rm_nope' is not a model of this config", "models.<name> with its kind"]),
    (["models.rm.kind=reward_model", "models.rm.lod=x"], "models.rm.lod", ["unknown key", "models.rm.load"]),
    (["models.rm.kind=reward_model"], "models.rm.load", ["required key"]),
    (["models.rm.kind=reward_model", "models.rm.load=x", "models.rm.normalize=whiten"], "models.rm.normalize",
     ["batch"]),
    (["models.policy_trainer.algorithm=ppx"], "models.policy_trainer.algorithm", ["unknown algorithm",
                                                                                  "Did you mean 'ppo'"]),
    (["models.policy_trainer.algorithm=grpo", "models.policy_trainer.advantage_estimator=gae"],
     "models.policy_trainer.advantage_estimator", ["gae is ppo's", "grpo, dr_grpo, rloo"]),
])
def test_a_bad_cast_is_refused_naming_the_key(paths_overrides, reward_model_dir, overrides, key, words):
    overrides = [o.replace("=x", f"={reward_model_dir}") for o in overrides]
    with pytest.raises(ConfigError) as err:
        load_run(GRPO, paths_overrides + overrides)
    assert err.value.key == key, str(err.value)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_a_reward_model_with_dynamic_sampling_is_refused(paths_overrides, reward_model_dir):
    with pytest.raises(ConfigError) as err:
        load_run(GRPO, paths_overrides + ["models.rm.kind=reward_model", f"models.rm.load={reward_model_dir}",
                                          "runtime_args.dynamic_sampling=true"])
    assert err.value.key == "runtime_args.dynamic_sampling" and "(rm)" in str(err.value)


def test_the_algorithm_is_named_or_inferred(paths_overrides):
    cfg, plan = load_run(GRPO, paths_overrides)
    assert cfg.models.policy_trainer.algorithm == "grpo" and plan.algorithm == "grpo" and not plan.uses_critic
    cfg, plan = load_run(PPO, paths_overrides)  # advantage_estimator: gae infers ppo
    assert cfg.models.policy_trainer.algorithm == "ppo" and plan.uses_critic and "critic" in plan.placements
    # set without an estimator: its own
    cfg, plan = load_run(GRPO, paths_overrides + ["models.policy_trainer.algorithm=ppo"])
    assert cfg.models.policy_trainer.advantage_estimator == "gae" and plan.kind("critic").trains
    cfg, plan = load_run(GRPO, paths_overrides + ["models.policy_trainer.algorithm=grpo",
                                                  "models.policy_trainer.advantage_estimator=rloo"])
    assert plan.algorithm == "grpo" and cfg.models.policy_trainer.advantage_estimator == "rloo"


def test_no_estimator_name_is_compared_outside_the_algorithms_declarations():
    """The algorithm is chosen by its declaration (chatlearn/config/algorithms.py), never by comparing
    an estimator's name elsewhere (``advantage_estimator == "gae"``)."""
    names = set(ALGORITHMS.get("ppo").estimators)
    found = []
    for root, _, files in os.walk(os.path.join(REPO, "chatlearn")):
        for f in files:
            path = os.path.join(root, f)
            if not f.endswith(".py") or path.endswith(os.path.join("config", "algorithms.py")):
                continue
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
                if isinstance(node, ast.Compare):
                    consts = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
                    if names & set(consts):
                        found.append(f"{os.path.relpath(path, REPO)}:{node.lineno}")
    assert not found, found


def teacher_overrides(tiny_model_dir):
    return ["models.policy_trainer.algorithm=opd", "models.teacher.kind=teacher", f"models.teacher.load={tiny_model_dir}",
            "models.teacher.generation_batch_size=4", "runtime_args.rollout_backend=hf",
            "runtime_args.colocation=[policy,policy_trainer,teacher]"]


def test_a_teacher_is_placed_takes_turns_and_gets_its_own_spec(paths_overrides, tiny_model_dir):
    from chatlearn.config.kinds import TEACHER
    from chatlearn.models.specs import TrainerSpec

    cfg, plan = load_run(GRPO, paths_overrides + teacher_overrides(tiny_model_dir))
    assert plan.kind("teacher") is TEACHER and plan.algorithm == "opd"
    assert plan.device_groups == [["policy", "policy_trainer", "teacher"]]
    assert sorted(plan.colocated_with("teacher")) == ["policy", "policy_trainer"]
    assert plan.single_process  # frozen on the training backend, one rank on the trainer's device: as the reference
    assert plan.old_logprob_pass_from == 0  # the distillation advantages read every sample's old log-probs
    spec = TrainerSpec.from_config(cfg, "teacher", plan)
    assert (spec.role, spec.trainable, spec.lora, spec.logprob_micro_batch_size) == ("teacher", False, None, 4)
    assert spec.load == tiny_model_dir and spec.routing_replay == "off"
    assert cfg.models.teacher.num_gpu == cfg.models.policy_trainer.num_gpu  # the schema's default follows it
    # with LoRA the student's adapters learn; the teacher (frozen) needs none
    cfg, plan = load_run(GRPO, paths_overrides + teacher_overrides(tiny_model_dir) + ["models.policy_trainer.lora.rank=4"])
    assert plan.kind("teacher") is TEACHER and cfg.models.policy_trainer.lora.rank == 4


def test_a_second_teacher_and_gkd_on_megatron_are_refused(paths_overrides, tiny_model_dir):
    from chatlearn.config.kinds import TEACHER

    over = paths_overrides + teacher_overrides(tiny_model_dir)
    with pytest.raises(ConfigError) as err:
        load_run(GRPO, over + ["models.teacher2.kind=teacher", f"models.teacher2.load={tiny_model_dir}"])
    assert err.value.key == "models.teacher2.kind" and "a run has one teacher" in str(err.value)
    # opd's teacher runs on the Megatron trainer too (tests/e2e/test_megatron_e2e.py); gkd's top-k loss does not
    cfg, plan = load_run(GRPO, over + ["runtime_args.train_backend=megatron"])
    assert plan.kind("teacher") is TEACHER and cfg.runtime_args.train_backend == "megatron"
    with pytest.raises(ConfigError) as err:
        load_run(GRPO, over + ["runtime_args.train_backend=megatron", "models.policy_trainer.algorithm=gkd",
                               "models.policy.num_inference_per_prompt=1"])
    assert err.value.key == "runtime_args.train_backend" and "algorithm: gkd" in str(err.value)
