"""Validation of PPO's keys (``advantage_estimator: gae``, ``models.critic``) and of the reward model
(``models.reward.load``); called by ``chatlearn.config.load.validate``."""
from __future__ import annotations

import json
import os

from chatlearn.config.algorithms import declared
from chatlearn.config.checks import choice as _choice
from chatlearn.config.checks import positive as _positive
from chatlearn.config.kinds import REWARD_MODEL, models_of, reward_model_settings, section
from chatlearn.config.model_shapes import model_context_length
from chatlearn.config.schema import Critic, PolicyTrainer, Reward
from chatlearn.errors import ConfigError

PT = "models.policy_trainer"
# keys of models.critic that only the policy's loss reads: set on the critic they would do nothing
POLICY_LOSS_KEYS = ("pos_clip_ratio", "neg_clip_ratio", "clip_ratio_c", "entropy_coef", "kl_coef", "kl_estimator",
                    "kl_in_reward", "use_group_sequence_policy", "policy_loss", "advantage_estimator",
                    "filter_equal_groups")
PPO_KEYS = ("gamma", "lam", "whiten_advantages")
REWARD_MODEL_KEYS = ("model_weight", "model_normalize", "model_micro_batch_size", "bf16")
NORMALIZATIONS = ("none", "batch")


def uses_critic(cfg) -> bool:
    """Whether the run's algorithm trains a critic (its declaration needs one: PPO)."""
    t = cfg.models.policy_trainer
    return "critic" in declared(t.algorithm, t.advantage_estimator).needs


def check_ppo(cfg, user_keys: frozenset = frozenset()) -> None:
    """``advantage_estimator: gae`` and the critic; ``user_keys``: the dotted keys the user's YAML and
    command line set (a critic section set for an estimator that uses none is refused)."""
    t, c, rt = cfg.models.policy_trainer, cfg.models.critic, cfg.runtime_args
    if not uses_critic(cfg):
        set_critic = sorted(k for k in user_keys if k == "models.critic" or k.startswith("models.critic."))
        set_critic = [k for k in set_critic if not any(o.startswith(k + ".") for o in set_critic)]  # the leaves
        if set_critic:
            raise ConfigError(
                f"sets the critic ({', '.join(set_critic[:3])}), but the algorithm is {t.algorithm!r} "
                f"(models.policy_trainer.algorithm; advantage_estimator {t.advantage_estimator!r}), which uses no "
                "critic. Set algorithm: ppo (PPO with the critic, advantage_estimator gae), or remove the "
                "models.critic section.",
                key=set_critic[0])
        for key in PPO_KEYS:
            if t[key] != getattr(PolicyTrainer, key):
                raise ConfigError(f"is read only by PPO (algorithm: ppo, advantage_estimator: gae), but the algorithm "
                                  f"is {t.algorithm!r}. Remove it, or set algorithm: ppo.",
                                  key=f"{PT}.{key}")
        return
    for key in ("gamma", "lam"):
        if not 0 <= t[key] <= 1:
            raise ConfigError(f"must be in [0, 1], got {t[key]}.", key=f"{PT}.{key}")
    if t.filter_equal_groups:
        raise ConfigError("drops groups of equal rewards, whose group-relative advantages are 0; with "
                          "advantage_estimator: gae the critic gives every token an advantage. Set it to false, or "
                          "use a group-relative estimator (grpo, dr_grpo, rloo).", key=f"{PT}.filter_equal_groups")
    if not c.trainable:
        raise ConfigError("must be True: the critic learns the values.", key="models.critic.trainable")
    for key in POLICY_LOSS_KEYS:
        if c[key] != getattr(Critic, key):
            raise ConfigError(f"is a key of the policy's loss; the critic's loss is the value loss (cliprange_value, "
                              f"value_loss_coef, loss_agg_mode). Remove it from models.critic (set it on "
                              f"{PT} if it was meant for the policy).", key=f"models.critic.{key}")
    opt = c.optimizer
    if opt.lr <= 0:
        raise ConfigError("must be > 0.", key="models.critic.optimizer.lr")
    if opt.clip_grad <= 0:
        raise ConfigError("must be > 0.", key="models.critic.optimizer.clip_grad")
    _positive(opt.max_nonfinite_steps, "models.critic.optimizer.max_nonfinite_steps")
    if not 0 <= opt.min_lr <= opt.lr:
        raise ConfigError(f"must be in [0, lr] (lr = {opt.lr}), got {opt.min_lr}.",
                          key="models.critic.optimizer.min_lr")
    if c.cliprange_value is not None and not c.cliprange_value > 0:
        raise ConfigError(f"must be > 0 (the largest change of a value from the one the episode computed), or "
                          f"null: no clipping; got {c.cliprange_value}.", key="models.critic.cliprange_value")
    if not c.value_loss_coef > 0:
        raise ConfigError(f"must be > 0, got {c.value_loss_coef}.", key="models.critic.value_loss_coef")
    if not 0 <= c.warmup_episodes < rt.num_episode:
        raise ConfigError(f"must be in [0, runtime_args.num_episode) = [0, {rt.num_episode}) (episodes that train the "
                          f"critic alone before the policy learns), got {c.warmup_episodes}.",
                          key="models.critic.warmup_episodes")


def check_reward_model_keys(cfg) -> None:
    """The reward models' keys (``models.reward.load``'s and those of kind reward_model), without reading
    their folders (see :func:`check_reward_model_folder`)."""
    r, rt = cfg.models.reward, cfg.runtime_args
    if r.load is None:
        for key in REWARD_MODEL_KEYS:
            if r[key] != getattr(Reward, key):
                raise ConfigError("is read only with a reward model (models.reward.load). Remove it, or set "
                                  "models.reward.load to a sequence-classification model folder.",
                                  key=f"models.reward.{key}")
    names = models_of(cfg, REWARD_MODEL)
    for name in names:
        s = reward_model_settings(cfg, name)
        if s.num_gpu < 1:
            colocation = "reward" if name == REWARD_MODEL.default_model else name
            raise ConfigError(f"is 0, but {s.key} runs a reward model, which needs devices: set it, e.g. "
                              f"{s.key}.num_gpu=${{models.policy_trainer.num_gpu}} and name {colocation} in "
                              "runtime_args.colocation to let it take turns with the other models.",
                              key=f"{s.key}.num_gpu")
        if cfg.models[section(name)].gpu_per_process not in (None, 1):
            raise ConfigError("must be 1: each Ray actor of the reward model drives one device.",
                              key=f"{s.key}.gpu_per_process")
        spelled = "model_" if name == REWARD_MODEL.default_model else ""
        _choice(s.normalize, NORMALIZATIONS, f"{s.key}.{spelled}normalize")
        _positive(s.micro_batch_size, f"{s.key}.{spelled}micro_batch_size")
    if names and (rt.dynamic_sampling or rt.max_staleness > 0):
        key = "runtime_args.dynamic_sampling" if rt.dynamic_sampling else "runtime_args.max_staleness"
        raise ConfigError(f"cannot be combined with a reward model ({', '.join(names)}) in this build: a reward "
                          "model scores an episode's samples as a stage of the episode, not on the rollout thread "
                          "or between sampling rounds. Turn it off, or score with reward functions only.", key=key)


def check_reward_model_folder(cfg, name: str, longest: int) -> None:
    """Reward model ``name``'s ``load`` (a resolved local folder) holds a sequence-classification model with one
    score, a context of at least ``longest`` tokens (prompt + response, the policy's), and a tokenizer that
    renders a conversation."""
    r = reward_model_settings(cfg, name)
    key = f"{r.key}.load"
    with open(os.path.join(r.load, "config.json"), encoding="utf-8") as f:
        conf = json.load(f)
    archs = conf.get("architectures") or []
    labels = conf.get("num_labels", len(conf.get("id2label") or {}) or None)
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ConfigError(f"{r.load!r} is not a reward model: its config.json declares {archs or 'no architecture'}, "
                          "not a *ForSequenceClassification model with a score head. Point it at a sequence-"
                          "classification reward model (e.g. Skywork-Reward, Qwen2.5-Math-RM), or train one "
                          "(tools/build_reward_model_assets.py shows how for the toy task).", key=key)
    if labels not in (None, 1):
        raise ConfigError(f"{r.load!r} scores {labels} labels; a reward model gives one number per conversation "
                          "(num_labels 1). Use a reward model with a single score head.", key=key)
    limit = model_context_length(r.load)
    if limit is not None and limit < longest:
        raise ConfigError(f"the reward model takes {limit} tokens ({r.load}/config.json), fewer than the policy's "
                          f"longest prompt + response ({longest} tokens, models.policy). Use a reward model with a "
                          "longer context, or lower models.policy.max_prompt_tokens_length / "
                          "max_response_tokens_length.", key=key)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(r.load, trust_remote_code=r.trust_remote_code)
    except Exception as err:  # noqa: BLE001 - any failure to load is the user's folder
        raise ConfigError(f"the reward model's tokenizer in {r.load!r} does not load ({type(err).__name__}: {err}). "
                          "Add the tokenizer files of the reward model to the folder.", key=key) from None
    vocab = conf.get("vocab_size")
    if isinstance(vocab, int) and len(tok) > vocab:
        raise ConfigError(f"the reward model's tokenizer in {r.load!r} has {len(tok)} tokens (ids up to {len(tok) - 1}), "
                          f"more than the {vocab} rows of its embedding (vocab_size in {r.load}/config.json): a "
                          "conversation holding one of the extra tokens would index past the embedding in the first "
                          "scoring. Put the reward model's own tokenizer in the folder, or resize its embeddings to the "
                          "tokenizer (resize_token_embeddings) and save it again.", key=key)
    if tok.pad_token is None and tok.eos_token is None:
        raise ConfigError(f"the reward model's tokenizer in {r.load!r} has neither a pad nor an eos token to pad "
                          "its batches with. Set pad_token in its tokenizer_config.json.", key=key)
    if tok.chat_template:
        probe = [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}]
        try:
            tok.apply_chat_template(probe, tokenize=False)
        except Exception as err:  # noqa: BLE001 - the template is the user's
            raise ConfigError(f"the reward model's chat template ({r.load}) cannot render a conversation of a user "
                              f"prompt and an assistant response ({type(err).__name__}: {err}). Fix the template in "
                              "its tokenizer_config.json / chat_template.jinja.", key=key) from None
