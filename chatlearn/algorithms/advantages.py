"""GRPO's episode-level math, numpy only: the advantage estimators, the KL-in-reward penalty and
the sample weights of an episode. The driver computes these; it imports neither torch nor this
package's loss module (:mod:`chatlearn.algorithms.grpo`, which imports this one). Only the KL-in-reward
penalty needs torch: :func:`sequence_kl` imports it, and the KL estimators of
:mod:`chatlearn.algorithms.kl`, when it is called.
"""
from __future__ import annotations

import numpy as np

from chatlearn.algorithms import gae  # noqa: F401  (registers "gae", PPO's per-token estimator)
from chatlearn.algorithms.response import (  # noqa: F401  (re-exported: where the loss modules and the trainers look)
    WHITEN_EPS,
    loss_token_counts,
    response_mask,
)
from chatlearn.config import registry
from chatlearn.errors import UserError

# the names are declared in chatlearn.config.registry (what the config accepts); the functions
# registered below implement them
ADVANTAGE_ESTIMATORS = registry.ADVANTAGE_ESTIMATORS.declared
# the group-relative ones, implemented here; gae (PPO: per-token, from a critic) is chatlearn.algorithms.gae's
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus")
# the declared ones that give per-token advantages instead (chatlearn.algorithms.gae); every other name, a plugged
# one too, is called by compute_advantages as the group-relative ones are
PER_TOKEN_ESTIMATORS = ("gae",)

# the names of the loss's rollout-mismatch sums (chatlearn.algorithms.grpo.loss_metrics) that the
# driver adds up over an episode's first optimizer steps: the sums of |logp - rollout_logp| and of the
# mismatch KL term, their count, and the largest difference
ROLLOUT_MISMATCH = ("rollout_diff_sum", "rollout_kl_sum", "rollout_tokens", "rollout_diff_max")


# ---------------------------------------------------------------------------- advantages
def group_advantages(rewards: np.ndarray, group_size: int, eps: float = 1e-6) -> np.ndarray:
    """GRPO advantages; the ``group_size`` samples of one prompt are contiguous.

        A_i = (r_i - mean_g) / (std_g + eps),   std_g = sqrt(sum_j (r_j - mean_g)^2 / (G - 1))

    (unbiased std, as ``torch.std`` and verl). A group whose rewards are all equal gets
    A = 0 exactly. With ``group_size == 1`` the std is undefined: every advantage is 0.
    Returns float32 [N].
    """
    g = _groups(rewards, group_size)
    if group_size == 1:
        return np.zeros(g.size, dtype=np.float32)
    mean = g.mean(axis=1, keepdims=True)
    std = g.std(axis=1, ddof=1, keepdims=True)
    adv = (g - mean) / (std + eps)
    adv[equal_groups(g.reshape(-1), group_size)] = 0.0  # exact zero for constant groups
    return adv.reshape(-1).astype(np.float32)


def _groups(rewards, group_size: int) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if group_size < 1 or r.size % group_size:
        raise ValueError(f"{r.size} rewards do not split into groups of {group_size}")
    return r.reshape(-1, group_size)


def equal_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """bool [N / group_size]: the groups whose rewards are all equal (DAPO's dynamic
    sampling drops them: their group-relative advantages are 0)."""
    g = _groups(rewards, group_size)
    return np.all(g == g[:, :1], axis=1)


def compute_advantages(rewards: np.ndarray, group_size: int, estimator: str,
                       response_lens: np.ndarray, sample_weights: np.ndarray) -> np.ndarray:
    """Advantages (float32 [N]) of the estimator ``estimator``; samples of one prompt are
    contiguous groups of ``group_size``; samples with weight 0 (filtered) get A = 0 and do
    not enter the batch statistics.

    - ``grpo`` (DeepSeekMath, Shao et al. 2024): :func:`group_advantages`.
    - ``dr_grpo`` (Dr. GRPO, Liu et al. 2025; verl ``norm_adv_by_std_in_grpo: False``):
      A_i = r_i - mean_g.
    - ``rloo`` (Ahmadian et al. 2024; verl ``rloo``): A_i = r_i - mean_{j != i} r_j
      = G / (G - 1) * (r_i - mean_g); 0 when G = 1.
    - ``reinforce_plus_plus`` (REINFORCE++-baseline, Hu 2025; verl
      ``reinforce_plus_plus_baseline``): x_i = r_i - mean_g (mean_g = 0 when G = 1), then
      whitened over the batch's response tokens as verl's ``masked_whiten``:
      A_i = (x_i - mu) / sqrt(var + 1e-8), mu and var the token-weighted (n_i = response
      length) mean and unbiased variance of the kept samples.
    - a plugged one (``runtime_args.plugins``, :func:`chatlearn.plugins.register_advantage_estimator`): its
      function, called and used exactly as the built-ins' below.
    """
    if estimator in PER_TOKEN_ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r} is not group-relative: it gives per-token advantages "
                         "from a critic's values (chatlearn.algorithms.gae.episode_gae)")
    g = _groups(rewards, group_size)
    keep = np.asarray(sample_weights, dtype=np.float64) > 0
    r = g.reshape(-1)
    mean = np.repeat(g.mean(axis=1), group_size)
    adv = np.asarray(registry.ADVANTAGE_ESTIMATORS.get(estimator)(r, mean, group_size, response_lens, keep),
                     dtype=np.float64)
    if adv.shape != r.shape:
        raise UserError(f"advantage estimator {estimator!r} returned an array of shape {adv.shape} for {r.size} "
                        f"samples. Return one advantage per sample (float [{r.size}], in the samples' order): see "
                        "chatlearn.plugins.register_advantage_estimator.")
    return np.where(keep, adv, 0.0).astype(np.float32)


# Each estimator (the built-ins below, and a plugged one: chatlearn.plugins.register_advantage_estimator):
# (rewards float64 [N], group means repeated [N], group_size, response_lens, keep bool [N]) -> float64 [N]
# (before the filtered samples are zeroed).
@registry.ADVANTAGE_ESTIMATORS.register("grpo")
def _grpo(r, mean, group_size, response_lens, keep):
    return group_advantages(r, group_size).astype(np.float64)


@registry.ADVANTAGE_ESTIMATORS.register("dr_grpo")
def _dr_grpo(r, mean, group_size, response_lens, keep):
    return r - mean


@registry.ADVANTAGE_ESTIMATORS.register("rloo")
def _rloo(r, mean, group_size, response_lens, keep):
    return (r - mean) * (group_size / (group_size - 1)) if group_size > 1 else 0.0 * r


@registry.ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def _reinforce_plus_plus(r, mean, group_size, response_lens, keep):
    x = r - mean if group_size > 1 else r.copy()
    n = np.asarray(response_lens, dtype=np.float64) * keep
    total = n.sum()
    adv = np.zeros_like(x)
    if total > 1:
        mu = (n * x).sum() / total
        var = (n * (x - mu) ** 2).sum() / total * total / (total - 1)
        adv = (x - mu) / np.sqrt(var + WHITEN_EPS)
    return adv



def token_kl(old_logprobs: np.ndarray, ref_logprobs: np.ndarray, estimator: str,
             loss_mask: np.ndarray | None = None) -> np.ndarray:
    """float64 [T]: ``kl_penalty(old, ref)`` of every token (0 where ``loss_mask``, when given, is 0): the
    per-token KL of the KL-in-reward penalty (GRPO sums it per sample, :func:`sequence_kl`; PPO takes it
    from each token's reward)."""
    import torch  # only with the KL in the reward: the driver otherwise runs without torch

    from chatlearn.algorithms.kl import kl_penalty

    kl = kl_penalty(torch.from_numpy(np.asarray(old_logprobs, np.float64)),
                    torch.from_numpy(np.asarray(ref_logprobs, np.float64)), estimator).numpy()
    if loss_mask is not None:
        kl = np.where(np.asarray(loss_mask, dtype=bool), kl, 0.0)
    return kl


def sequence_kl(old_logprobs: np.ndarray, ref_logprobs: np.ndarray, offsets: np.ndarray,
                prompt_lens: np.ndarray, estimator: str, loss_mask: np.ndarray | None = None) -> np.ndarray:
    """float64 [N]: sum over each sample's response tokens (those of ``loss_mask``, when given) of
    ``kl_penalty(old, ref)`` (:func:`token_kl`); the KL-in-reward penalty is ``kl_coef`` times it
    (InstructGPT / verl ``use_kl_in_reward``)."""
    kl = token_kl(old_logprobs, ref_logprobs, estimator, loss_mask)
    out = np.zeros(len(prompt_lens))
    for i in range(len(prompt_lens)):
        out[i] = kl[int(offsets[i] + prompt_lens[i]):int(offsets[i + 1])].sum()
    return out



def episode_advantages(batch: dict, rewards: np.ndarray, group_size: int, *, estimator: str,
                       filter_equal_groups: bool, kl_in_reward: bool, kl_coef: float,
                       kl_estimator: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """Advantages and sample weights of an episode's samples (groups of ``group_size``
    contiguous samples per prompt). Returns ``(advantages float32 [N], sample_weights
    float32 [N], metrics)``.

    - ``kl_in_reward`` (InstructGPT; verl ``use_kl_in_reward``): the reward becomes
      r_i - kl_coef * sum_{t in i} kl_t(old_logprobs, ref_logprobs) before the advantages
      (metric ``kl_in_reward_penalty``: the mean penalty per sample).
    - ``filter_equal_groups`` (DAPO's dynamic sampling): groups whose (raw) rewards are all
      equal get weight 0 (metric ``filtered_group_frac``: the share of such groups). The
      samples stay in the batch, so every optimizer step keeps its size and every rank its
      micro-steps, but they count nowhere in the loss (:class:`GRPOLoss`) nor in the batch
      statistics of the advantages.
    """
    offsets, prompt_lens = np.asarray(batch["offsets"]), np.asarray(batch["prompt_lens"])
    lens = loss_token_counts(batch)
    r = np.asarray(rewards, dtype=np.float64)
    metrics = {}
    if kl_in_reward:
        penalty = kl_coef * sequence_kl(batch["old_logprobs"], batch["ref_logprobs"], offsets,
                                        prompt_lens, kl_estimator, batch.get("loss_mask"))
        metrics["kl_in_reward_penalty"] = float(penalty.mean())
        r = r - penalty
    dropped = (equal_groups(rewards, group_size) if filter_equal_groups
               else np.zeros(r.size // group_size, dtype=bool))
    if filter_equal_groups:
        metrics["filtered_group_frac"] = float(dropped.mean())
    weights = np.repeat(~dropped, group_size).astype(np.float32)
    return compute_advantages(r, group_size, estimator, lens, weights), weights, metrics


# ---------------------------------------------------------------------------- DAPO
def overlong_penalty(response_lens: np.ndarray, max_response_len: int, buffer_len: int,
                     penalty_factor: float) -> np.ndarray:
    """float64 [N]: DAPO's overlong reward shaping (Yu et al. 2025, eq. 13; verl
    ``overlong_buffer``), added to each sample's reward. With L_max = ``max_response_len``,
    L_cache = ``buffer_len``, f = ``penalty_factor`` and |y| the response length:

        r_len = 0                                   |y| <= L_max - L_cache
        r_len = (L_max - L_cache - |y|) / L_cache * f    L_max - L_cache < |y| <= L_max
        r_len = -f                                  |y| > L_max

    (a linear ramp from 0 to -f over the last L_cache tokens). ``buffer_len`` 0: all zeros."""
    n = np.asarray(response_lens, dtype=np.float64)
    if buffer_len <= 0:
        return np.zeros_like(n)
    start = float(max_response_len - buffer_len)
    return np.clip((start - n) / float(buffer_len) * penalty_factor, -penalty_factor, 0.0)


def varied_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """bool [N / group_size]: the groups whose rewards are not all equal (non-zero variance), the
    ones DAPO's dynamic sampling keeps."""
    return ~equal_groups(rewards, group_size)


def fill_groups(rounds: list[np.ndarray], needed: int) -> list[tuple[int, int]]:
    """DAPO's dynamic sampling as a choice of groups: ``rounds[k]`` is bool [groups of round k], True
    for the groups kept (non-zero reward variance). Returns ``needed`` ``(round, group)`` pairs: the
    kept groups in the order they were drawn, then, when there are too few (the rounds ran out), the
    earliest other groups to fill the batch. Deterministic: it depends on the rewards only."""
    kept = [(k, int(g)) for k, r in enumerate(rounds) for g in np.flatnonzero(r)][:needed]
    if len(kept) < needed:
        rest = [(k, int(g)) for k, r in enumerate(rounds) for g in np.flatnonzero(~np.asarray(r))]
        kept += rest[:needed - len(kept)]
    return kept
