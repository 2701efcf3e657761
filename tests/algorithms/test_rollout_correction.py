"""Rollout correction (truncated / masked importance sampling, decoupled PPO), the rollout engine's
log-probs as the old ones, and DAPO's overlong reward shaping and dynamic-sampling choice, against
numbers worked out by hand and against a plain padded reference written as verl's
``compute_rollout_importance_weights`` and AReaL's decoupled loss compute them."""
import math
import os

import numpy as np
import pytest
import torch
from backend_specs import trainer_spec

from chatlearn.algorithms.advantages import fill_groups, overlong_penalty, varied_groups
from chatlearn.algorithms.grpo import (LOSS_SUMS, GRPOLoss, correction_log_ratio, rollout_is_weights,
                                       token_sums)
from chatlearn.config import load as config_load
from chatlearn.errors import ConfigError
from conftest import REPO

TEMPLATE = os.path.join(REPO, "template", "grpo_fsdp.yaml")
LN = math.log


# --------------------------------------------------------------------------- the weights, by hand

def _weights(d, mode, level="token", seq=None, upper=2.0, lower=0.5, anchored=False):
    d = torch.tensor(d, dtype=torch.float64)
    seq = torch.zeros(len(d), dtype=torch.int64) if seq is None else torch.tensor(seq)
    log_rho = correction_log_ratio(d, torch.zeros_like(d), seq, level)
    w, clipped, masked = rollout_is_weights(log_rho, mode, upper, lower, anchored)
    return w.tolist(), clipped.tolist(), masked.tolist()


def test_token_level_weights_by_hand():
    # rho = 3, 0.5, 1, 0.25 (tokens of one sample), C = 2, band [0.5, 2]
    d = [LN(3), LN(0.5), 0.0, LN(0.25)]
    w, clipped, masked = _weights(d, "tis")
    assert w == pytest.approx([2.0, 0.5, 1.0, 0.25]) and clipped == [True, False, False, False]
    assert masked == [False] * 4
    w, clipped, masked = _weights(d, "mis")
    assert w == pytest.approx([0.0, 0.5, 1.0, 0.0]) and masked == [True, False, False, True]
    assert clipped == [False] * 4
    w, _, masked = _weights(d, "mis", lower=0.6)
    assert w == pytest.approx([0.0, 0.0, 1.0, 0.0]) and masked == [True, True, False, True]
    w, _, masked = _weights(d, "decoupled")  # AReaL: only rho above the cap is masked
    assert w == pytest.approx([0.0, 0.5, 1.0, 0.25]) and masked == [True, False, False, False]


def test_sequence_and_geometric_levels_by_hand():
    # sample 0: rho_t = 2, 2 -> sequence rho 4, geometric 2; sample 1: rho_t = 0.5 -> both 0.5
    d, seq = [LN(2), LN(2), LN(0.5)], [0, 0, 1]
    w, clipped, _ = _weights(d, "tis", "sequence", seq)
    assert w == pytest.approx([2.0, 2.0, 0.5]) and clipped == [True, True, False]
    w, clipped, _ = _weights(d, "tis", "geometric", seq)
    assert w == pytest.approx([2.0, 2.0, 0.5]) and clipped == [False, False, False]
    w, _, masked = _weights(d, "mis", "sequence", seq)  # 4 is outside [0.5, 2]: the whole sample goes
    assert w == pytest.approx([0.0, 0.0, 0.5]) and masked == [True, True, False]
    w, _, masked = _weights(d, "mis", "geometric", seq)
    assert w == pytest.approx([2.0, 2.0, 0.5]) and masked == [False, False, False]


def test_weights_against_the_behaviour_anchored_ratio_by_hand():
    # old_logprobs: rollout: the PPO ratio already holds rho, the weight is w / rho
    d = [LN(3), LN(0.5), LN(4)]
    w, clipped, _ = _weights(d, "tis", anchored=True)
    assert w == pytest.approx([2 / 3, 1.0, 0.5]) and clipped == [True, False, True]
    w, _, masked = _weights(d, "mis", anchored=True)
    assert w == pytest.approx([0.0, 1.0, 0.0]) and masked == [True, False, True]


def test_the_log_ratio_is_clamped_before_exp():
    w, clipped, _ = _weights([50.0, -50.0], "tis")
    assert w == pytest.approx([2.0, math.exp(-20)]) and clipped == [True, False]


# --------------------------------------------------------------------------- a plain padded reference

def ref_is_weights(prox, behav, mask, mode, level, upper, lower):
    """verl's compute_rollout_importance_weights (truncate / mask modes; token, sequence, geometric)
    and AReaL's behav_imp_weight_cap, on padded [S, L] arrays, one row at a time."""
    S, L = prox.shape
    w = np.zeros((S, L))
    for i in range(S):
        n = int(mask[i].sum())
        logr = prox[i, :n] - behav[i, :n]
        if level == "token":
            lr = logr
        elif level == "sequence":
            lr = np.full(n, logr.sum())
        else:
            lr = np.full(n, logr.sum() / n)
        rho = np.exp(np.clip(lr, -20, 20))
        for t in range(n):
            if mode == "tis":
                w[i, t] = min(rho[t], upper)
            elif mode == "mis":
                w[i, t] = rho[t] if lower <= rho[t] <= upper else 0.0
            else:  # decoupled (AReaL): behav_imp_weight masked above the cap
                w[i, t] = rho[t] if rho[t] <= upper else 0.0
    return w


def ref_loss(logp, old, adv, mask, w, sample_weights, clip=0.2):
    """token-mean over the kept samples of w * max(-A r, -A clip(r)), r = exp(logp - old)."""
    r = np.exp(logp - old)
    a = adv[:, None]
    per = np.maximum(-a * r, -a * np.clip(r, 1 - clip, 1 + clip)) * w
    m = mask * (np.asarray(sample_weights)[:, None] > 0)
    return (per * m).sum() / m.sum()


def _padded(values, offsets, plen):
    rows = [values[offsets[i] + plen[i]:offsets[i + 1]] for i in range(len(plen))]
    L = max(len(r) for r in rows)
    out, mask = np.zeros((len(rows), L)), np.zeros((len(rows), L))
    for i, r in enumerate(rows):
        out[i, :len(r)], mask[i, :len(r)] = r, 1
    return out, mask


def _spec(**over):
    """A trainer spec for the loss alone (its loss fields set here)."""
    return trainer_spec(**{**dict(pos_clip_ratio=0.2, neg_clip_ratio=0.2, clip_ratio_c=None,
                                  policy_loss="vanilla", kl_coef=0.0, kl_estimator="k3", kl_in_reward=False,
                                  entropy_coef=0.0, loss_agg_mode="token-mean", max_response_tokens_length=10,
                                  old_logprobs="auto", rollout_correction="none", rollout_correction_level="token",
                                  rollout_is_threshold=2.0, rollout_is_threshold_lower=None), **over})


def _batch(seed=3, n=6, spread=0.6):
    rng = np.random.default_rng(seed)
    plen = rng.integers(1, 4, n)
    rlen = rng.integers(1, 6, n)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(plen + rlen, out=offsets[1:])
    T = int(offsets[-1])
    old = rng.normal(-1.5, 0.4, T)
    batch = {"offsets": offsets, "prompt_lens": plen.astype(np.int64),
             "old_logprobs": old.astype(np.float32),
             "rollout_logprobs": (old + rng.normal(0, spread, T)).astype(np.float32),
             "advantages": rng.normal(size=n).astype(np.float32),
             "sample_weights": np.array([1, 1, 0, 1, 1, 1], np.float32)[:n]}
    logp = (old + rng.normal(0, 0.15, T)).astype(np.float32)
    return batch, logp


def _run(spec, batch, logp_all, pieces=None):
    objective = GRPOLoss(spec, batch, torch.device("cpu"))
    off, plen = batch["offsets"], batch["prompt_lens"]
    n = len(plen)
    pieces = pieces or [list(range(n))]
    total, sums = 0.0, torch.zeros(len(LOSS_SUMS), dtype=torch.float64)
    logp_t = torch.tensor(logp_all, requires_grad=True)
    for samples in pieces:
        pos = np.concatenate([np.arange(off[i] + plen[i], off[i + 1]) for i in samples])
        terms, coef, weight = objective.terms(logp_t[pos], None, pos)
        total = total + (terms["loss"] * coef).sum()
        sums += token_sums(terms, coef, weight, None)
    grad, = torch.autograd.grad(total, logp_t)
    metrics = objective.metrics(sums.tolist(), 0.0, float(objective.is_weight_max))
    return float(total.detach()), grad.numpy(), metrics


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["tis", "mis", "decoupled"])
def test_loss_and_metrics_match_the_padded_reference(mode, level):
    batch, logp = _batch()
    lower = 0.7 if mode == "mis" else None
    spec = _spec(rollout_correction=mode, rollout_correction_level=level, rollout_is_threshold_lower=lower,
                 rollout_is_threshold=1.5)
    off, plen = batch["offsets"], batch["prompt_lens"]
    P, mask = _padded(logp.astype(np.float64), off, plen)
    O, _ = _padded(batch["old_logprobs"].astype(np.float64), off, plen)
    B, _ = _padded(batch["rollout_logprobs"].astype(np.float64), off, plen)
    w = ref_is_weights(O, B, mask, mode, level, 1.5, 0.7)
    expected = ref_loss(P, O, batch["advantages"].astype(np.float64), mask, w, batch["sample_weights"])
    # micro-batches in any order add up to the whole (every sample whole within one)
    total, _, metrics = _run(spec, batch, logp, pieces=[[3, 0], [5, 1, 2], [4]])
    assert total == pytest.approx(expected, rel=1e-5)
    kept = mask * (batch["sample_weights"][:, None] > 0)
    assert metrics["is_weight_mean"] == pytest.approx((w * kept).sum() / kept.sum(), rel=1e-5)
    assert metrics["is_weight_max"] == pytest.approx(w[kept > 0].max(), rel=1e-5)
    d = O - B
    assert metrics["is_mismatch_kl"] == pytest.approx(((np.exp(d) - d - 1) * kept).sum() / kept.sum(), rel=1e-4)
    if mode == "tis":
        rho = w  # truncated: the clipped ones are those at the cap with rho > C
        raw = ref_is_weights(O, B, mask, "tis", level, np.inf, 0)
        assert metrics["is_clip_frac"] == pytest.approx(((raw > 1.5) * kept).sum() / kept.sum())
        assert "is_masked_frac" not in metrics and rho.max() <= 1.5 + 1e-9
    else:
        assert metrics["is_masked_frac"] == pytest.approx(((w == 0) * kept).sum() / kept.sum())
        if (mode, level) != ("decoupled", "geometric"):  # (no geometric-mean ratio above 1.5 here)
            assert 0 < metrics["is_masked_frac"] < 1  # the data exercise the mask
        assert "is_clip_frac" not in metrics


def test_without_a_correction_the_loss_and_metrics_are_unchanged():
    batch, logp = _batch()
    plain, grad_plain, m_plain = _run(_spec(), {k: v for k, v in batch.items() if k != "rollout_logprobs"}, logp)
    same, grad_same, m_same = _run(_spec(), batch, logp)
    assert plain == same and np.array_equal(grad_plain, grad_same) and m_plain == m_same
    assert not any(k.startswith("is_") for k in m_plain)


def test_first_step_without_old_logprobs_weights_by_its_own_forward():
    """old_logprobs: auto, first step: the proximal log-probs are the forward's own (detached), the
    ratio is 1 and the gradient of each kept token is -c_i * w_t * A_i (token-mean: c_i = 1 / T)."""
    batch, logp = _batch()
    own = {k: v for k, v in batch.items() if k != "old_logprobs"}
    spec = _spec(rollout_correction="tis", rollout_is_threshold=1.5)
    _, grad, metrics = _run(spec, own, logp)
    off, plen = batch["offsets"], batch["prompt_lens"]
    P, mask = _padded(logp.astype(np.float64), off, plen)
    B, _ = _padded(batch["rollout_logprobs"].astype(np.float64), off, plen)
    w = ref_is_weights(P, B, mask, "tis", "token", 1.5, 0)
    kept = mask * (batch["sample_weights"][:, None] > 0)
    G, _ = _padded(grad.astype(np.float64), off, plen)
    expected = -w * batch["advantages"][:, None] * kept / kept.sum()
    np.testing.assert_allclose(G, expected, rtol=1e-5, atol=1e-9)
    assert "rollout_diff_sum" in metrics  # and it reports the mismatch of its forward


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_rollout_logprobs_as_old_logprobs(mode):
    """old_logprobs: rollout: the PPO ratio is against the rollout engine's log-probs, and the
    correction weight is w(rho) / rho with rho = exp(sg(logp) - rollout): at the current weights the
    gradient of an unclipped token is then -c * w(rho) * A, as with a separate proximal policy."""
    batch, logp = _batch(spread=0.1)
    rollout = {k: v for k, v in batch.items() if k != "old_logprobs"}
    spec = _spec(old_logprobs="rollout", rollout_correction=mode, rollout_is_threshold=1.1,
                 rollout_is_threshold_lower=0.9 if mode == "mis" else None)
    total, grad, metrics = _run(spec, rollout, logp)
    off, plen = batch["offsets"], batch["prompt_lens"]
    P, mask = _padded(logp.astype(np.float64), off, plen)
    B, _ = _padded(batch["rollout_logprobs"].astype(np.float64), off, plen)
    rho = np.exp(P - B)
    w = ref_is_weights(P, B, mask, mode, "token", 1.1, 0.9) / np.where(mask > 0, rho, 1)
    adv = batch["advantages"].astype(np.float64)
    assert total == pytest.approx(ref_loss(P, B, adv, mask, w, batch["sample_weights"]), rel=1e-5)
    kept = mask * (batch["sample_weights"][:, None] > 0)
    a = adv[:, None]
    unclipped = np.where(a > 0, rho <= 1.2, rho >= 0.8)  # the surrogate's gradient passes
    G, _ = _padded(grad.astype(np.float64), off, plen)
    expected = -(w * rho) * a * unclipped * kept / kept.sum()
    np.testing.assert_allclose(G, expected, rtol=1e-4, atol=1e-9)
    assert metrics["rollout_tokens"] == mask.sum()  # every step reports its forward's mismatch
    with pytest.raises(ValueError, match="rollout_logprobs"):
        GRPOLoss(spec, {k: v for k, v in rollout.items() if k != "rollout_logprobs"}, torch.device("cpu"))


# --------------------------------------------------------------------------- DAPO

def ref_overlong(length, max_len, cache, factor):
    """verl's DAPO reward manager: exceed = len - (L_max - L_cache); min(-exceed / L_cache * f, 0)."""
    exceed = length - (max_len - cache)
    return min(-exceed / cache * factor, 0.0)


def test_overlong_penalty_by_hand_and_against_verl():
    lens = np.array([1, 12, 13, 14, 15, 16])
    got = overlong_penalty(lens, 16, 4, 1.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -0.75, -1.0])
    got = overlong_penalty(lens, 16, 4, 0.5)
    assert got.tolist() == pytest.approx([ref_overlong(n, 16, 4, 0.5) for n in lens])
    assert overlong_penalty(np.array([40]), 16, 4, 1.0).tolist() == [-1.0]  # capped at -f
    assert overlong_penalty(lens, 16, 0, 1.0).tolist() == [0.0] * 6


def test_dynamic_sampling_keeps_varied_groups_in_draw_order_then_fills():
    r0 = np.array([1, 1, 0, 1, 0, 0], float)  # groups of 2: equal, varied, equal
    r1 = np.array([0, 1, 1, 1, 1, 0], float)  # varied, equal, varied
    rounds = [varied_groups(r0, 2), varied_groups(r1, 2)]
    assert rounds[0].tolist() == [False, True, False] and rounds[1].tolist() == [True, False, True]
    assert fill_groups(rounds, 3) == [(0, 1), (1, 0), (1, 2)]
    assert fill_groups(rounds, 2) == [(0, 1), (1, 0)]
    # the rounds ran out: the kept groups, then the earliest equal-reward ones
    assert fill_groups(rounds, 5) == [(0, 1), (1, 0), (1, 2), (0, 0), (0, 2)]


# --------------------------------------------------------------------------- config

@pytest.mark.parametrize("overrides, key, text", [
    (["models.policy_trainer.rollout_correction=tiss"], "models.policy_trainer.rollout_correction", "'tis'"),
    (["models.policy_trainer.rollout_correction_level=seq"], "models.policy_trainer.rollout_correction_level",
     "token, sequence, geometric"),
    (["models.policy_trainer.rollout_is_threshold=1.0"], "models.policy_trainer.rollout_is_threshold", "> 1"),
    (["models.policy_trainer.rollout_correction=tis", "models.policy_trainer.rollout_is_threshold_lower=0.5"],
     "models.policy_trainer.rollout_is_threshold_lower", "rollout_correction: mis"),
    (["models.policy_trainer.rollout_correction=mis", "models.policy_trainer.rollout_is_threshold_lower=1.5"],
     "models.policy_trainer.rollout_is_threshold_lower", "[0, 1)"),
    (["models.policy_trainer.rollout_correction=decoupled", "models.policy_trainer.old_logprobs=rollout"],
     "models.policy_trainer.rollout_correction", "proximal"),
    (["models.policy_trainer.old_logprobs=rolout"], "models.policy_trainer.old_logprobs", "'rollout'"),
    (["runtime_args.dynamic_sampling_max_rounds=0"], "runtime_args.dynamic_sampling_max_rounds", ">= 1"),
    (["runtime_args.dynamic_sampling=true", "models.policy.num_inference_per_prompt=1",
      "runtime_args.sample_per_episode=128"], "runtime_args.dynamic_sampling", "at least 2"),
    (["models.reward.overlong_buffer_len=16"], "models.reward.overlong_buffer_len", "[0, 16)"),
    (["models.reward.overlong_buffer_len=4", "models.reward.overlong_penalty_factor=-1"],
     "models.reward.overlong_penalty_factor", ">= 0"),
    # read only with the feature they tune: refused without it
    (["models.policy_trainer.rollout_is_threshold=3"], "models.policy_trainer.rollout_is_threshold", "none in this run"),
    (["models.policy_trainer.rollout_correction=none", "models.policy_trainer.rollout_correction_level=sequence"],
     "models.policy_trainer.rollout_correction_level", "rollout_correction: tis, mis or decoupled"),
    (["runtime_args.dynamic_sampling_max_rounds=3"], "runtime_args.dynamic_sampling_max_rounds", "dynamic_sampling: true"),
    (["models.reward.overlong_penalty_factor=0.5"], "models.reward.overlong_penalty_factor", "overlong_buffer_len > 0"),
])
def test_invalid_correction_and_dapo_keys_name_the_key(paths_overrides, overrides, key, text):
    with pytest.raises(ConfigError) as err:
        config_load.load_config(TEMPLATE, paths_overrides + overrides)
    assert err.value.key == key and text in str(err.value) and "\n" not in str(err.value)


def test_plan_and_spec_carry_the_correction_and_the_old_logprob_source(paths_overrides):
    from chatlearn.config.plan import make_plan, resolve_rollout_correction
    from chatlearn.models.specs import TrainerSpec

    spec = config_load.load_config(TEMPLATE, paths_overrides)
    plan = make_plan(spec)
    assert plan.rollout_correction == "none" and not plan.old_from_rollout  # auto, synchronous: none
    assert resolve_rollout_correction(spec.models.policy_trainer, stale_rollouts=True) == "decoupled"
    spec = config_load.load_config(TEMPLATE, paths_overrides + [
        "models.policy_trainer.old_logprobs=rollout", "models.policy_trainer.rollout_correction=mis",
        "models.policy_trainer.rollout_correction_level=geometric"])
    plan = make_plan(spec)
    assert plan.old_from_rollout and not plan.old_logprob_pass and plan.rollout_correction == "mis"
    assert any("the rollout engine's, for every optimizer step" in line for line in plan.describe())
    spec = TrainerSpec.from_config(spec, "policy_trainer", plan)
    assert (spec.old_logprobs, spec.rollout_correction, spec.rollout_correction_level,
            spec.rollout_is_threshold, spec.rollout_is_threshold_lower) == ("rollout", "mis", "geometric", 2.0, None)


def test_plan_says_that_kl_in_reward_from_the_rollouts_logprobs_counts_the_engines_gap(paths_overrides):
    """kl_in_reward with old_logprobs: rollout takes its KL between the rollout engine's log-probs and the
    reference's: the plan printed at start (and by --dry-run) says so, and names the way to the trainer's."""
    from chatlearn.config.plan import make_plan

    kl = ["models.policy_trainer.kl_in_reward=true", "models.policy_trainer.kl_coef=0.05"]
    plan = make_plan(config_load.load_config(TEMPLATE, paths_overrides + kl + [
        "models.policy_trainer.old_logprobs=rollout"]))
    notes = [line for line in plan.describe() if "kl_in_reward" in line]
    assert plan.kl_in_reward_from_rollout and len(notes) == 1, plan.describe()
    for part in ("rollout engine's log-probs", "numerical gap", "train/mismatch_kl", "old_logprobs: recompute"):
        assert part in notes[0], notes[0]
    for other in (kl, kl + ["models.policy_trainer.old_logprobs=recompute"], [
            "models.policy_trainer.old_logprobs=rollout", "models.policy_trainer.kl_coef=0.05"]):
        plan = make_plan(config_load.load_config(TEMPLATE, paths_overrides + other))
        assert not plan.kl_in_reward_from_rollout and not any("kl_in_reward" in line for line in plan.describe())
