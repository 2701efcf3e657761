"""GRPO functions against direct reference implementations written with plain loops."""
import math

import numpy as np
import pytest
import torch
from backend_specs import trainer_spec

from chatlearn.algorithms.advantages import group_advantages
from chatlearn.algorithms.grpo import (
    entropy_from_logits,
    grpo_token_losses,
    gspo_policy_loss,
    importance_ratio,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    policy_loss,
    vanilla_policy_loss,
)
from chatlearn.algorithms.kl import kl_k3, kl_penalty
from chatlearn.config import registry


def ref_group_advantages(rewards, group_size, eps=1e-6):
    out = []
    for start in range(0, len(rewards), group_size):
        group = [float(r) for r in rewards[start:start + group_size]]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        same = all(r == group[0] for r in group)
        out += [0.0 if same else (r - mean) / (std + eps) for r in group]
    return out


def test_group_advantages_matches_loops_and_zero_variance_group():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=24).astype(np.float32)
    rewards[8:12] = 1.0  # a group whose rewards are all equal
    rewards[16:20] = [0, 1, 0, 0]  # binary rewards, as a verifier gives
    adv = group_advantages(rewards, group_size=4)
    assert adv.dtype == np.float32 and adv.shape == (24,)
    np.testing.assert_allclose(adv, ref_group_advantages(rewards, 4), rtol=1e-6, atol=1e-6)
    assert np.all(adv[8:12] == 0.0)
    # the same as the torch formula with the unbiased std
    g = torch.tensor(rewards[:8], dtype=torch.float64).view(2, 4)
    expect = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1)
    np.testing.assert_allclose(adv[:8], expect.numpy(), rtol=1e-6, atol=1e-6)


def test_group_advantages_edge_cases():
    assert np.all(group_advantages(np.array([1.0, 2.0, 3.0]), group_size=1) == 0)
    with pytest.raises(ValueError):
        group_advantages(np.zeros(5), group_size=2)


def test_policy_loss_matches_loops():
    g = torch.Generator().manual_seed(0)
    n = 200
    logp = -torch.rand(n, generator=g, dtype=torch.float64) * 3
    old = logp + torch.randn(n, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[:10] = 0.0
    pos, neg = 0.28, 0.2
    loss, clipped, _ = policy_loss(logp, old, adv, pos, neg)
    for j in range(n):
        ratio = math.exp(logp[j] - old[j])
        a = float(adv[j])
        unclipped = -a * ratio
        clipped_term = -a * min(max(ratio, 1 - neg), 1 + pos)
        assert loss[j].item() == pytest.approx(max(unclipped, clipped_term), rel=1e-12, abs=1e-12)
        assert bool(clipped[j]) == (clipped_term > unclipped)
    assert clipped.any() and not clipped.all()
    # asymmetric bounds: a positive advantage is clipped only above 1 + pos
    up = policy_loss(torch.tensor([math.log(1.25)]), torch.zeros(1), torch.ones(1), pos, neg)
    assert not up[1].item()
    up = policy_loss(torch.tensor([math.log(1.30)]), torch.zeros(1), torch.ones(1), pos, neg)
    assert up[1].item() and up[0].item() == pytest.approx(-1.28)


def test_policy_loss_gradient_is_zero_on_clipped_tokens():
    logp = torch.tensor([0.5, 0.0, -0.5], requires_grad=True)
    loss, clipped, _ = policy_loss(logp, torch.zeros(3), torch.ones(3), 0.2, 0.2)
    loss.sum().backward()
    assert clipped.tolist() == [True, False, False]
    assert logp.grad[0] == 0 and logp.grad[1] != 0 and logp.grad[2] != 0


def test_kl_k3_matches_loops_and_clamps():
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(100, generator=g, dtype=torch.float64) * 4
    ref = -torch.rand(100, generator=g, dtype=torch.float64) * 4
    logp[0], ref[0] = 0.0, -50.0  # log-ratio -50, clamped to -20
    logp[1], ref[1] = -60.0, 0.0  # log-ratio +60, clamped to +20
    kl = kl_k3(logp, ref)
    for j in range(100):
        d = min(max(float(ref[j] - logp[j]), -20.0), 20.0)
        assert kl[j].item() == pytest.approx(math.exp(d) - d - 1, rel=1e-12, abs=1e-12)
    assert torch.all(kl >= 0) and torch.isfinite(kl).all()
    assert kl_k3(torch.tensor([-1.0]), torch.tensor([-1.0])).item() == 0.0


def test_entropy_and_logprobs_from_logits_match_loops():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 7, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, 7, (5,), generator=g)
    ent = entropy_from_logits(logits)
    logp = logprobs_from_logits(logits, targets)
    for i in range(5):
        z = [float(v) for v in logits[i]]
        norm = sum(math.exp(v) for v in z)
        probs = [math.exp(v) / norm for v in z]
        assert ent[i].item() == pytest.approx(-sum(p * math.log(p) for p in probs), rel=1e-10)
        assert logp[i].item() == pytest.approx(math.log(probs[int(targets[i])]), rel=1e-10)


def test_masked_sum_and_mean():
    values = torch.tensor([1.0, 2.0, 3.0, 4.0])
    mask = torch.tensor([True, False, True, False])
    assert masked_sum(values, mask).item() == 4.0
    assert masked_mean(values, mask).item() == 2.0
    assert masked_mean(values, torch.zeros(4, dtype=torch.bool)).item() == 0.0


def _terms_before_the_registry(spec, logp, old_logp, advantages, seq, ref_logp, entropy, gspo):
    """grpo_token_losses as it was before the policy losses were a registry (the switch
    use_group_sequence_policy), verbatim but for that switch given as ``gspo``."""
    pg, clipped, clipped_lower = policy_loss(logp, old_logp, advantages, spec.pos_clip_ratio, spec.neg_clip_ratio,
                                             spec.clip_ratio_c, seq if gspo else None)
    loss = pg + spec.kl_coef * kl_penalty(logp, ref_logp, spec.kl_estimator) - spec.entropy_coef * entropy
    with torch.no_grad():
        ratio = importance_ratio(logp, old_logp, seq if gspo else None)
    return {"loss": loss, "pg": pg, "clipped": clipped, "clipped_lower": clipped_lower, "ratio": ratio}


@pytest.mark.parametrize("name", ["vanilla", "gspo"])
@pytest.mark.parametrize("clip_ratio_c", [None, 3.0])
def test_the_registered_policy_losses_give_the_losses_of_before_bit_for_bit(name, clip_ratio_c):
    rng = np.random.default_rng(11)
    seq = torch.from_numpy(np.repeat(np.arange(5), [3, 1, 6, 2, 4]))
    m = seq.numel()
    old = torch.tensor(rng.normal(-1.0, 0.4, m), dtype=torch.float32)
    ref = torch.tensor(rng.normal(-1.0, 0.4, m), dtype=torch.float32)
    adv = torch.tensor(rng.normal(0.0, 1.0, 5), dtype=torch.float32)[seq]
    ent = torch.tensor(rng.uniform(0.0, 2.0, m), dtype=torch.float32)
    start = old + torch.tensor(rng.normal(0.0, 0.3, m), dtype=torch.float32)  # ratios inside and outside the clip
    spec = trainer_spec(policy_loss=name, pos_clip_ratio=0.2, neg_clip_ratio=0.1, clip_ratio_c=clip_ratio_c,
                        kl_coef=0.05, kl_estimator="k3", entropy_coef=0.01)
    now_logp, before_logp = start.clone().requires_grad_(True), start.clone().requires_grad_(True)
    now = grpo_token_losses(spec, now_logp, old, adv, seq, ref, ent)
    before = _terms_before_the_registry(spec, before_logp, old, adv, seq, ref, ent, gspo=name == "gspo")
    assert bool(now["clipped"].any()) and bool(now["clipped"].logical_not().any())
    for key in before:
        assert torch.equal(now[key], before[key]), key
    now["loss"].sum().backward()
    before["loss"].sum().backward()
    assert torch.equal(now_logp.grad, before_logp.grad)
    assert registry.POLICY_LOSSES.get(name) is (vanilla_policy_loss if name == "vanilla" else gspo_policy_loss)
