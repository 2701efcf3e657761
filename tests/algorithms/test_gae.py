"""PPO's advantage math (chatlearn.algorithms.gae) against plain references: a reversed python loop
over each sample's covered tokens, a numpy transcription of verl's padded multi-turn
``compute_gae_advantage_return``, and direct formulas for the whitening and the explained variance."""
import time

import numpy as np
import pytest

from chatlearn.algorithms.advantages import response_mask
from chatlearn.algorithms.gae import (
    episode_gae,
    explained_variance,
    gae,
    masked_whiten,
    token_level_rewards,
    value_metrics,
)

GAMMA_LAM = [(1.0, 1.0), (0.99, 0.95), (0.5, 0.5), (1.0, 0.95), (0.99, 1.0)]


def ragged_batch(seed=0, n=6, max_prompt=4, max_resp=9, multi_turn=False):
    """A random ragged batch: prompts 1..max_prompt tokens, responses 1..max_resp tokens; with
    ``multi_turn`` a ``loss_mask`` with runs of observation tokens (0) inside the responses."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(1, max_prompt + 1, n).astype(np.int64)
    rlen = rng.integers(1, max_resp + 1, n).astype(np.int64)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(plen + rlen, out=offsets[1:])
    total = int(offsets[-1])
    batch = {"tokens": rng.integers(0, 100, total), "offsets": offsets, "prompt_lens": plen,
             "values": rng.normal(size=total).astype(np.float32)}
    if multi_turn:
        lm = np.zeros(total, np.int64)
        for i in range(n):
            s, e = int(offsets[i] + plen[i]), int(offsets[i + 1])
            lm[s:e] = 1
            if e - s >= 3:  # an observation run strictly inside the response
                a = int(rng.integers(s + 1, e - 1))
                b = int(rng.integers(a + 1, e))
                lm[a:b] = 0
        batch["loss_mask"] = lm
    return batch


def covered_lists(batch):
    """Per sample, the positions of its covered tokens (the model's response tokens)."""
    off, plen = batch["offsets"], batch["prompt_lens"]
    lm = batch.get("loss_mask")
    return [[t for t in range(int(off[i] + plen[i]), int(off[i + 1])) if lm is None or lm[t]]
            for i in range(len(plen))]


def reference_gae(batch, rewards, values, gamma, lam):
    """The plain reversed loop over each sample's covered tokens (observations skipped)."""
    adv = np.zeros(int(batch["offsets"][-1]))
    ret = np.zeros_like(adv)
    for ts in covered_lists(batch):
        next_v, next_a = 0.0, 0.0
        for t in reversed(ts):
            delta = float(rewards[t]) + gamma * next_v - float(values[t])
            next_a = delta + gamma * lam * next_a
            next_v = float(values[t])
            adv[t], ret[t] = next_a, next_a + float(values[t])
    return adv, ret


def verl_padded_gae(batch, rewards, values, gamma, lam):
    """verl's padded multi-turn ``compute_gae_advantage_return`` transcribed with numpy over a
    [B, L] layout of the responses (right-padded, response_mask 0 on observations and padding);
    returns the per-token (unwhitened) advantages and returns scattered back to [T]."""
    off, plen = batch["offsets"], batch["prompt_lens"]
    rlen = np.diff(off) - plen
    B, L = len(plen), int(rlen.max())
    rm = response_mask(batch)
    token_level_rewards_ = np.zeros((B, L))
    values_ = np.zeros((B, L))
    response_mask_ = np.zeros((B, L))
    for i in range(B):
        s, e = int(off[i] + plen[i]), int(off[i + 1])
        token_level_rewards_[i, :e - s] = rewards[s:e]
        values_[i, :e - s] = values[s:e]
        response_mask_[i, :e - s] = rm[s:e]
    nextvalues = 0
    lastgaelam = 0
    advantages_reversed = []
    gen_len = token_level_rewards_.shape[-1]
    for t in reversed(range(gen_len)):
        delta = token_level_rewards_[:, t] + gamma * nextvalues - values_[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values_[:, t] * response_mask_[:, t] + (1 - response_mask_[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask_[:, t] + (1 - response_mask_[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = np.stack(advantages_reversed[::-1], axis=1)
    returns = advantages + values_
    adv, ret = np.zeros(int(off[-1])), np.zeros(int(off[-1]))
    for i in range(B):
        s, e = int(off[i] + plen[i]), int(off[i + 1])
        adv[s:e], ret[s:e] = advantages[i, :e - s], returns[i, :e - s]
    return np.where(rm, adv, 0.0), np.where(rm, ret, 0.0)


def random_rewards(batch, seed):
    rng = np.random.default_rng(seed + 100)
    return np.where(response_mask(batch), rng.normal(size=int(batch["offsets"][-1])), 0.0)


def prompt_positions(batch):
    off, plen = batch["offsets"], batch["prompt_lens"]
    return np.concatenate([np.arange(off[i], off[i] + plen[i]) for i in range(len(plen))])


# --------------------------------------------------------------------------- gae
@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
@pytest.mark.parametrize("seed", range(4))
def test_gae_matches_the_reference_loop(seed, gamma, lam):
    batch = ragged_batch(seed, n=7)
    rewards = random_rewards(batch, seed)
    adv, ret = gae(batch, rewards, batch["values"], gamma, lam)
    ref_adv, ref_ret = reference_gae(batch, rewards, batch["values"], gamma, lam)
    assert adv.dtype == np.float32 and ret.dtype == np.float32
    assert adv.shape == ret.shape == (int(batch["offsets"][-1]),)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)
    assert np.all(adv[prompt_positions(batch)] == 0) and np.all(ret[prompt_positions(batch)] == 0)
    assert np.abs(adv).sum() > 0  # the comparison is not of zeros


@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
@pytest.mark.parametrize("seed", range(4))
def test_multi_turn_gae_skips_observations(seed, gamma, lam):
    batch = ragged_batch(seed, n=8, max_resp=12, multi_turn=True)
    assert (batch["loss_mask"][np.concatenate(covered_lists({**batch, "loss_mask": None}))] == 0).any()
    rewards = random_rewards(batch, seed)
    adv, ret = gae(batch, rewards, batch["values"], gamma, lam)
    ref_adv, ref_ret = reference_gae(batch, rewards, batch["values"], gamma, lam)
    verl_adv, verl_ret = verl_padded_gae(batch, rewards, batch["values"], gamma, lam)
    np.testing.assert_allclose(ref_adv, verl_adv, rtol=1e-10, atol=1e-10)  # the two references agree
    np.testing.assert_allclose(ref_ret, verl_ret, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(adv, verl_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, verl_ret, rtol=1e-5, atol=1e-5)
    obs = ~response_mask(batch)
    assert np.all(adv[obs] == 0) and np.all(ret[obs] == 0)


def test_observations_do_not_break_the_chain():
    """One sample, prompt 1, response [m, o, o, m] (m model, o observation): gamma = lam = 1, reward 1
    on the last token, values 0 except huge values on the observations (which must be ignored)."""
    batch = {"tokens": np.zeros(5, np.int64), "offsets": np.array([0, 5]), "prompt_lens": np.array([1]),
             "loss_mask": np.array([0, 1, 0, 0, 1])}
    values = np.array([0.0, 0.5, 100.0, -100.0, 0.25])
    rewards = np.array([0.0, 0.0, 7.0, 7.0, 1.0])  # rewards on observations are ignored too
    adv, ret = gae(batch, rewards, values, 0.9, 0.5)
    # t=4: delta = 1 - 0.25 = 0.75; t=1: delta = 0 + 0.9 * 0.25 - 0.5 = -0.275, A = -0.275 + 0.45 * 0.75
    np.testing.assert_allclose(adv, [0, -0.275 + 0.45 * 0.75, 0, 0, 0.75], atol=1e-7)
    np.testing.assert_allclose(ret, [0, -0.275 + 0.45 * 0.75 + 0.5, 0, 0, 1.0], atol=1e-7)


@pytest.mark.parametrize("multi_turn", [False, True])
def test_gamma_lam_one_with_an_end_reward_gives_reward_minus_value(multi_turn):
    batch = ragged_batch(3, n=6, max_resp=10, multi_turn=multi_turn)
    scores = np.linspace(-1.0, 2.0, 6)
    rewards = token_level_rewards(batch, scores)
    adv, ret = gae(batch, rewards, batch["values"], 1.0, 1.0)
    for i, ts in enumerate(covered_lists(batch)):
        np.testing.assert_allclose(adv[ts], scores[i] - batch["values"][ts], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ret[ts], scores[i], rtol=1e-5, atol=1e-5)


def test_gae_is_fast_on_1e5_tokens():
    batch = ragged_batch(0, n=256, max_prompt=200, max_resp=700, multi_turn=True)
    assert int(batch["offsets"][-1]) > 80_000
    rewards = random_rewards(batch, 0)
    t0 = time.perf_counter()
    adv, _ = gae(batch, rewards, batch["values"], 0.99, 0.95)
    elapsed = time.perf_counter() - t0
    ref_adv, _ = verl_padded_gae(batch, rewards, batch["values"], 0.99, 0.95)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-4, atol=1e-4)
    assert elapsed < 2.0, elapsed


def test_gae_with_no_covered_token():
    batch = {"tokens": np.zeros(3, np.int64), "offsets": np.array([0, 3]), "prompt_lens": np.array([3])}
    adv, ret = gae(batch, np.zeros(3), np.ones(3), 0.99, 0.95)
    assert adv.dtype == np.float32 and not adv.any() and not ret.any()


# --------------------------------------------------------------------------- rewards
def test_token_level_rewards_put_the_score_on_the_last_model_token():
    # sample 0: prompt 2, response [m, m, m]; sample 1: prompt 1, response [m, m, o, o] (trailing
    # observations); sample 2: prompt 2, response [o] (no model token); sample 3: prompt 1, [m]
    batch = {"tokens": np.zeros(15, np.int64), "offsets": np.array([0, 5, 10, 13, 15]),
             "prompt_lens": np.array([2, 1, 2, 1]),
             "loss_mask": np.array([0, 0, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1])}
    scores = np.array([1.5, -2.0, 9.0, 0.25])
    r = token_level_rewards(batch, scores)
    expected = np.zeros(15)
    expected[4], expected[7], expected[14] = 1.5, -2.0, 0.25
    assert r.dtype == np.float32
    np.testing.assert_array_equal(r, expected.astype(np.float32))


def test_token_level_rewards_without_loss_mask_and_with_kl():
    batch = ragged_batch(5, n=5)
    rng = np.random.default_rng(1)
    kl = rng.normal(size=int(batch["offsets"][-1]))
    scores = rng.normal(size=5)
    r = token_level_rewards(batch, scores, kl=kl, kl_coef=0.1)
    expected = np.zeros(int(batch["offsets"][-1]))
    for i in range(5):
        s, e = int(batch["offsets"][i] + batch["prompt_lens"][i]), int(batch["offsets"][i + 1])
        expected[s:e] = -0.1 * kl[s:e]
        expected[e - 1] += scores[i]
    np.testing.assert_allclose(r, expected, rtol=1e-6, atol=1e-6)
    assert np.all(r[prompt_positions(batch)] == 0)
    np.testing.assert_array_equal(token_level_rewards(batch, scores, kl=kl, kl_coef=0.0),
                                  token_level_rewards(batch, scores))


def test_token_level_rewards_kl_only_on_model_tokens():
    batch = ragged_batch(6, n=5, max_resp=10, multi_turn=True)
    kl = np.ones(int(batch["offsets"][-1]))
    r = token_level_rewards(batch, np.zeros(5), kl=kl, kl_coef=0.5)
    np.testing.assert_array_equal(r, np.where(response_mask(batch), -0.5, 0.0).astype(np.float32))


# --------------------------------------------------------------------------- whitening, metrics
@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_the_formula(shift_mean):
    rng = np.random.default_rng(2)
    x = rng.normal(3.0, 2.0, size=50)
    mask = rng.random(50) < 0.6
    out = masked_whiten(x, mask, shift_mean=shift_mean)
    xm = x[mask]
    mean, var = xm.mean(), xm.var(ddof=1)
    expected = (x - mean) / np.sqrt(var + 1e-8) + (0.0 if shift_mean else mean)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out[mask], expected[mask], rtol=1e-5, atol=1e-6)
    assert np.all(out[~mask] == 0)
    if shift_mean:
        assert abs(out[mask].mean()) < 1e-5 and abs(out[mask].std(ddof=1) - 1) < 1e-4


def test_masked_whiten_with_fewer_than_two_entries_is_zero():
    x = np.array([1.0, 2.0, 3.0])
    assert not masked_whiten(x, np.array([False, True, False])).any()
    assert not masked_whiten(x, np.zeros(3, bool)).any()


def test_explained_variance():
    rng = np.random.default_rng(3)
    r = rng.normal(size=40)
    v = r + rng.normal(scale=0.3, size=40)
    mask = rng.random(40) < 0.7
    assert explained_variance(r, r, mask) == 1.0
    expected = 1 - np.var(r[mask] - v[mask]) / np.var(r[mask])
    assert explained_variance(r, v, mask) == pytest.approx(expected, rel=1e-12)
    assert explained_variance(r, np.full(40, r[mask].mean()), mask) == pytest.approx(0.0, abs=1e-12)
    assert np.isnan(explained_variance(np.ones(40), v, mask))
    assert np.isnan(explained_variance(r, v, np.zeros(40, bool)))


def test_value_metrics():
    batch = ragged_batch(4, n=6, multi_turn=True)
    rng = np.random.default_rng(4)
    ret = rng.normal(size=int(batch["offsets"][-1]))
    m = response_mask(batch)
    got = value_metrics(batch, batch["values"], ret)
    assert got["values_mean"] == pytest.approx(batch["values"][m].astype(np.float64).mean(), rel=1e-9)
    assert got["returns_mean"] == pytest.approx(ret[m].mean(), rel=1e-12)
    assert got["explained_variance"] == pytest.approx(explained_variance(ret, batch["values"], m), rel=1e-12)


# --------------------------------------------------------------------------- episode
@pytest.mark.parametrize("whiten", [True, False])
@pytest.mark.parametrize("multi_turn", [False, True])
def test_episode_gae(whiten, multi_turn):
    batch = ragged_batch(7, n=8, max_resp=11, multi_turn=multi_turn)
    rng = np.random.default_rng(7)
    total = int(batch["offsets"][-1])
    scores, kl = rng.normal(size=8), np.abs(rng.normal(size=total))
    adv, ret, metrics = episode_gae(batch, scores, 0.99, 0.95, whiten=whiten, kl=kl, kl_coef=0.05)
    m = response_mask(batch)
    rewards = np.zeros(total)
    for i, ts in enumerate(covered_lists(batch)):
        rewards[ts] = -0.05 * kl[ts]
        rewards[ts[-1]] += scores[i]
    ref_adv, ref_ret = verl_padded_gae(batch, rewards, batch["values"], 0.99, 0.95)
    if whiten:
        a = ref_adv[m]
        ref_adv = np.where(m, (ref_adv - a.mean()) / np.sqrt(a.var(ddof=1) + 1e-8), 0.0)
    assert adv.dtype == np.float32 and ret.dtype == np.float32
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)  # returns are never whitened
    assert metrics["advantages_mean"] == pytest.approx(ref_adv[m].mean(), abs=1e-5)
    assert metrics["returns_mean"] == pytest.approx(ref_ret[m].mean(), rel=1e-5)
    assert metrics["values_mean"] == pytest.approx(batch["values"][m].mean(), rel=1e-5)
    assert metrics["explained_variance"] == pytest.approx(
        1 - np.var(ref_ret[m] - batch["values"][m]) / np.var(ref_ret[m]), rel=1e-5)
    assert metrics["token_reward_mean"] == pytest.approx(rewards.sum() / 8, rel=1e-5)
    assert metrics["kl_in_reward"] == pytest.approx(kl[m].mean(), rel=1e-9)
    _, _, plain = episode_gae(batch, scores, 0.99, 0.95, whiten=whiten)
    assert "kl_in_reward" not in plain
    assert plain["token_reward_mean"] == pytest.approx(scores.mean(), rel=1e-5)
