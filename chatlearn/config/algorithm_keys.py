"""Validation of the algorithm keys of ``models.policy_trainer`` (losses, KL, advantages,
learning-rate schedule); called by ``chatlearn.config.load.validate``. The names come from
:mod:`chatlearn.config.registry` (chatlearn.algorithms implements them)."""
from __future__ import annotations

import difflib

from chatlearn.config.checks import choice as _choice
from chatlearn.config.plan import resolve_rollout_correction, resolve_schedule
from chatlearn.config.schema import PolicyTrainer, Reward, RuntimeArgs
from chatlearn.config.registry import (ADVANTAGE_ESTIMATORS, GROUP_BASELINE_ESTIMATORS, KL_ESTIMATORS,
                                       LOSS_AGG_MODES, LR_DECAY_STYLES, POLICY_LOSSES, Registry)
from chatlearn.errors import ConfigError

PREFIX = "models.policy_trainer"
OLD_LOGPROB_SOURCES = ("auto", "recompute", "rollout")
ROLLOUT_CORRECTIONS = ("auto", "none", "tis", "mis", "decoupled")
CORRECTION_LEVELS = ("token", "sequence", "geometric")


def validate_algorithm(cfg, total_steps: int) -> None:
    """ConfigError for an invalid policy-loss, KL, advantage or schedule key;
    ``total_steps``: the policy's optimizer steps (num_episode x steps per episode, less the critic's warm-up
    episodes': :attr:`chatlearn.config.plan.Plan.policy_steps`)."""
    t = cfg.models.policy_trainer
    _choice(t.loss_agg_mode, LOSS_AGG_MODES.names, f"{PREFIX}.loss_agg_mode")
    _plugged_choice(t.kl_estimator, KL_ESTIMATORS, f"{PREFIX}.kl_estimator")
    _plugged_choice(t.advantage_estimator, ADVANTAGE_ESTIMATORS, f"{PREFIX}.advantage_estimator")
    _check_policy_loss(t)
    _choice(t.old_logprobs, OLD_LOGPROB_SOURCES, f"{PREFIX}.old_logprobs")
    _check_rollout_correction(t, cfg.runtime_args.max_staleness > 0)
    _check_dapo(cfg)
    if t.clip_ratio_c is not None and not t.clip_ratio_c > 1:
        raise ConfigError(f"must be > 1 (the dual-clip bound -A * clip_ratio_c of negative advantages), "
                          f"got {t.clip_ratio_c}; set null to turn dual clip off, or e.g. 3.0 as verl.",
                          key=f"{PREFIX}.clip_ratio_c")
    _check_group_size(t, cfg.models.policy.num_inference_per_prompt)
    opt, key = t.optimizer, f"{PREFIX}.optimizer"
    _choice(opt.lr_decay_style, LR_DECAY_STYLES.names, f"{key}.lr_decay_style")
    if opt.lr_warmup_iters < 0:
        raise ConfigError(f"must be >= 0, got {opt.lr_warmup_iters}.", key=f"{key}.lr_warmup_iters")
    if not 0 <= opt.lr_warmup_fraction <= 1:
        raise ConfigError(f"must be in [0, 1] (a share of the run's optimizer steps), got "
                          f"{opt.lr_warmup_fraction}.", key=f"{key}.lr_warmup_fraction")
    if not 0 <= opt.lr_warmup_init <= opt.lr:
        raise ConfigError(f"must be in [0, lr] (the warmup starts there and rises to lr = {opt.lr}), got "
                          f"{opt.lr_warmup_init}.", key=f"{key}.lr_warmup_init")
    if not 0 <= opt.min_lr <= opt.lr:
        raise ConfigError(f"must be in [0, lr] (decay ends there; lr = {opt.lr}), got {opt.min_lr}.",
                          key=f"{key}.min_lr")
    if opt.lr_decay_iters is not None and opt.lr_decay_iters < 1:
        raise ConfigError(f"must be a positive number of optimizer steps or null (the policy's {total_steps} "
                          f"steps over the run), got {opt.lr_decay_iters}.", key=f"{key}.lr_decay_iters")
    warmup, decay = resolve_schedule(opt.lr_warmup_iters, opt.lr_warmup_fraction, opt.lr_decay_iters,
                                     total_steps)
    if opt.lr_decay_style != "constant" and warmup >= decay:
        raise ConfigError(f"the warmup ({warmup} optimizer steps) must end before the decay does "
                          f"(lr_decay_iters: {decay} steps) for lr_decay_style {opt.lr_decay_style!r}. Lower "
                          "lr_warmup_iters / lr_warmup_fraction or raise lr_decay_iters.",
                          key=f"{key}.lr_warmup_iters")


def _check_policy_loss(t) -> None:
    """``policy_loss`` is a declared or plugged name, and agrees with ``use_group_sequence_policy`` (null follows
    it: :func:`chatlearn.models.specs.resolve_policy_loss`)."""
    if t.policy_loss is None:
        return
    _plugged_choice(t.policy_loss, POLICY_LOSSES, f"{PREFIX}.policy_loss")
    if t.use_group_sequence_policy and t.policy_loss != "gspo":
        raise ConfigError(f"is {t.policy_loss!r}, but {PREFIX}.use_group_sequence_policy: true asks for GSPO's "
                          "sequence-level ratio (policy_loss: gspo). Set one of the two: policy_loss alone, or "
                          "use_group_sequence_policy: true with policy_loss null.", key=f"{PREFIX}.policy_loss")


def _plugged_choice(value, registry: Registry, key: str) -> None:
    """``value`` is one of the registry's names, built in or plugged (the nearest one suggested otherwise; the
    message says how to add one of the user's own)."""
    if value in registry:
        return
    guess = difflib.get_close_matches(str(value), registry.names, n=1)
    hint = f" Did you mean {guess[0]!r}?" if guess else ""
    plugged = registry.plugged()
    mine = f"; plugged in by runtime_args.plugins: {', '.join(plugged)}" if plugged else ""
    raise ConfigError(f"{value!r} is not one of the {registry.kind}s (built in: {', '.join(registry.declared)}{mine})."
                      f"{hint} Fix the name, or register your own {registry.kind} in a module named in "
                      "runtime_args.plugins (docs/architecture.md, \"Plugins\").", key=key)


def _check_group_size(t, group: int) -> None:
    """Group-relative advantages need groups: with one sample per prompt the advantages of the
    estimators of :data:`~chatlearn.config.registry.GROUP_BASELINE_ESTIMATORS` are all 0 (no loss, no
    gradient), and filter_equal_groups drops every group."""
    if group >= 2 or t.algorithm == "gkd":  # gkd trains on no advantage (its loss is the divergence to a teacher)
        return
    if t.advantage_estimator in GROUP_BASELINE_ESTIMATORS:
        raise ConfigError(
            f"is {group}, but advantage_estimator: {t.advantage_estimator} ({PREFIX}.advantage_estimator) compares "
            "each response with the other responses to the same prompt (its group): with one response per prompt "
            "every advantage is 0, so the loss and the gradient norm are 0 every episode and the policy never "
            "changes. Sample at least 2 responses per prompt (8-32 is usual), or use an estimator that needs no "
            "group: reinforce_plus_plus (rewards whitened over the batch) or gae with a critic (models.critic; "
            "see template/ppo_fsdp.yaml).", key="models.policy.num_inference_per_prompt")
    if t.filter_equal_groups:
        raise ConfigError(f"filter_equal_groups would drop every group of one sample, but "
                          f"models.policy.num_inference_per_prompt is {group}. Sample at least 2 responses per "
                          "prompt.", key=f"{PREFIX}.filter_equal_groups")


def _check_rollout_correction(t, stale_rollouts: bool = False) -> None:
    """rollout_correction and its level and thresholds (see docs/rollout_correction.md)."""
    _choice(t.rollout_correction, ROLLOUT_CORRECTIONS, f"{PREFIX}.rollout_correction")
    _choice(t.rollout_correction_level, CORRECTION_LEVELS, f"{PREFIX}.rollout_correction_level")
    if not t.rollout_is_threshold > 1:
        raise ConfigError(f"must be > 1 (C: the largest importance weight kept), got {t.rollout_is_threshold}; "
                          "e.g. 2.0 as verl.", key=f"{PREFIX}.rollout_is_threshold")
    if resolve_rollout_correction(t, stale_rollouts) == "none":
        for name in ("rollout_correction_level", "rollout_is_threshold"):
            if t[name] != getattr(PolicyTrainer, name):
                raise ConfigError(f"is read only with a rollout correction, but rollout_correction is "
                                  f"{t.rollout_correction!r} (none in this run). Remove it, or set "
                                  "rollout_correction: tis, mis or decoupled.", key=f"{PREFIX}.{name}")
    lower = t.rollout_is_threshold_lower
    if lower is not None:
        if t.rollout_correction != "mis":
            raise ConfigError(f"is read only by rollout_correction: mis (the lower end of its band), but "
                              f"rollout_correction is {t.rollout_correction!r}. Remove it, or set "
                              "rollout_correction: mis.", key=f"{PREFIX}.rollout_is_threshold_lower")
        if not 0 <= lower < 1:
            raise ConfigError(f"must be in [0, 1) (mis masks the tokens whose ratio is below it), got {lower}; "
                              "null: 1 / rollout_is_threshold.", key=f"{PREFIX}.rollout_is_threshold_lower")
    if t.rollout_correction == "decoupled" and t.old_logprobs == "rollout":
        raise ConfigError("decoupled PPO clips against the proximal policy (the trainer's old log-probs) and "
                          "weights by proximal / behaviour; with old_logprobs: rollout the two are the same "
                          "policy. Use old_logprobs: auto (or recompute), or rollout_correction: tis or mis, "
                          "which old_logprobs: rollout supports.", key=f"{PREFIX}.rollout_correction")


def _check_dapo(cfg) -> None:
    """DAPO's dynamic sampling (runtime_args) and overlong reward shaping (models.reward)."""
    rt, r = cfg.runtime_args, cfg.models.reward
    group = cfg.models.policy.num_inference_per_prompt
    if rt.dynamic_sampling_max_rounds < 1:
        raise ConfigError(f"must be >= 1 (rounds of prompts sampled per episode, the first included), got "
                          f"{rt.dynamic_sampling_max_rounds}.", key="runtime_args.dynamic_sampling_max_rounds")
    if rt.dynamic_sampling and group < 2:
        raise ConfigError(f"keeps the groups whose rewards differ, but models.policy.num_inference_per_prompt is "
                          f"{group}: a group of one sample never does. Sample at least 2 responses per prompt.",
                          key="runtime_args.dynamic_sampling")
    if not rt.dynamic_sampling and rt.dynamic_sampling_max_rounds != RuntimeArgs.dynamic_sampling_max_rounds:
        raise ConfigError("is read only with runtime_args.dynamic_sampling: true. Remove it, or turn dynamic "
                          "sampling on.", key="runtime_args.dynamic_sampling_max_rounds")
    if r.overlong_buffer_len == 0 and r.overlong_penalty_factor != Reward.overlong_penalty_factor:
        raise ConfigError("is read only with models.reward.overlong_buffer_len > 0 (the shaping is off). Remove it, "
                          "or set overlong_buffer_len.", key="models.reward.overlong_penalty_factor")
    longest = cfg.models.policy.max_response_tokens_length
    if not 0 <= r.overlong_buffer_len < longest:
        raise ConfigError(f"must be in [0, models.policy.max_response_tokens_length) = [0, {longest}) (the last "
                          f"tokens of a response over which the penalty ramps; 0: off), got {r.overlong_buffer_len}.",
                          key="models.reward.overlong_buffer_len")
    if r.overlong_penalty_factor < 0:
        raise ConfigError(f"must be >= 0 (the penalty of a response of max_response_tokens_length tokens is minus "
                          f"it), got {r.overlong_penalty_factor}.", key="models.reward.overlong_penalty_factor")
