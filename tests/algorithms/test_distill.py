"""On-policy distillation (algorithm: opd): the per-token advantages and metrics against plain loops, the teacher's
top-1 agreement in the chunked log-prob computation, the policy loss on the advantages, and a toy student whose
log-probs approach the teacher's under that loss."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from backend_specs import trainer_spec

from chatlearn.algorithms.distill import distill_metrics, distill_token_advantages
from chatlearn.algorithms.grpo import TOP1, GRPOLoss, chunked_logprobs_entropy


def ragged_batch(seed: int = 0, n: int = 5, multi_turn: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    plen, rlen = rng.integers(1, 5, n), rng.integers(1, 7, n)
    off = np.concatenate([[0], np.cumsum(plen + rlen)]).astype(np.int64)
    batch = {"tokens": rng.integers(0, 9, int(off[-1])), "offsets": off, "prompt_lens": plen.astype(np.int64)}
    if multi_turn:  # observation tokens (0) inside the responses: the teacher scores the model's tokens only
        batch["loss_mask"] = (rng.random(int(off[-1])) < 0.6).astype(np.int64)
    return batch


def plain_advantages(batch, student, teacher, adv, coef):
    """A_t = adv[i] - coef * (student_t - teacher_t) on sample i's model tokens, one token at a time."""
    out = np.zeros(len(batch["tokens"]))
    for i in range(len(batch["prompt_lens"])):
        for t in range(int(batch["offsets"][i] + batch["prompt_lens"][i]), int(batch["offsets"][i + 1])):
            if "loss_mask" not in batch or batch["loss_mask"][t]:
                out[t] = adv[i] - coef * (student[t] - teacher[t])
    return out


@pytest.mark.parametrize("multi_turn", [False, True])
@pytest.mark.parametrize("coef", [1.0, 0.3])
def test_advantages_and_metrics_match_plain_loops(multi_turn, coef):
    batch = ragged_batch(1, multi_turn=multi_turn)
    rng = np.random.default_rng(2)
    T, n = len(batch["tokens"]), len(batch["prompt_lens"])
    student, teacher = -rng.random(T) * 3, -rng.random(T) * 3
    top1 = (rng.random(T) < 0.5).astype(np.float32)
    adv = rng.normal(size=n)
    got = distill_token_advantages(batch, student, teacher, adv, coef)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, plain_advantages(batch, student, teacher, adv, coef), rtol=0, atol=1e-6)
    # the metrics: plain means over the model's tokens
    tokens = [t for i in range(n) for t in range(int(batch["offsets"][i] + batch["prompt_lens"][i]),
                                                  int(batch["offsets"][i + 1]))
              if "loss_mask" not in batch or batch["loss_mask"][t]]
    m = distill_metrics(batch, student, teacher, top1)
    assert m["reverse_kl"] == pytest.approx(sum(student[t] - teacher[t] for t in tokens) / len(tokens))
    assert m["top1_agreement"] == pytest.approx(sum(top1[t] for t in tokens) / len(tokens))
    assert m["teacher_logprob"] == pytest.approx(sum(teacher[t] for t in tokens) / len(tokens))
    assert m["student_logprob"] == pytest.approx(sum(student[t] for t in tokens) / len(tokens))


def test_equal_student_and_teacher_leave_the_reward_advantage():
    batch = ragged_batch(3)
    logp = -np.random.default_rng(4).random(len(batch["tokens"]))
    adv = np.arange(len(batch["prompt_lens"]), dtype=np.float64)
    got = distill_token_advantages(batch, logp, logp, adv, 1.0)
    np.testing.assert_array_equal(got, plain_advantages(batch, logp, logp, adv, 1.0))
    assert distill_metrics(batch, logp, logp, np.ones_like(logp))["reverse_kl"] == 0.0


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_top1_is_the_argmax_of_the_full_logits(chunk):
    g = torch.Generator().manual_seed(0)
    hidden, weight, bias = torch.randn(11, 6, generator=g), torch.randn(7, 6, generator=g), torch.randn(7, generator=g)
    z = (hidden @ weight.T + bias) / 0.7
    targets = torch.randint(0, 7, (11,), generator=g)
    targets[:4] = z[:4].argmax(-1)  # some samples are the argmax, others (mostly) not
    logp, top1 = chunked_logprobs_entropy(hidden, weight, targets, 0.7, chunk, TOP1, bias=bias)
    torch.testing.assert_close(logp, torch.log_softmax(z, -1).gather(1, targets[:, None])[:, 0])
    torch.testing.assert_close(top1, (z.argmax(-1) == targets).float())
    assert 4 <= top1.sum() < 11


def test_policy_loss_reads_the_token_advantages_with_ratio_and_clipping():
    """The trainers' loss on a batch with the distillation advantages: PPO's clipped surrogate per token,
    max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps)), A_t the token's (not its sample's) advantage."""
    batch = ragged_batch(5)
    rng = np.random.default_rng(6)
    T = len(batch["tokens"])
    student, teacher = -rng.random(T) * 2, -rng.random(T) * 2
    token_adv = distill_token_advantages(batch, student, teacher, rng.normal(size=5), 1.0)
    old = student.astype(np.float32)
    batch = dict(batch, token_advantages=token_adv, old_logprobs=old)
    spec = trainer_spec(kl_coef=0.0, entropy_coef=0.0, pos_clip_ratio=0.2, neg_clip_ratio=0.2)
    loss = GRPOLoss(spec, batch, torch.device("cpu"))
    from chatlearn.algorithms.response import response_mask

    pos = np.flatnonzero(response_mask(batch))
    logp = torch.from_numpy(old[pos] + rng.normal(0, 0.3, len(pos)).astype(np.float32))
    terms, _, _ = loss.terms(logp, None, pos)
    r = np.exp(logp.numpy().astype(np.float64) - old[pos])
    a = token_adv[pos].astype(np.float64)
    expected = np.maximum(-a * r, -a * np.clip(r, 0.8, 1.2))
    np.testing.assert_allclose(terms["loss"].numpy(), expected, rtol=1e-5, atol=1e-6)


def test_a_student_trained_on_the_distillation_advantages_approaches_the_teacher():
    """A toy student (per position, a categorical over 6 tokens) samples its own sequences; the advantages are
    the reverse-KL estimates against a fixed teacher, the loss the trainers' clipped policy loss: the exact
    KL(student || teacher) per position falls from over 1 nat to near 0, and the student's log-probs of its
    samples approach the teacher's."""
    torch.manual_seed(0)
    V, L, N = 6, 4, 64
    teacher = torch.log_softmax(torch.randn(L, V) * 2, -1)
    student_logits = torch.nn.Parameter(torch.zeros(L, V))
    opt = torch.optim.Adam([student_logits], lr=0.1)
    spec = trainer_spec(kl_coef=0.0, entropy_coef=0.0)

    def exact_kl():
        s = torch.log_softmax(student_logits.detach(), -1)
        return float((s.exp() * (s - teacher)).sum(-1).mean())

    start = exact_kl()
    gaps = []
    for _ in range(150):
        s = torch.log_softmax(student_logits, -1)
        tokens = torch.distributions.Categorical(logits=s.detach()).sample((N,))  # [N, L]
        pos_ids = torch.arange(L).expand(N, L)
        batch = {"tokens": np.concatenate([np.zeros((N, 1), np.int64), tokens.numpy()], 1).reshape(-1),
                 "offsets": np.arange(N + 1, dtype=np.int64) * (L + 1), "prompt_lens": np.ones(N, np.int64)}
        student_lp = np.zeros(N * (L + 1), np.float32)
        teacher_lp = np.zeros(N * (L + 1), np.float32)
        resp = (np.arange(N)[:, None] * (L + 1) + 1 + np.arange(L)[None]).reshape(-1)
        student_lp[resp] = s.detach()[pos_ids, tokens].reshape(-1).numpy()
        teacher_lp[resp] = teacher[pos_ids, tokens].reshape(-1).numpy()
        gaps.append(float(np.mean(np.abs(student_lp[resp] - teacher_lp[resp]))))
        batch["token_advantages"] = distill_token_advantages(batch, student_lp, teacher_lp, np.zeros(N), 1.0)
        batch["old_logprobs"] = student_lp
        loss_fn = GRPOLoss(spec, batch, torch.device("cpu"))
        logp = s[pos_ids, tokens].reshape(-1)
        terms, coef, weight = loss_fn.terms(logp, None, resp)
        loss = (terms["loss"] * coef * weight).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert start > 1.0
    assert exact_kl() < 0.1 * start
    assert np.mean(gaps[-10:]) < 0.3 * np.mean(gaps[:10])
