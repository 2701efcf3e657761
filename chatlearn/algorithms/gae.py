"""PPO's advantage math, numpy only: the per-token rewards, Generalized Advantage Estimation over
each sample's response tokens, the masked whitening of the advantages and the critic's metrics.
The driver computes these; this module imports neither torch nor the loss module.

Every per-token array is aligned with ``batch["tokens"]`` (length T = ``offsets[-1]``). The tokens a
sample's recursion runs over are the ones :func:`~chatlearn.algorithms.response.response_mask`
covers: its response tokens less the observations a multi-turn rollout appended (``loss_mask`` 0).
Those observations are skipped entirely, as verl's multi-turn ``compute_gae_advantage_return``: they
neither add a TD error nor break the chain, which runs over the subsequence of covered tokens.
Outputs are float32 and 0 outside the covered tokens (prompts, observations).
"""
from __future__ import annotations

import numpy as np

from chatlearn.algorithms.response import WHITEN_EPS, response_mask
from chatlearn.config import registry


# ---------------------------------------------------------------------------- covered tokens
def _covered(batch: dict) -> tuple[np.ndarray, np.ndarray]:
    """``(idx, seg)``: the positions (int64 [M], ascending) of the covered tokens and the sample
    each belongs to (int64 [M], non-decreasing)."""
    idx = np.flatnonzero(response_mask(batch)).astype(np.int64)
    seg = np.searchsorted(np.asarray(batch["offsets"], dtype=np.int64), idx, side="right") - 1
    return idx, seg


def _last_of_sample(seg: np.ndarray) -> np.ndarray:
    """bool [M]: True on each sample's last covered token."""
    last = np.ones(seg.size, dtype=bool)
    last[:-1] = seg[1:] != seg[:-1]
    return last


# ---------------------------------------------------------------------------- rewards
def token_level_rewards(batch: dict, scores: np.ndarray, kl: np.ndarray | None = None,
                        kl_coef: float = 0.0) -> np.ndarray:
    """PPO's per-token reward (float32 [T]): each sample's score on its last covered token (the
    model's last token: before a trailing observation, if any), less the KL penalty on every
    covered token (InstructGPT; verl ``apply_kl_penalty``):

        r_t = score_i * [t = last covered token of i] - kl_coef * kl_t      (t covered)
        r_t = 0                                                              (elsewhere)

    A sample with no covered token gets nothing. ``kl`` (float [T]) is a per-token KL estimate
    (:func:`chatlearn.algorithms.kl.kl_penalty`); only its covered entries are read.
    """
    idx, seg = _covered(batch)
    out = np.zeros(int(batch["offsets"][-1]), dtype=np.float64)
    last = _last_of_sample(seg)
    out[idx[last]] = np.asarray(scores, dtype=np.float64)[seg[last]]
    if kl is not None:
        out[idx] -= kl_coef * np.asarray(kl, dtype=np.float64)[idx]
    return out.astype(np.float32)


# ---------------------------------------------------------------------------- GAE
def gae(batch: dict, rewards: np.ndarray, values: np.ndarray, gamma: float,
        lam: float) -> tuple[np.ndarray, np.ndarray]:
    """Generalized Advantage Estimation (Schulman et al. 2016; verl ``compute_gae_advantage_return``,
    multi-turn version). Per sample, over its covered tokens t_1 < ... < t_n (observations skipped),
    walking them in reverse, with V_{t_{n+1}} = 0 and A_{t_{n+1}} = 0:

        delta_{t_k} = r_{t_k} + gamma * V_{t_{k+1}} - V_{t_k}
        A_{t_k}     = delta_{t_k} + gamma * lam * A_{t_{k+1}}
        R_{t_k}     = A_{t_k} + V_{t_k}

    ``rewards`` and ``values`` are float [T] (:func:`token_level_rewards`, the critic's values).
    Returns ``(advantages, returns)``, float32 [T], 0 outside the covered tokens; computed in float64
    by a reverse scan over the position within the sample (one step per covered position of the
    longest sample, arrays across samples).
    """
    idx, seg = _covered(batch)
    total = int(batch["offsets"][-1])
    adv, ret = np.zeros(total, dtype=np.float32), np.zeros(total, dtype=np.float32)
    if idx.size == 0:
        return adv, ret
    r = np.asarray(rewards, dtype=np.float64)[idx]
    v = np.asarray(values, dtype=np.float64)[idx]
    has_next = ~_last_of_sample(seg)
    v_next = np.zeros_like(v)
    v_next[:-1] = np.where(has_next[:-1], v[1:], 0.0)
    delta = r + gamma * v_next - v
    # position of each covered token within its sample's covered subsequence
    first = np.ones(seg.size, dtype=bool)
    first[1:] = seg[1:] != seg[:-1]
    start = np.maximum.accumulate(np.where(first, np.arange(seg.size), 0))
    pos = np.arange(seg.size) - start
    order = np.argsort(pos, kind="stable")
    bounds = np.concatenate([[0], np.cumsum(np.bincount(pos))])
    a = np.zeros(seg.size + 1, dtype=np.float64)  # a[M] = 0: after each sample's last token
    nxt = np.where(has_next, np.arange(1, seg.size + 1), seg.size)[order]
    delta, coef = delta[order], gamma * lam
    for j in range(len(bounds) - 2, -1, -1):  # positions, last first
        lo, hi = bounds[j], bounds[j + 1]
        a[order[lo:hi]] = delta[lo:hi] + coef * a[nxt[lo:hi]]
    adv[idx] = a[:-1]
    ret[idx] = a[:-1] + v
    return adv, ret


# ---------------------------------------------------------------------------- whitening, metrics
def masked_whiten(values: np.ndarray, mask: np.ndarray, shift_mean: bool = True,
                  eps: float = WHITEN_EPS) -> np.ndarray:
    """verl's ``masked_whiten`` (float32, the shape of ``values``), over the entries of ``mask``:

        mu  = mean_m x,   var = sum_m (x - mu)^2 / (n - 1)     (unbiased, verl ``masked_var``)
        y   = (x - mu) / sqrt(var + eps)     (+ mu when not ``shift_mean``)

    0 outside the mask. With fewer than 2 masked entries (verl raises: the unbiased variance is
    undefined) every entry is 0. The mean is the exact one (verl divides by n + 1e-8).
    """
    x = np.asarray(values, dtype=np.float64)
    m = np.asarray(mask, dtype=bool)
    out = np.zeros(x.shape, dtype=np.float32)
    n = int(m.sum())
    if n < 2:
        return out
    xm = x[m]
    mu = xm.mean()
    var = ((xm - mu) ** 2).sum() / (n - 1)
    y = (xm - mu) / np.sqrt(var + eps)
    out[m] = y if shift_mean else y + mu
    return out


def explained_variance(returns: np.ndarray, values: np.ndarray, mask: np.ndarray) -> float:
    """How much of the returns the critic explains, over the entries of ``mask`` (population
    variances):

        EV = 1 - Var[R - V] / Var[R]

    1 for a perfect critic, 0 for one that predicts the mean, negative for worse. NaN when there is
    no masked entry or Var[R] is 0 (constant returns: the ratio is undefined)."""
    m = np.asarray(mask, dtype=bool)
    if not m.any():
        return float("nan")
    r = np.asarray(returns, dtype=np.float64)[m]
    v = np.asarray(values, dtype=np.float64)[m]
    var_r = r.var()
    if var_r == 0:
        return float("nan")
    return float(1.0 - (r - v).var() / var_r)


def _masked_mean(x: np.ndarray, m: np.ndarray) -> float:
    return float(np.asarray(x, dtype=np.float64)[m].mean()) if m.any() else float("nan")


def value_metrics(batch: dict, values: np.ndarray, returns: np.ndarray) -> dict:
    """The critic's metrics over the covered tokens: ``values_mean``, ``returns_mean`` and
    ``explained_variance`` (:func:`explained_variance`); the means are NaN with no covered token."""
    m = response_mask(batch)
    return {"values_mean": _masked_mean(values, m), "returns_mean": _masked_mean(returns, m),
            "explained_variance": explained_variance(returns, values, m)}


@registry.ADVANTAGE_ESTIMATORS.register("gae")
def episode_gae(batch: dict, scores: np.ndarray, gamma: float, lam: float, whiten: bool = True,
                kl: np.ndarray | None = None, kl_coef: float = 0.0) -> tuple[np.ndarray, np.ndarray, dict]:
    """PPO's advantages of an episode: :func:`token_level_rewards` from the sequence ``scores``
    (float [N]) and, when given, the per-token ``kl`` (float [T]) times ``kl_coef``; then :func:`gae`
    with the critic's values ``batch["values"]`` (float [T]); then the advantages whitened over the
    covered tokens (:func:`masked_whiten`) when ``whiten``. The returns are not whitened
    (R = raw A + V, as verl). Returns ``(advantages float32 [T], returns float32 [T], metrics)``,
    metrics: ``advantages_mean`` (after whitening), ``returns_mean``, ``values_mean``,
    ``explained_variance`` (returns against the values the advantages used), ``token_reward_mean``
    (the mean over samples of each sample's summed token rewards) and, with ``kl``,
    ``kl_in_reward`` (the mean per-token KL over the covered tokens).
    """
    m = response_mask(batch)
    values = np.asarray(batch["values"], dtype=np.float64)
    rewards = token_level_rewards(batch, scores, kl, kl_coef)
    adv, ret = gae(batch, rewards, values, gamma, lam)
    if whiten:
        adv = masked_whiten(adv, m)
    off = np.asarray(batch["offsets"], dtype=np.int64)
    cum = np.concatenate([[0.0], np.cumsum(rewards, dtype=np.float64)])
    per_sample = cum[off[1:]] - cum[off[:-1]]
    metrics = {"advantages_mean": _masked_mean(adv, m), **value_metrics(batch, values, ret),
               "token_reward_mean": float(per_sample.mean()) if per_sample.size else float("nan")}
    if kl is not None:
        metrics["kl_in_reward"] = _masked_mean(kl, m)
    return adv, ret, metrics
