"""Generalized knowledge distillation (``algorithm: gkd``): TRL's generalized Jensen-Shannon divergence between
the student's and the teacher's next-token distributions, on every response token of the student's samples.

TRL (``GKDTrainer.generalized_jsd_loss``) divides both models' logits by a temperature, takes their
log-softmax ``S`` (student) and ``T`` (teacher) over the vocabulary and, per token::

    beta = 0:  KL(T || S) = sum_v T_v (log T_v - log S_v)                  (forward KL)
    beta = 1:  KL(S || T) = sum_v S_v (log S_v - log T_v)                  (reverse KL)
    else:      M = beta * T + (1 - beta) * S
               JSD_beta = beta * KL(T || M) + (1 - beta) * KL(S || M)

then a token mean over the tokens the loss covers. Here the teacher's distribution travels from the teacher's
pass to the trainer as its ``k`` most likely tokens (``teacher_topk_ids``) and their log-probs
(``teacher_topk_logprobs``), ``distill_topk`` (null: ``k`` = the vocabulary, the full distribution). With
``k`` < the vocabulary both distributions are reduced to ``k + 1`` outcomes: the teacher's ``k`` tokens and
"any other token", whose probability is ``1 - sum`` of the ``k`` (the student's at the same ids, gathered
from its own log-softmax, and its own remainder). The divergence of those is a lower bound of the full one
(coarse-graining), exact when the teacher's mass outside its top k is nil, and with ``k`` = the vocabulary it
is the full divergence (the remainder is empty). slime and verl's top-k distillation keep the teacher's top-k
the same way; keeping the remainder as its own outcome keeps both sides normalised.

The on-policy fraction ``gkd_lambda`` (TRL's ``lmbda``): TRL's ``GKDTrainer.training_step`` draws
``random.random() <= lmbda`` once per training step and then trains that batch on the student's generations, else
on the dataset's own completions. Here the draw is once per episode (:func:`on_policy`), from
``(runtime_args.seed, episode)`` alone, so a resumed run draws what the uninterrupted one did with no state to keep;
an off-policy episode samples nothing and trains on the prompts' reference responses.

Nothing here knows about models or ranks: :func:`gkd_token_loss` is what a trainer's chunked LM-head pass
computes per token (:func:`chatlearn.algorithms.grpo.chunked_logprobs_entropy` with a :class:`GKDRows`), and
:class:`GKDLoss` has the interface of :class:`chatlearn.algorithms.sft.SFTLoss`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


from chatlearn.algorithms.response import loss_token_counts



# the smallest probability a remainder is given, so that its log stays finite (its terms are then ~0)
TAIL_FLOOR = 1e-30


def generalized_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float) -> torch.Tensor:
    """TRL's generalized JSD per row of two log-distributions ``[..., K]`` over the same outcomes (see the module
    docstring): forward KL(T || S) at ``beta`` 0, reverse KL(S || T) at 1, the beta-mixture's JSD between."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta} must be in [0, 1]")
    if beta == 0.0:
        return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
    if beta == 1.0:
        return (student_logp.exp() * (student_logp - teacher_logp)).sum(-1)
    mixture = torch.logsumexp(torch.stack([teacher_logp + math.log(beta), student_logp + math.log(1.0 - beta)]), 0)
    kl_teacher = (teacher_logp.exp() * (teacher_logp - mixture)).sum(-1)
    kl_student = (student_logp.exp() * (student_logp - mixture)).sum(-1)
    return beta * kl_teacher + (1.0 - beta) * kl_student


def with_remainder(logp: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` log-probs of K outcomes -> ``[..., K + 1]``: and the log of the rest, ``log(1 - sum exp)``
    (floored at :data:`TAIL_FLOOR`)."""
    rest = (1.0 - logp.exp().sum(-1, keepdim=True)).clamp(min=TAIL_FLOOR)
    return torch.cat([logp, rest.log()], -1)


def gkd_token_loss(logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logp: torch.Tensor,
                   beta: float, temperature: float) -> torch.Tensor:
    """Per token [M]: the generalized JSD between the student's ``log_softmax(logits / temperature)`` ([M, V]
    raw logits) and the teacher's top-k (``teacher_ids`` int [M, K], ``teacher_logp`` [M, K] at the same
    temperature), over the K ids plus the remainder when K < V (the module docstring)."""
    student = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, teacher_ids.long())
    teacher = teacher_logp.float()
    if teacher_ids.shape[-1] < logits.shape[-1]:
        student, teacher = with_remainder(student), with_remainder(teacher)
    return generalized_jsd(student, teacher, beta)


@dataclass(frozen=True)
class TeacherTopK:
    """The teacher's pass mode of the chunked LM-head computation: beside the sampled tokens' log-probs, the
    agreement of the sampled token with the argmax and the ``k`` most likely tokens' log-probs and ids (``k``
    None: the whole vocabulary, sorted)."""

    k: int | None

    def outputs(self, z: torch.Tensor, targets: torch.Tensor) -> tuple:
        """``(top1 [M], top-k log-probs [M, k], their ids int32 [M, k])`` of temperature-scaled logits ``z``."""
        logp = torch.log_softmax(z, dim=-1)
        k = z.shape[-1] if self.k is None else min(int(self.k), z.shape[-1])
        values, ids = logp.topk(k, dim=-1)
        return (ids[..., 0] == targets).float(), values, ids.to(torch.int32)


@dataclass(frozen=True)
class GKDRows:
    """The trainer's mode of the chunked LM-head computation for rows ``[M]``: the teacher's top-k of those rows
    and the loss's ``beta`` and ``temperature``; its second output is :func:`gkd_token_loss` per row."""

    ids: torch.Tensor
    logp: torch.Tensor
    beta: float
    temperature: float

    def split(self, chunk: int) -> list["GKDRows"]:
        return [GKDRows(i, p, self.beta, self.temperature)
                for i, p in zip(torch.split(self.ids, chunk), torch.split(self.logp, chunk))]

    def outputs(self, raw_logits: torch.Tensor) -> torch.Tensor:
        return gkd_token_loss(raw_logits, self.ids, self.logp, self.beta, self.temperature)


class GKDTargets:
    """A batch's teacher top-k (``teacher_topk_ids`` / ``teacher_topk_logprobs``, [T, K]) for the trainer's
    forward: :meth:`rows` picks those of the tokens a micro-batch scores."""

    def __init__(self, batch: dict, beta: float, temperature: float):
        self.ids = np.asarray(batch["teacher_topk_ids"])
        self.logp = np.asarray(batch["teacher_topk_logprobs"])
        self.beta, self.temperature = float(beta), float(temperature)

    def rows(self, pos: np.ndarray, device) -> GKDRows:
        """The rows of token positions ``pos`` (in ``batch["tokens"]``) on ``device``."""
        ids = torch.from_numpy(self.ids[pos].astype(np.int64)).to(device)
        logp = torch.from_numpy(self.logp[pos].astype(np.float32)).to(device)
        return GKDRows(ids, logp, self.beta, self.temperature)


class GKDLoss:
    """The GKD loss over one GLOBAL batch: the token mean of :func:`gkd_token_loss` over every token a loss
    covers (``response_positions``: the response, the model's own tokens of a multi-turn trajectory), as TRL's
    ``batchmean`` over the non-masked tokens; samples of weight 0 left out. The interface of
    :class:`chatlearn.algorithms.sft.SFTLoss`; ``with_entropy`` is the batch's :class:`GKDTargets`, so that the
    trainer's forward gives the per-token divergence where it would give the entropy."""

    tracks_rollout = False
    correction = "none"
    SUMS = ("loss", "jsd_sum")

    def __init__(self, spec, batch: dict, device: torch.device):
        if "teacher_topk_ids" not in batch or "teacher_topk_logprobs" not in batch:
            raise ValueError("a GKD batch needs teacher_topk_ids and teacher_topk_logprobs (the teacher's pass)")
        self.spec, self.batch, self.device = spec, batch, device
        self.with_entropy = GKDTargets(batch, spec.gkd_beta, spec.gkd_temperature)
        weights = np.asarray(batch["sample_weights"], np.float64) if "sample_weights" in batch else None
        counts = loss_token_counts(batch).astype(np.float64)
        self.sample_weight = np.ones_like(counts) if weights is None else weights
        self.num_tokens = float((counts * self.sample_weight).sum())
        self.offsets = np.asarray(batch["offsets"])

    def terms(self, logp: torch.Tensor, jsd: torch.Tensor, pos: np.ndarray):
        """``({"loss": jsd}, coef w_i / T, weight w_i)`` for the tokens at positions ``pos``."""
        sample = np.searchsorted(self.offsets, pos, side="right") - 1
        w = torch.from_numpy(self.sample_weight[sample].astype(np.float32)).to(jsd.device)
        return {"loss": jsd}, w / max(self.num_tokens, 1.0), w

    def token_sums(self, terms: dict, coef: torch.Tensor, weight: torch.Tensor,
                   entropy: torch.Tensor | None = None) -> torch.Tensor:
        with torch.no_grad():
            jsd = terms["loss"].double()
            return torch.stack([(jsd * coef.double()).sum(), (jsd * weight.double()).sum()])

    def metrics(self, sums: list[float], *_ignored) -> dict:
        """``loss`` (the token mean of the divergence, what the step minimises), ``gkd_jsd`` (the same, from the
        plain sum) and ``num_tokens``."""
        s = dict(zip(self.SUMS, sums))
        return {"loss": s["loss"], "gkd_jsd": s["jsd_sum"] / max(self.num_tokens, 1.0),
                "num_tokens": self.num_tokens}
