"""Supervised fine-tuning's loss: the negative log-likelihood of the assistant tokens, a token mean over the
GLOBAL batch (every assistant token of the optimizer step weighs the same, whichever sample, micro-batch or
rank holds it)::

    loss = - (1 / T) * sum_{samples i} sum_{assistant tokens t of i} log p(token_t | tokens_<t)

with T the number of assistant tokens of the whole global batch. The tokens are the ones a loss covers
(``chatlearn.models.base.response_positions``): from ``prompt_lens`` (the first assistant token) on, those
whose ``loss_mask`` is 1 (every assistant turn of a multi-turn conversation; the user's and the system's
turns in between are 0). :mod:`chatlearn.data.sft` builds such batches from chat messages.

:class:`SFTLoss` has the interface the trainers use for :class:`chatlearn.algorithms.grpo.GRPOLoss`
(``terms``, ``SUMS``, ``token_sums``, ``metrics``), so the FSDP2 and the Megatron trainer train with it
through the same micro-batch loop (``Trainer.train_sft``); nothing here knows about models or ranks.
"""
from __future__ import annotations

import numpy as np
import torch

from chatlearn.algorithms.advantages import loss_token_counts

# the token sums of one micro-batch, all-reduced over the ranks: the aggregated loss (sum of -logp / T) and
# the plain sum of -logp (the same number times T: kept apart so that the metric is exact in float64)
SFT_SUMS = ("loss", "nll_sum")


def sft_nll(logprobs: np.ndarray, batch: dict) -> tuple[float, int]:
    """``(sum of -log p over the batch's loss tokens, their number)`` from per-token log-probs [T] of
    ``batch["tokens"]`` (a trainer's ``compute_logprobs``): the evaluation loss of a split is the first
    over the second."""
    total, count = 0.0, 0
    for i in range(len(batch["offsets"]) - 1):
        start, end = int(batch["offsets"][i]), int(batch["offsets"][i + 1])
        plen = int(batch["prompt_lens"][i])
        keep = np.asarray(batch["loss_mask"][start + plen:end], bool)
        total -= float(np.asarray(logprobs[start + plen:end], np.float64)[keep].sum())
        count += int(keep.sum())
    return total, count


class SFTLoss:
    """The SFT loss over one GLOBAL batch (see the module docstring): per loss token, ``-logp`` with the
    coefficient ``1 / T`` (T: the batch's loss tokens). No entropy, no rollout log-probs, no correction."""

    with_entropy = False
    tracks_rollout = False
    correction = "none"
    SUMS = SFT_SUMS

    def __init__(self, spec, batch: dict, device: torch.device):
        self.spec, self.batch, self.device = spec, batch, device
        if "loss_mask" not in batch:
            raise ValueError("an SFT batch needs loss_mask (1 on the assistant tokens)")
        self.num_tokens = int(loss_token_counts(batch).sum())
        if self.num_tokens == 0:
            raise ValueError("the batch has no assistant tokens")
        self.offsets = np.asarray(batch["offsets"])

    def terms(self, logp: torch.Tensor, entropy: torch.Tensor | None, pos: np.ndarray):
        """``({"loss": -logp}, coef 1/T, weight 1)`` for the loss tokens at positions ``pos``."""
        coef = torch.full_like(logp, 1.0 / self.num_tokens, dtype=torch.float32)
        return {"loss": -logp}, coef, torch.ones_like(coef)

    def token_sums(self, terms: dict, coef: torch.Tensor, weight: torch.Tensor,
                   entropy: torch.Tensor | None = None) -> torch.Tensor:
        with torch.no_grad():
            nll = terms["loss"].double()
            return torch.stack([(nll * coef.double()).sum(), nll.sum()])

    def metrics(self, sums: list[float], *_ignored) -> dict:
        """``loss`` (the token mean of -logp over the global batch, what the step minimises), ``nll_sum``
        and ``num_tokens`` (the batch's assistant tokens)."""
        s = dict(zip(self.SUMS, sums))
        return {"loss": s["nll_sum"] / self.num_tokens, "nll_sum": s["nll_sum"], "num_tokens": float(self.num_tokens)}
