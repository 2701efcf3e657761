"""algorithm: gkd's loss against plain reference implementations: TRL's generalized JSD is the forward KL at
beta 0 and the reverse KL at beta 1 (computed here with torch.nn.functional.kl_div and by hand), the teacher's
top-k with k = the vocabulary is the full divergence, the chunked LM-head path gives the same values and gradients
as the unchunked one, and the loss is a token mean over the tokens a loss covers (multi-turn: the model's)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from chatlearn.algorithms.gkd import GKDLoss, GKDRows, TeacherTopK, generalized_jsd, gkd_token_loss
from chatlearn.algorithms.grpo import chunked_logprobs_entropy

V = 11


def _logits(seed: int, rows: int = 6) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


def _full_topk(teacher_logits: torch.Tensor, temperature: float, k: int | None = None):
    logp = torch.log_softmax(teacher_logits / temperature, -1)
    values, ids = logp.topk(V if k is None else k, -1)
    return ids, values


def _plain_jsd(s_logits, t_logits, beta, temperature):
    """TRL's generalized_jsd_loss per token, written out: F.kl_div(input, target, log_target=True) is
    KL(target || input)."""
    s = torch.log_softmax(s_logits / temperature, -1)
    t = torch.log_softmax(t_logits / temperature, -1)
    if beta == 0:
        return F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(t, s, reduction="none", log_target=True).sum(-1)
    m = torch.log(beta * t.exp() + (1 - beta) * s.exp())
    return beta * F.kl_div(m, t, reduction="none", log_target=True).sum(-1) + \
        (1 - beta) * F.kl_div(m, s, reduction="none", log_target=True).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_beta_0_is_the_forward_kl_and_beta_1_the_reverse_kl(temperature):
    s_logits, t_logits = _logits(0), _logits(1)
    s = torch.log_softmax(s_logits / temperature, -1)
    t = torch.log_softmax(t_logits / temperature, -1)
    forward = (t.exp() * (t - s)).sum(-1)  # KL(teacher || student)
    reverse = (s.exp() * (s - t)).sum(-1)  # KL(student || teacher)
    ids, values = _full_topk(t_logits, temperature)
    torch.testing.assert_close(gkd_token_loss(s_logits, ids, values, 0.0, temperature), forward.float(),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(gkd_token_loss(s_logits, ids, values, 1.0, temperature), reverse.float(),
                               rtol=0, atol=1e-5)
    assert not torch.allclose(forward, reverse, atol=1e-3)  # the two are told apart


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_equals_trl_written_out(beta):
    s_logits, t_logits = _logits(2), _logits(3)
    ids, values = _full_topk(t_logits, 0.9)
    torch.testing.assert_close(gkd_token_loss(s_logits, ids, values, beta, 0.9),
                               _plain_jsd(s_logits, t_logits, beta, 0.9).float(), rtol=0, atol=1e-5)
    same = torch.log_softmax(s_logits, -1)
    assert generalized_jsd(same, same, beta).abs().max() < 1e-12  # zero when the two agree


def test_topk_as_large_as_the_vocabulary_is_the_full_divergence_and_smaller_k_a_lower_bound():
    s_logits, t_logits = _logits(4), _logits(5)
    ids, values = _full_topk(t_logits, 1.0)
    full = _plain_jsd(s_logits, t_logits, 0.5, 1.0).float()
    # ids in another order than the teacher's ranking: the same sum
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(gkd_token_loss(s_logits, ids[:, perm], values[:, perm], 0.5, 1.0), full,
                               rtol=0, atol=1e-5)
    for k in (1, 3, V - 1):
        ids_k, values_k = _full_topk(t_logits, 1.0, k)
        part = gkd_token_loss(s_logits, ids_k, values_k, 0.5, 1.0)
        assert (part <= full + 1e-6).all() and (part >= 0).all()
    ids_k, values_k = _full_topk(t_logits, 1.0, 3)
    # the top-3 plus the rest, by hand: both distributions over {id_1, id_2, id_3, other}
    s = torch.log_softmax(s_logits, -1).gather(-1, ids_k)
    s4 = torch.cat([s, torch.log1p(-s.exp().sum(-1, keepdim=True))], -1)
    t4 = torch.cat([values_k, torch.log1p(-values_k.exp().sum(-1, keepdim=True))], -1)
    m = torch.log(0.5 * s4.exp() + 0.5 * t4.exp())
    by_hand = 0.5 * (t4.exp() * (t4 - m)).sum(-1) + 0.5 * (s4.exp() * (s4 - m)).sum(-1)
    torch.testing.assert_close(gkd_token_loss(s_logits, ids_k, values_k, 0.5, 1.0), by_hand.float(),
                               rtol=0, atol=1e-5)


def test_the_teacher_mode_gives_its_top_k_and_the_chunked_loss_its_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(7, 5, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(V, 5, dtype=torch.float32, requires_grad=True)
    targets = torch.randint(0, V, (7,))
    with torch.no_grad():
        logp, (top1, values, ids) = chunked_logprobs_entropy(hidden, weight, targets, 0.8, 3, TeacherTopK(4))
        full = torch.log_softmax((hidden @ weight.T) / 0.8, -1)
        ref_values, ref_ids = full.topk(4, -1)
    torch.testing.assert_close(values, ref_values)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), ref_ids)
    assert torch.equal(top1, (full.argmax(-1) == targets).float())
    teacher_ids, teacher_logp = _full_topk(torch.randn(7, V, dtype=torch.float64), 1.0, 5)
    rows = GKDRows(teacher_ids, teacher_logp.float(), 0.5, 1.0)
    _, jsd = chunked_logprobs_entropy(hidden, weight, targets, 0.8, 3, rows)
    jsd.sum().backward()
    got = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad, weight.grad = None, None
    gkd_token_loss(hidden @ weight.T, teacher_ids, teacher_logp.float(), 0.5, 1.0).sum().backward()
    torch.testing.assert_close(jsd, gkd_token_loss((hidden @ weight.T).detach(), teacher_ids,
                                                   teacher_logp.float(), 0.5, 1.0))
    torch.testing.assert_close(got[0], hidden.grad)
    torch.testing.assert_close(got[1], weight.grad)


class _Spec:
    gkd_beta, gkd_temperature = 0.5, 1.0


def test_the_loss_is_a_token_mean_over_the_model_tokens():
    # two samples: 2 prompt + 3 response tokens; 1 prompt + 4 tokens of which one is an observation (loss_mask 0)
    batch = {"tokens": np.arange(10), "offsets": np.array([0, 5, 10]), "prompt_lens": np.array([2, 1]),
             "loss_mask": np.array([0, 0, 1, 1, 1, 0, 1, 0, 1, 1], np.uint8),
             "sample_weights": np.ones(2, np.float32),
             "teacher_topk_ids": np.zeros((10, 2), np.int32), "teacher_topk_logprobs": np.zeros((10, 2), np.float32)}
    loss = GKDLoss(_Spec(), batch, torch.device("cpu"))
    assert loss.num_tokens == 6  # 3 + 3: the observation token left out
    pos = np.array([2, 3, 4, 6, 8, 9])
    jsd = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    terms, coef, weight = loss.terms(torch.zeros(6), jsd, pos)
    sums = loss.token_sums(terms, coef, weight)
    metrics = loss.metrics(sums.tolist())
    assert metrics["loss"] == pytest.approx(2.1 / 6) and metrics["gkd_jsd"] == pytest.approx(2.1 / 6)
    rows = loss.with_entropy.rows(pos, torch.device("cpu"))
    assert rows.ids.shape == (6, 2) and rows.beta == 0.5
