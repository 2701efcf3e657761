"""models.policy_trainer.lora: the refusals before any process starts (one paragraph naming the key and
the fix), the spec, and the plan that serves the reference log-probs from the policy trainer."""
from __future__ import annotations

import pytest

from chatlearn.config.load import load_run
from chatlearn.errors import ConfigError

GRPO = "template/grpo_fsdp.yaml"
HF = "runtime_args.rollout_backend=hf"
ON = "models.policy_trainer.lora.rank=8"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)


def _refused(*overrides) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_run(GRPO, list(overrides))
    return info.value


def test_off_by_default_and_on_with_a_rank():
    from chatlearn.models.specs import TrainerSpec

    cfg, plan = load_run(GRPO, [HF])
    assert cfg.models.policy_trainer.lora.rank == 0
    assert TrainerSpec.from_config(cfg, "policy_trainer", plan).lora is None
    cfg, plan = load_run(GRPO, [HF, ON, "models.policy_trainer.lora.target_modules=[q_proj,v_proj]",
                                "models.policy_trainer.lora.alpha=16"])
    lora = TrainerSpec.from_config(cfg, "policy_trainer", plan).lora
    assert (lora.rank, lora.alpha, lora.target_modules) == (8, 16.0, ("q_proj", "v_proj"))
    assert TrainerSpec.from_config(cfg, "ref_policy", plan).lora is None


def test_the_reference_comes_from_the_policy_trainer():
    _, plan = load_run(GRPO, [HF, "models.policy_trainer.kl_coef=0.1"])
    assert plan.uses_ref and not plan.ref_from_trainer and "ref_policy" in plan.placements
    _, plan = load_run(GRPO, [HF, ON, "models.policy_trainer.kl_coef=0.1"])
    assert plan.ref_from_trainer and not plan.uses_ref
    assert "ref_policy" not in plan.placements
    assert any("adapters disabled" in line for line in plan.describe())


def test_target_modules_that_match_nothing():
    err = _refused(HF, ON, "models.policy_trainer.lora.target_modules=[qkv_proj]")
    assert err.key == "models.policy_trainer.lora.target_modules"
    assert "matches no linear layer" in str(err) and "q_proj" in str(err)  # names the model's layers
    err = _refused(HF, ON, "models.policy_trainer.lora.target_modules=[q_proj,lm_head]")  # tied to the embeddings
    assert err.key == "models.policy_trainer.lora.target_modules" and "tie_word_embeddings" in str(err)
    err = _refused(HF, ON, "models.policy_trainer.lora.target_modules=everything")
    assert err.key == "models.policy_trainer.lora.target_modules"


def test_rank_larger_than_a_matched_layer():
    # assets/tiny_qwen2: hidden 128, 2 key-value heads of 32: k_proj is 128 -> 64
    err = _refused(HF, "models.policy_trainer.lora.rank=100", "models.policy_trainer.lora.target_modules=[k_proj]")
    assert err.key == "models.policy_trainer.lora.rank"
    assert "k_proj" in str(err) and "at most 64" in str(err)
    load_run(GRPO, [HF, "models.policy_trainer.lora.rank=100", "models.policy_trainer.lora.target_modules=[q_proj]"])


def test_megatron_and_the_critic_are_refused_every_rollout_engine_is_taken():
    err = _refused(HF, ON, "runtime_args.train_backend=megatron")
    assert err.key == "runtime_args.train_backend" and "FSDP trainer only" in str(err)
    for backend in ("vllm", "sglang"):  # the adapter push reaches every engine (lora_push.py)
        cfg, _ = load_run(GRPO, [f"runtime_args.rollout_backend={backend}", ON])
        assert cfg.models.policy_trainer.lora.push == "adapters"
    err = _refused(HF, ON, "models.policy_trainer.advantage_estimator=gae")
    assert err.key == "models.policy_trainer.algorithm" and "critic" in str(err)


def test_push_mode_and_the_base_the_rollout_starts_from(tmp_path):
    import shutil

    err = _refused(HF, ON, "models.policy_trainer.lora.push=deltas")
    assert err.key == "models.policy_trainer.lora.push" and "merged" in str(err)
    # adapters: the rollout keeps its own weights outside the adapted modules, so it must load the base
    other = shutil.copytree("assets/tiny_qwen2", tmp_path / "other")
    err = _refused(HF, ON, f"models.policy.load={other}")
    assert err.key == "models.policy_trainer.lora.push" and "push=merged" in str(err)
    load_run(GRPO, [HF, ON, f"models.policy.load={other}", "models.policy_trainer.lora.push=merged"])


def test_the_push_mode_is_a_harmless_change_on_resume():
    """lora.push changes how the update reaches the rollout, not the weights it reaches."""
    from chatlearn.config.changes import config_changes

    old = {"models": {"policy_trainer": {"lora": {"push": "merged", "rank": 4}}}}
    new = {"models": {"policy_trainer": {"lora": {"push": "adapters", "rank": 8}}}}
    changes = config_changes(old, new, {"models.policy_trainer.lora.push", "models.policy_trainer.lora.rank"})
    assert [(c.key, c.harmless) for c in changes] == [("models.policy_trainer.lora.push", True),
                                                     ("models.policy_trainer.lora.rank", False)]


def test_bad_values_and_modules_to_save():
    assert _refused(HF, "models.policy_trainer.lora.rank=-1").key == "models.policy_trainer.lora.rank"
    assert _refused(HF, ON, "models.policy_trainer.lora.alpha=0").key == "models.policy_trainer.lora.alpha"
    assert _refused(HF, ON, "models.policy_trainer.lora.dropout=1").key == "models.policy_trainer.lora.dropout"
    err = _refused(HF, ON, "models.policy_trainer.lora.dropout=0.1")  # on in training forwards only: ratio != 1
    assert err.key == "models.policy_trainer.lora.dropout" and "\n" not in str(err)
    for part in ("is 0.1", "old-log-prob and reference passes", "PPO ratio would not be 1", "Set it to 0"):
        assert part in str(err), (part, str(err))
    err = _refused(HF, ON, "models.policy_trainer.lora.modules_to_save=[score]")
    assert err.key == "models.policy_trainer.lora.modules_to_save" and "score" in str(err)
    for tied in ("embed_tokens", "lm_head"):  # assets/tiny_qwen2 ties them
        err = _refused(HF, ON, f"models.policy_trainer.lora.modules_to_save=[{tied}]")
        assert err.key == "models.policy_trainer.lora.modules_to_save" and "tie_word_embeddings" in str(err)
    load_run(GRPO, [HF, ON, "models.policy_trainer.lora.modules_to_save=[norm]"])


def test_the_reference_pass_calls_the_trainer_with_adapters_disabled(monkeypatch):
    """GRPO's reference pass goes to policy_trainer.ref_logprobs (its weights made resident) under LoRA,
    to ref_policy.compute_logprobs without."""
    import numpy as np

    from chatlearn.config.names import Stage
    from chatlearn.runtime.driver import algorithm

    calls = []

    class Group:
        def __init__(self, name):
            self.name = name

        def call(self, method, *args):
            calls.append((self.name, method))
            return [np.zeros(3, np.float32)], None

    class Sched:
        groups = {n: Group(n) for n in ("policy_trainer", "ref_policy")}

        def ensure(self, model, parts):
            calls.append((model, "ensure"))

    monkeypatch.setattr(algorithm, "put", lambda x: x)
    batch = {"tokens": np.zeros(3, np.int64), "prompt_lens": np.ones(1, np.int64), "offsets": np.array([0, 3])}
    for overrides, expected in (([ON], ("policy_trainer", "ref_logprobs")), ([], ("ref_policy", "compute_logprobs"))):
        cfg, plan = load_run(GRPO, [HF, "models.policy_trainer.kl_coef=0.1", *overrides])
        calls.clear()
        grpo = algorithm.grpo(cfg, plan, algorithm.ModelCalls(Sched(), 1.0), steps=None)
        ref = grpo.passes()[0]
        assert (ref.stage, ref.model, ref.column) == (Stage.REF_LOGPROBS, expected[0], "ref_logprobs")
        ref.compute(batch)
        assert calls == [(expected[0], "ensure"), expected], calls


def test_the_lora_template_is_the_default_with_adapters():
    """template/grpo_lora.yaml (README's LoRA demo) validates, trains rank-16 adapters on the hf rollout at
    10x the default's learning rate for 40 episodes, and is template/grpo_fsdp.yaml in every other key: the two
    stay in step."""
    from omegaconf import OmegaConf

    cfg, plan = load_run("template/grpo_lora.yaml", [])
    lora = cfg.models.policy_trainer.lora
    assert (lora.rank, lora.alpha, lora.target_modules) == (16, 32.0, "all-linear")
    assert cfg.runtime_args.rollout_backend == "hf" and "ref_policy" not in plan.placements
    assert cfg.runtime_args.num_episode == 40 and cfg.runtime_args.eval_episode_interval == 20
    default, _ = load_run(GRPO, [HF])
    assert cfg.models.policy_trainer.optimizer.lr == 10 * default.models.policy_trainer.optimizer.lr

    def flat(c):
        out = {}

        def walk(prefix, node):
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
            else:
                out[prefix] = node
        walk("", OmegaConf.to_container(c, resolve=True))
        return out

    mine, theirs = flat(cfg), flat(default)
    differ = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    allowed = ("runtime_args.exp_name", "runtime_args.output_dir", "runtime_args.log_args_dict.",
               "runtime_args.num_episode", "runtime_args.save_episode_interval",
               "models.policy_trainer.optimizer.lr", "models.critic.optimizer.lr", "models.policy_trainer.lora.")
    assert [k for k in differ if not k.startswith(allowed)] == []
