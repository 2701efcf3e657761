"""What a plugin module imports: the decorators that register an advantage estimator, a policy loss or a KL
estimator of the user's own, under a name the config then accepts.

Name the module in the config (``runtime_args.plugins: [my_pkg.my_rl]`` or ``[path/to/my_rl.py]``) and set the
key to the registered name (``models.policy_trainer.advantage_estimator: my_est``). chatlearn imports the module
in the driver before it validates the config, and in every trainer process before the model is built
(:mod:`chatlearn.config.plugins`); a plugged function is then called exactly where, and as, a built-in one of
its kind is. A name is defined once: a built-in name, or a name another module registered, is refused before
anything starts, naming both definitions. See docs/architecture.md, "Plugins".

This module imports neither torch nor numpy: the driver imports plugins before it knows whether it needs them.
"""
from __future__ import annotations

from typing import Callable, TypeVar

from chatlearn.config.registry import ADVANTAGE_ESTIMATORS, ALGORITHMS, KL_ESTIMATORS, POLICY_LOSSES, AlgorithmDecl

F = TypeVar("F", bound=Callable)

__all__ = ["register_advantage_estimator", "register_algorithm", "register_kl_estimator", "register_policy_loss"]


def register_advantage_estimator(name: str) -> Callable[[F], F]:
    """Decorator: the function is the advantage estimator ``name`` (``models.policy_trainer.advantage_estimator``).
    It runs in the driver, once per episode, with numpy arrays over the episode's N samples, the
    ``group_size`` samples of one prompt contiguous::

        fn(rewards, group_means, group_size, response_lens, keep) -> advantages

    ``rewards`` float64 [N] (the shaped rewards, after a KL-in-reward penalty), ``group_means`` float64 [N]
    (each sample's group mean), ``group_size`` int (``models.policy.num_inference_per_prompt``),
    ``response_lens`` int64 [N] (response tokens the loss covers), ``keep`` bool [N] (False: a sample that
    ``filter_equal_groups`` dropped). Returns one advantage per sample, float [N]: chatlearn sets the dropped
    samples' to 0 and gives every response token of a sample its sample's advantage (as ``grpo``, ``rloo``, ...
    in ``chatlearn/algorithms/advantages.py``)."""
    return ADVANTAGE_ESTIMATORS.plug(name)


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Decorator: the function is the policy loss ``name`` (``models.policy_trainer.policy_loss``). It runs in
    the trainer processes, on torch tensors over the response tokens of some samples (flat, sample after
    sample)::

        fn(logp, old_logp, advantages, seq, spec) -> (loss, clipped, clipped_lower, ratio)

    ``logp`` float32 [M] (the current log-probs, with gradient), ``old_logp`` float32 [M] (detached),
    ``advantages`` float32 [M] (each token's), ``seq`` int64 [M] (each token's sample, 0..S-1, a sample's tokens
    all in one call), ``spec`` the trainer's :class:`chatlearn.models.specs.TrainerSpec` (``pos_clip_ratio``,
    ``neg_clip_ratio``, ``clip_ratio_c``, ... as attributes). Returns tensors shaped like ``logp``: the per-token
    loss (chatlearn weights it by a rollout correction, adds the KL and entropy terms and aggregates it by
    ``loss_agg_mode``), bool masks of the tokens clipped (metric ``clip_frac``) and clipped by a dual clip
    (``clip_frac_lower``), and the ratio (``ratio_mean``). The built-ins are ``vanilla_policy_loss`` and
    ``gspo_policy_loss`` in ``chatlearn/algorithms/grpo.py``."""
    return POLICY_LOSSES.plug(name)


def register_kl_estimator(name: str) -> Callable[[F], F]:
    """Decorator: the function is the KL estimator ``name`` (``models.policy_trainer.kl_estimator``), called
    ``fn(logp, ref_logp) -> kl`` on torch tensors of the same shape (per-token log-probs of the policy and of the
    reference), returning the per-token estimate of KL(policy || reference): in the trainers' loss and, with
    ``kl_in_reward``, in the driver (float64 tensors). The built-ins are in ``chatlearn/algorithms/kl.py``."""
    return KL_ESTIMATORS.plug(name)


def register_algorithm(name: str, *, needs: tuple = (), estimators: tuple | None = None) -> Callable[[F], F]:
    """Decorator: the function builds the algorithm ``name`` (``models.policy_trainer.algorithm``). It runs in the
    driver when the run starts::

        fn(cfg, plan, calls, steps) -> chatlearn.runtime.driver.algorithm.Algorithm

    (the built-ins ``grpo`` and ``ppo`` in that module compose ``ComposedAlgorithm`` from its parts:
    ``PolicyUpdate``, ``CriticUpdate``, ``GroupAdvantages``, ``GAEAdvantages``; a plugin may reuse them or
    subclass ``Algorithm``). ``needs``: the kinds of model it needs beyond the policy's (``("critic",)`` places
    ``models.critic``); ``estimators``: the advantage estimators it claims as its own (the first is its
    default), or None for any that no other algorithm claims."""
    def attach(fn: F) -> F:
        doc = (fn.__doc__ or name).strip().splitlines()[0]
        ALGORITHMS.plug(name)(AlgorithmDecl(name, tuple(needs), None if estimators is None else tuple(estimators),
                                            fn, doc))
        return fn

    return attach
