"""Policy losses, KL estimators, loss aggregation, advantage estimators and the learning-rate
schedule against direct reference implementations written with plain loops / numpy."""
import math
import os

import numpy as np
import pytest
import torch
from backend_specs import trainer_spec

from chatlearn.algorithms.advantages import compute_advantages, episode_advantages, sequence_kl
from chatlearn.algorithms.grpo import (
    LOSS_AGG_MODES,
    LOSS_SUMS,
    GRPOLoss,
    policy_loss,
    sample_loss_coefficients,
    token_sums,
)
from chatlearn.algorithms.kl import kl_penalty
from chatlearn.algorithms.lr_schedule import learning_rate, resolve_schedule
from chatlearn.config import load as config_load
from chatlearn.errors import ConfigError
from conftest import REPO

TEMPLATE = os.path.join(REPO, "template", "grpo_fsdp.yaml")


def ragged(seed=0, n=8, max_len=7):
    """A batch layout: prompts 1..4 tokens, responses 1..max_len tokens."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(1, 5, n)
    rlen = rng.integers(1, max_len + 1, n)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(plen + rlen, out=offsets[1:])
    return offsets, plen.astype(np.int64), rlen


# --------------------------------------------------------------------------- policy losses

def ref_ppo(logp, old, adv, pos, neg, c=None):
    """Per-token (loss, clipped, clipped_lower) with plain floats (verl's compute_policy_loss)."""
    out = []
    for lp, o, a in zip(logp, old, adv):
        ratio = math.exp(lp - o)
        l1, l2 = -a * ratio, -a * min(max(ratio, 1 - neg), 1 + pos)
        loss = max(l1, l2)
        lower = False
        if c is not None and a < 0:
            lower = loss > -a * c
            loss = min(loss, -a * c)
        out.append((loss, l2 > l1, lower))
    return out


def test_dual_clip_matches_loops():
    g = torch.Generator().manual_seed(0)
    n = 400
    logp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(n, generator=g, dtype=torch.float64) * 1.5  # large ratios
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[:10] = 0.0
    loss, clipped, lower = policy_loss(logp, old, adv, 0.28, 0.2, clip_ratio_c=3.0)
    expect = ref_ppo(logp.tolist(), old.tolist(), adv.tolist(), 0.28, 0.2, 3.0)
    for j, (lj, cj, lo) in enumerate(expect):
        assert loss[j].item() == pytest.approx(lj, rel=1e-12, abs=1e-12)
        assert bool(clipped[j]) == cj and bool(lower[j]) == lo
    assert lower.any() and not lower.all() and not lower[adv >= 0].any()
    # without dual clip: the plain PPO-clip loss, no lower clipping
    loss0, _, lower0 = policy_loss(logp, old, adv, 0.28, 0.2)
    assert not lower0.any()
    assert torch.all(loss <= loss0) and torch.any(loss < loss0)
    # a dual-clipped token gives no gradient
    lp = logp.clone().requires_grad_()
    out, _, low = policy_loss(lp, old, adv, 0.28, 0.2, clip_ratio_c=3.0)
    out.sum().backward()
    assert torch.all(lp.grad[low] == 0)


def test_gspo_matches_loops_and_the_sequence_objective_gradient():
    g = torch.Generator().manual_seed(1)
    lens = [3, 1, 5, 4, 2]
    seq = torch.tensor([i for i, n in enumerate(lens) for _ in range(n)])
    n = len(seq)
    logp = -torch.rand(n, generator=g, dtype=torch.float64) * 2
    old = logp + torch.randn(n, generator=g, dtype=torch.float64) * 0.3
    adv_seq = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.0], dtype=torch.float64)
    adv = adv_seq[seq]
    pos, neg = 0.05, 0.04
    lp = logp.clone().requires_grad_()
    loss, clipped, _ = policy_loss(lp, old, adv, pos, neg, seq=seq)
    # values: every token of sample i carries the sequence-level loss of s_i
    start = 0
    for i, m in enumerate(lens):
        diffs = [float(logp[t] - old[t]) for t in range(start, start + m)]
        s = math.exp(sum(diffs) / m)
        a = float(adv_seq[i])
        l1, l2 = -a * s, -a * min(max(s, 1 - neg), 1 + pos)
        for t in range(start, start + m):
            assert loss[t].item() == pytest.approx(max(l1, l2), rel=1e-12)
            assert bool(clipped[t]) == (l2 > l1)
        start += m
    assert clipped.any() and not clipped.all()
    # gradient: the token mean per sequence, averaged over sequences, is GSPO's sequence
    # objective -mean_i min(s_i A_i, clip(s_i) A_i) with s_i a function of the log-probs
    per_seq = torch.zeros(len(lens), dtype=torch.float64).index_add(0, seq, loss)
    (per_seq / torch.tensor(lens, dtype=torch.float64)).mean().backward()
    ref_lp = logp.clone().requires_grad_()
    terms = []
    start = 0
    for i, m in enumerate(lens):
        s = torch.exp((ref_lp[start:start + m] - old[start:start + m]).mean())
        a = adv_seq[i]
        terms.append(-torch.minimum(s * a, torch.clamp(s, 1 - neg, 1 + pos) * a))
        start += m
    torch.stack(terms).mean().backward()
    torch.testing.assert_close(lp.grad, ref_lp.grad, rtol=1e-10, atol=1e-12)
    assert lp.grad.abs().sum() > 0


# --------------------------------------------------------------------------- KL

@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_match_loops(estimator):
    g = torch.Generator().manual_seed(2)
    logp = -torch.rand(200, generator=g, dtype=torch.float64) * 4
    ref = -torch.rand(200, generator=g, dtype=torch.float64) * 4
    logp[0], ref[0] = -8.0, -1.0  # k3 = exp(7) - 8: clamped to 10 by low_var_kl
    logp[1], ref[1] = -60.0, 0.0  # log-ratio beyond the k3 clamp of 20
    kl = kl_penalty(logp, ref, estimator)
    for j in range(200):
        d = float(logp[j] - ref[j])
        k3 = math.exp(min(max(-d, -20), 20)) + min(max(d, -20), 20) - 1
        expect = {"k1": d, "k2": 0.5 * d * d, "k3": k3, "low_var_kl": min(max(k3, -10), 10)}[estimator]
        assert kl[j].item() == pytest.approx(expect, rel=1e-12, abs=1e-12), j
    if estimator == "low_var_kl":
        assert kl[0].item() == 10.0
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl|one of"):
        kl_penalty(logp, ref, "k4")


def test_sequence_kl_sums_the_response_tokens():
    offsets, plen, _ = ragged(3)
    rng = np.random.default_rng(3)
    old = rng.normal(-1, 0.5, offsets[-1]).astype(np.float32)
    ref = rng.normal(-1, 0.5, offsets[-1]).astype(np.float32)
    got = sequence_kl(old, ref, offsets, plen, "k1")
    for i in range(len(plen)):
        expect = sum(float(old[t]) - float(ref[t]) for t in range(offsets[i] + plen[i], offsets[i + 1]))
        assert got[i] == pytest.approx(expect, rel=1e-9, abs=1e-9)


# --------------------------------------------------------------------------- aggregation

def ref_agg(loss_rows, weights, mode, max_len):
    """verl-style agg_loss over a padded [S, L] matrix with a token mask; rows of weight 0
    are masked out entirely (plain loops)."""
    S, L = len(loss_rows), max(len(r) for r in loss_rows)
    mat = np.zeros((S, L))
    mask = np.zeros((S, L))
    for i, row in enumerate(loss_rows):
        mat[i, :len(row)] = row
        mask[i, :len(row)] = 1.0 if weights[i] else 0.0
    kept = [i for i in range(S) if mask[i].sum() > 0]
    if mode == "token-mean":
        return (mat * mask).sum() / mask.sum()
    seq = []
    for i in kept:
        tok = [mat[i, t] for t in range(L) if mask[i, t]]
        seq.append({"seq-mean-token-mean": sum(tok) / len(tok), "seq-mean-token-sum": sum(tok),
                    "seq-mean-token-sum-norm": sum(tok) / max_len}[mode])
    return sum(seq) / len(seq)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_loss_aggregation_matches_padded_reference(mode):
    rng = np.random.default_rng(4)
    lens = rng.integers(1, 9, 10)
    weights = np.ones(10)
    weights[[2, 7]] = 0  # filtered samples
    rows = [rng.normal(size=n) for n in lens]
    coef = sample_loss_coefficients(mode, lens, weights, max_response_len=12)
    got = sum(coef[i] * rows[i].sum() for i in range(10))
    assert got == pytest.approx(ref_agg(rows, weights, mode, 12), rel=1e-12)
    assert np.all(coef[[2, 7]] == 0)
    assert np.all(sample_loss_coefficients(mode, lens, np.zeros(10), 12) == 0)


def _grpo_spec(**over):
    """A trainer spec for the loss alone (its loss fields set here)."""
    return trainer_spec(**{**dict(pos_clip_ratio=0.2, neg_clip_ratio=0.2, clip_ratio_c=3.0,
                                  policy_loss="vanilla", kl_coef=0.1, kl_estimator="k3",
                                  kl_in_reward=False, entropy_coef=0.01, loss_agg_mode="token-mean",
                                  max_response_tokens_length=10, old_logprobs="auto", rollout_correction="none",
                                  rollout_correction_level="token", rollout_is_threshold=2.0,
                                  rollout_is_threshold_lower=None), **over})


@pytest.mark.parametrize("gspo", [False, True])
def test_without_old_logprobs_the_forward_stands_for_them(gspo):
    """No ``old_logprobs``: the loss, its gradient and its sums equal those with old log-probs equal
    to the forward's own values (ratio 1, not a constant: the gradient flows); with
    ``rollout_logprobs`` the mismatch sums over every response token (sample weights left out),
    split over micro-batches in any order, and the max."""
    offsets, plen, rlen = ragged(6, n=8)
    rng = np.random.default_rng(6)
    T = int(offsets[-1])
    logp_np = rng.normal(-1, 0.3, T).astype(np.float32)
    rollout = (logp_np + rng.normal(0, 0.1, T)).astype(np.float32)
    batch = {"offsets": offsets, "prompt_lens": plen, "ref_logprobs": rng.normal(-1, 0.3, T).astype(np.float32),
             "advantages": rng.normal(size=8).astype(np.float32),
             "sample_weights": np.array([1, 0, 1, 1, 1, 1, 0, 1], np.float32)}
    spec = _grpo_spec(policy_loss="gspo" if gspo else "vanilla", entropy_coef=0.0)
    own = GRPOLoss(spec, dict(batch, rollout_logprobs=rollout), torch.device("cpu"))
    given = GRPOLoss(spec, dict(batch, old_logprobs=logp_np), torch.device("cpu"))
    assert own.tracks_rollout and not given.tracks_rollout
    pos = np.where(_mask(batch))[0]
    results = []
    for objective in (own, given):
        logp = torch.tensor(logp_np[pos], requires_grad=True)
        terms, coef, weight = objective.terms(logp, None, pos)
        loss = (terms["loss"] * coef).sum()
        grad, = torch.autograd.grad(loss, logp)
        results.append((loss.item(), grad, token_sums(terms, coef, weight, None)))
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)
    assert results[0][1].abs().sum() > 0
    torch.testing.assert_close(results[0][2][:7], results[1][2][:7], rtol=0, atol=0)
    d = logp_np[pos].astype(np.float64) - rollout[pos].astype(np.float64)
    sums = dict(zip(LOSS_SUMS, results[0][2].tolist()))
    assert sums["rollout_diff"] == pytest.approx(np.abs(d).sum(), rel=1e-12)
    assert sums["rollout_kl"] == pytest.approx((np.exp(d) - d - 1).sum(), rel=1e-9)
    assert sums["rollout_tokens"] == len(pos) == rlen.sum()
    assert own.rollout_diff_max.item() == pytest.approx(np.abs(d).max(), rel=1e-12)
    metrics = own.metrics(results[0][2].tolist(), own.rollout_diff_max.item())
    assert metrics["rollout_tokens"] == len(pos) and metrics["ratio_mean"] == 1.0
    assert "rollout_diff_sum" not in given.metrics(results[1][2].tolist(), 0.5)
    # micro-batches in any order add up to the same sums
    again = GRPOLoss(spec, dict(batch, rollout_logprobs=rollout), torch.device("cpu"))
    parts = []
    for mb in ([2, 0], [3, 1], [7, 5], [4, 6]):
        p = np.concatenate([np.arange(offsets[i] + plen[i], offsets[i + 1]) for i in mb])
        terms, coef, weight = again.terms(torch.tensor(logp_np[p]), None, p)
        parts.append(token_sums(terms, coef, weight, None))
    torch.testing.assert_close(sum(parts)[7:], results[0][2][7:], rtol=1e-12, atol=1e-12)
    assert again.rollout_diff_max.item() == own.rollout_diff_max.item()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("gspo", [False, True])
def test_rank_and_micro_batch_partial_sums_add_up_to_the_global_loss(mode, gspo):
    """Two "ranks" with micro-batches in any order: the sums of c * loss (and their
    gradients) add up to the loss of the whole batch computed in one piece."""
    offsets, plen, rlen = ragged(5, n=8)
    rng = np.random.default_rng(5)
    T = int(offsets[-1])
    batch = {"offsets": offsets, "prompt_lens": plen,
             "old_logprobs": rng.normal(-1, 0.3, T).astype(np.float32),
             "ref_logprobs": rng.normal(-1, 0.3, T).astype(np.float32),
             "advantages": rng.normal(size=8).astype(np.float32),
             "sample_weights": np.array([1, 0, 1, 1, 1, 1, 0, 1], np.float32)}
    spec = _grpo_spec(loss_agg_mode=mode, policy_loss="gspo" if gspo else "vanilla")
    objective = GRPOLoss(spec, batch, torch.device("cpu"))
    logp_all = torch.tensor(rng.normal(-1, 0.3, T), dtype=torch.float32, requires_grad=True)
    ent_all = torch.tensor(rng.uniform(0, 2, T), dtype=torch.float32)

    def part(samples):
        pos = np.concatenate([np.arange(offsets[i] + plen[i], offsets[i + 1]) for i in samples])
        terms, coef, weight = objective.terms(logp_all[pos], ent_all[pos], pos)
        return (terms["loss"] * coef).sum(), token_sums(terms, coef, weight, ent_all[pos])

    whole, whole_sums = part(range(8))
    grad_whole, = torch.autograd.grad(whole, logp_all)
    pieces = [part(mb) for mb in ([2, 0], [3, 1], [7, 5], [4, 6])]  # rank 0: 0-3, rank 1: 4-7
    total = sum(p[0] for p in pieces)
    grad_parts, = torch.autograd.grad(total, logp_all)
    assert total.item() == pytest.approx(whole.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(grad_parts, grad_whole, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(sum(p[1] for p in pieces), whole_sums, rtol=1e-5, atol=1e-6)
    # and the loss equals the padded reference of the per-token loss
    with torch.no_grad():
        terms, _, _ = objective.terms(logp_all[torch.from_numpy(np.where(_mask(batch))[0])],
                                      ent_all[torch.from_numpy(np.where(_mask(batch))[0])],
                                      np.where(_mask(batch))[0])
    per = terms["loss"].double().numpy()
    rows, start = [], 0
    for n in rlen:
        rows.append(per[start:start + n])
        start += n
    assert whole.item() == pytest.approx(ref_agg(rows, batch["sample_weights"], mode, 10), rel=1e-5)
    metrics = objective.metrics(whole_sums.tolist())
    assert set(metrics) == {"loss", "policy_loss", "clip_frac", "clip_frac_lower", "ratio_mean", "num_tokens",
                            "kl", "entropy"} and len(LOSS_SUMS) == 14
    assert metrics["num_tokens"] == rlen.sum()
    # ratio_mean: the token mean, over the kept samples, of the ratio the loss clips (the token ratio
    # exp(logp - old_logp), or with GSPO each sample's exp(mean over its tokens of logp - old_logp))
    mask = _mask(batch)
    diff = logp_all.detach().double().numpy()[mask] - batch["old_logprobs"].astype(np.float64)[mask]
    sample = np.repeat(np.arange(8), rlen)
    if gspo:
        diff = np.array([diff[sample == i].mean() for i in range(8)])[sample]
    kept = batch["sample_weights"][sample] > 0
    assert metrics["ratio_mean"] == pytest.approx(np.exp(diff[kept]).mean(), rel=1e-5)


def _mask(batch):
    from chatlearn.models.base import response_mask
    return response_mask(batch)


def test_kl_in_reward_drops_the_kl_loss_term():
    offsets, plen, _ = ragged(6, n=4)
    T = int(offsets[-1])
    rng = np.random.default_rng(6)
    batch = {"offsets": offsets, "prompt_lens": plen, "advantages": np.ones(4, np.float32),
             "old_logprobs": rng.normal(-1, 0.3, T).astype(np.float32),
             "ref_logprobs": rng.normal(-1, 0.3, T).astype(np.float32)}
    pos = np.where(_mask(batch))[0]
    logp = torch.tensor(batch["old_logprobs"][pos])
    on = GRPOLoss(_grpo_spec(entropy_coef=0.0), batch, torch.device("cpu")).terms(logp, None, pos)[0]
    off = GRPOLoss(_grpo_spec(entropy_coef=0.0, kl_in_reward=True), batch,
                   torch.device("cpu")).terms(logp, None, pos)[0]
    torch.testing.assert_close(off["loss"], off["pg"])
    torch.testing.assert_close(on["loss"], on["pg"] + 0.1 * on["kl"])
    assert on["kl"].abs().sum() > 0
    with pytest.raises(ValueError, match="ref_logprobs"):
        GRPOLoss(_grpo_spec(), {k: v for k, v in batch.items() if k != "ref_logprobs"},
                 torch.device("cpu"))


# --------------------------------------------------------------------------- advantages

def ref_advantages(rewards, G, estimator, lens, keep):
    out = []
    groups = [list(map(float, rewards[s:s + G])) for s in range(0, len(rewards), G)]
    xs = []
    for grp in groups:
        mean = sum(grp) / G
        for i, r in enumerate(grp):
            if estimator == "grpo":
                std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (G - 1))
                out.append(0.0 if all(x == grp[0] for x in grp) else (r - mean) / (std + 1e-6))
            elif estimator == "dr_grpo":
                out.append(r - mean)
            elif estimator == "rloo":
                out.append(r - sum(grp[j] for j in range(G) if j != i) / (G - 1))
            else:
                xs.append(r - mean)
    if estimator == "reinforce_plus_plus":  # verl's masked_whiten over the kept tokens
        toks = [x for x, n, k in zip(xs, lens, keep) for _ in range(int(n)) if k]
        mu = sum(toks) / len(toks)
        var = sum((t - mu) ** 2 for t in toks) / (len(toks) - 1)
        out = [(x - mu) / math.sqrt(var + 1e-8) for x in xs]
    return [a if k else 0.0 for a, k in zip(out, keep)]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus"])
def test_advantage_estimators_match_loops(estimator):
    rng = np.random.default_rng(7)
    G = 4
    rewards = rng.normal(size=24)
    rewards[8:12] = 1.0  # zero-variance group
    rewards[16:20] = [0, 1, 0, 0]
    lens = rng.integers(1, 9, 24)
    keep = np.ones(24, np.float32)
    keep[4:8] = 0  # a filtered group
    got = compute_advantages(rewards, G, estimator, lens, keep)
    assert got.dtype == np.float32 and got.shape == (24,)
    np.testing.assert_allclose(got, ref_advantages(rewards, G, estimator, lens, keep > 0),
                               rtol=1e-5, atol=1e-6)
    assert np.all(got[4:8] == 0)
    if estimator != "reinforce_plus_plus":
        assert np.allclose(got[8:12], 0)
    else:  # whitened: token-weighted mean 0 over the kept samples
        n = lens * keep
        assert abs((got * n).sum() / n.sum()) < 1e-5


def test_rloo_identity_and_single_sample_groups():
    r = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    got = compute_advantages(r, 3, "rloo", np.ones(6), np.ones(6))
    np.testing.assert_allclose(got, [1.0, -0.5, -0.5, 0.5, 0.5, -1.0])
    assert np.all(compute_advantages(r, 1, "grpo", np.ones(6), np.ones(6)) == 0)


def test_episode_advantages_kl_in_reward_and_filtering():
    offsets, plen, rlen = ragged(8, n=8)
    rng = np.random.default_rng(8)
    T = int(offsets[-1])
    batch = {"offsets": offsets, "prompt_lens": plen,
             "old_logprobs": rng.normal(-1, 0.3, T).astype(np.float32),
             "ref_logprobs": rng.normal(-1, 0.3, T).astype(np.float32)}
    rewards = np.array([1, 1, 1, 1, 0, 1, 0, 0], np.float64)  # group 0 all equal
    adv, w, m = episode_advantages(batch, rewards, 4, estimator="dr_grpo", filter_equal_groups=True,
                                   kl_in_reward=True, kl_coef=0.5, kl_estimator="k3")
    penalty = []
    for i in range(8):
        s = 0.0
        for t in range(offsets[i] + plen[i], offsets[i + 1]):
            d = float(batch["ref_logprobs"][t]) - float(batch["old_logprobs"][t])
            s += math.exp(d) - d - 1
        penalty.append(0.5 * s)
    shaped = rewards - np.array(penalty)
    assert m["kl_in_reward_penalty"] == pytest.approx(np.mean(penalty), rel=1e-6)
    assert m["filtered_group_frac"] == 0.5
    np.testing.assert_array_equal(w, [0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_allclose(adv[4:], shaped[4:] - shaped[4:].mean(), rtol=1e-5, atol=1e-6)
    assert np.all(adv[:4] == 0)
    adv2, w2, m2 = episode_advantages(batch, rewards, 4, estimator="grpo", filter_equal_groups=False,
                                      kl_in_reward=False, kl_coef=0.5, kl_estimator="k3")
    assert m2 == {} and np.all(w2 == 1) and np.all(adv2[:4] == 0)


# --------------------------------------------------------------------------- learning rate

def test_learning_rate_formulas():
    kw = dict(lr=1.0, min_lr=0.1, warmup_iters=4, decay_iters=14, warmup_init=0.2)
    # warmup: linear from warmup_init, step 0 uses warmup_init (Megatron, HF warmup)
    for style in ("constant", "linear", "cosine"):
        assert learning_rate(0, decay_style=style, **kw) == pytest.approx(0.2)
        assert learning_rate(2, decay_style=style, **kw) == pytest.approx(0.6)
        assert learning_rate(4, decay_style=style, **kw) == pytest.approx(1.0)
    assert learning_rate(9, decay_style="constant", **kw) == 1.0
    assert learning_rate(100, decay_style="constant", **kw) == 1.0
    # linear: halfway through the decay (step 9 of 4..14) is the midpoint of lr and min_lr
    assert learning_rate(9, decay_style="linear", **kw) == pytest.approx(0.55)
    assert learning_rate(14, decay_style="linear", **kw) == pytest.approx(0.1)
    assert learning_rate(15, decay_style="linear", **kw) == 0.1
    # cosine: a quarter of the way, (1 + cos(pi / 4)) / 2 of the range
    assert learning_rate(6.5, decay_style="cosine", **kw) == pytest.approx(
        0.1 + 0.9 * (1 + math.sqrt(0.5)) / 2)
    assert learning_rate(9, decay_style="cosine", **kw) == pytest.approx(0.55)
    assert learning_rate(14, decay_style="cosine", **kw) == pytest.approx(0.1)
    assert learning_rate(30, decay_style="cosine", **kw) == 0.1
    # no warmup: step 0 is lr
    assert learning_rate(0, decay_style="cosine", **{**kw, "warmup_iters": 0}) == 1.0
    assert resolve_schedule(3, 0.5, None, 20) == (3, 20)
    assert resolve_schedule(0, 0.25, 7, 18) == (4, 7)


# --------------------------------------------------------------------------- config

@pytest.mark.parametrize("override, key, text", [
    ("models.policy_trainer.loss_agg_mode=seq-mean", "models.policy_trainer.loss_agg_mode",
     "token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm"),
    ("models.policy_trainer.kl_estimator=k4", "models.policy_trainer.kl_estimator", "low_var_kl"),
    ("models.policy_trainer.advantage_estimator=ppo", "models.policy_trainer.advantage_estimator",
     "reinforce_plus_plus"),
    ("models.policy_trainer.clip_ratio_c=0.5", "models.policy_trainer.clip_ratio_c", "> 1"),
    ("models.policy_trainer.optimizer.lr_decay_style=cosin",
     "models.policy_trainer.optimizer.lr_decay_style", "Did you mean 'cosine'"),
    ("models.policy_trainer.optimizer.min_lr=1.0", "models.policy_trainer.optimizer.min_lr", "[0, lr]"),
    ("models.policy_trainer.optimizer.lr_warmup_fraction=1.5",
     "models.policy_trainer.optimizer.lr_warmup_fraction", "[0, 1]"),
])
def test_invalid_algorithm_keys_name_the_key(paths_overrides, override, key, text):
    with pytest.raises(ConfigError) as err:
        config_load.load_config(TEMPLATE, paths_overrides + [override])
    assert err.value.key == key and text in str(err.value) and "\n" not in str(err.value)


def test_warmup_must_end_before_the_decay_and_the_trainer_gets_resolved_steps(paths_overrides):
    with pytest.raises(ConfigError, match="must end before") as err:
        config_load.load_config(TEMPLATE, paths_overrides + [
            "models.policy_trainer.optimizer.lr_decay_style=linear",
            "models.policy_trainer.optimizer.lr_warmup_iters=500"])
    assert err.value.key == "models.policy_trainer.optimizer.lr_warmup_iters"
    from chatlearn.config.plan import make_plan
    from chatlearn.models.specs import TrainerSpec

    cfg = config_load.load_config(TEMPLATE, paths_overrides + [
        "models.policy_trainer.optimizer.lr_decay_style=cosine",
        "models.policy_trainer.optimizer.lr_warmup_fraction=0.1",
        "models.policy_trainer.loss_agg_mode=seq-mean-token-sum-norm"])
    total = cfg.runtime_args.num_episode * (cfg.runtime_args.sample_per_episode
                                            // cfg.runtime_args.train_global_batch_size)
    tcfg = TrainerSpec.from_config(cfg, "policy_trainer", make_plan(cfg))
    assert tcfg.lr_decay_iters == total and tcfg.lr_warmup_iters == int(0.1 * total)
    assert tcfg.loss_agg_mode == "seq-mean-token-sum-norm"
    assert tcfg.max_response_tokens_length == cfg.models.policy.max_response_tokens_length


def test_engine_sets_advantages_and_sample_weights_from_the_config():
    """GRPO's advantages (the episode's advantage step) with a stand-in for the run's plan."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from chatlearn.runtime.driver.algorithm import grpo
    from chatlearn.runtime.driver.sampling import Scored

    offsets, plen, _ = ragged(9, n=8)
    rng = np.random.default_rng(9)
    T = int(offsets[-1])
    batch = {"offsets": offsets, "prompt_lens": plen,
             "old_logprobs": rng.normal(-1, 0.3, T).astype(np.float32),
             "ref_logprobs": rng.normal(-1, 0.3, T).astype(np.float32)}
    rewards = np.array([0, 0, 0, 0, 1, 0, 1, 1], np.float64)
    trainer = dict(advantage_estimator="rloo", filter_equal_groups=True, kl_in_reward=True,
                   kl_coef=0.2, kl_estimator="k1")
    cfg = OmegaConf.create({"models": {"policy_trainer": trainer, "reward": {"overlong_buffer_len": 0}}})
    plan = SimpleNamespace(group_size=4, old_from_rollout=False, rollout_correction="none", old_logprob_pass_from=0)
    metrics = grpo(cfg, plan, calls=None, steps=None).advantages(batch, Scored(rewards, {}, rewards))
    assert set(metrics) == {"train/kl_in_reward_penalty", "train/filtered_group_frac"}
    assert metrics["train/filtered_group_frac"] == 0.5
    np.testing.assert_array_equal(batch["sample_weights"], [0, 0, 0, 0, 1, 1, 1, 1])
    shaped = rewards - 0.2 * sequence_kl(batch["old_logprobs"], batch["ref_logprobs"], offsets,
                                         plen, "k1")
    g = shaped[4:]
    loo = [g[i] - (g.sum() - g[i]) / 3 for i in range(4)]
    np.testing.assert_allclose(batch["advantages"][4:], loo, rtol=1e-5, atol=1e-6)
    assert np.all(batch["advantages"][:4] == 0) and batch["advantages"].dtype == np.float32
