"""The PPO critic's loss: the clipped value loss (verl ``compute_value_loss``, core_algos.py), aggregated
over the GLOBAL batch as the policy's loss is (:func:`chatlearn.algorithms.grpo.sample_loss_coefficients`).

Per response token t, with V the critic's value of the state before the token (its prediction, with
grad), V_old the critic's value before the update (the batch's ``values``) and R the return (the
batch's ``returns``, :mod:`chatlearn.algorithms.gae`)::

    V_clip = V_old + clamp(V - V_old, -cliprange_value, cliprange_value)
    l_t    = value_loss_coef * max((V - R)^2, (V_clip - R)^2)        (value_loss_coef * (V - R)^2 unclipped)
    loss   = sum_{samples i} sum_{response tokens t of i} c_i * l_t

Nothing here knows about models, ranks or devices; :class:`ValueLoss` has the interface the trainers
use for :class:`chatlearn.algorithms.grpo.GRPOLoss` (``terms``, ``SUMS``, ``token_sums``, ``metrics``).
"""
from __future__ import annotations

import numpy as np
import torch

from chatlearn.algorithms.advantages import loss_token_counts
from chatlearn.algorithms.grpo import GRPOLoss, sample_loss_coefficients

# the token sums of one micro-batch (ValueLoss.token_sums), all-reduced over the ranks: the aggregated
# loss sum c*l, and the weight-masked sums of the clipped indicator, of V and of (V - R)^2
VALUE_SUMS = ("loss", "value_clipped", "values", "value_error")


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               cliprange_value: float | None, value_loss_coef: float):
    """The critic's per-token loss (verl ``compute_value_loss``), tensors of the same shape::

        V_clip = V_old + clamp(V - V_old, -c, c) = clamp(V, V_old - c, V_old + c)    (c: cliprange_value)
        l      = value_loss_coef * max((V - R)^2, (V_clip - R)^2)

    (``cliprange_value`` None: no clipping, ``l = value_loss_coef * (V - R)^2``). Returns ``(l,
    clipped)``: ``clipped`` marks the tokens where the clipped term is strictly larger (where the
    loss has no gradient; verl ``vf_clipfrac``), all False without clipping."""
    unclipped = (values - returns) ** 2
    if cliprange_value is None:
        return value_loss_coef * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    # clamp(V, V_old - c, V_old + c) (verl's clip_by_value): exactly V inside the range, where
    # V_old + clamp(V - V_old, -c, c) would round to another float and count as clipped
    v_clip = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    clipped_term = (v_clip - returns) ** 2
    return value_loss_coef * torch.maximum(unclipped, clipped_term), clipped_term > unclipped


class ValueLoss:
    """The critic's loss over one GLOBAL batch (every rank holds the full batch)::

        loss = sum_{samples i} sum_{response tokens t of i} c_i * l_t

    with ``l_t`` from :func:`value_loss` (the spec's ``cliprange_value``, ``value_loss_coef``) and
    ``c_i`` from :func:`~chatlearn.algorithms.grpo.sample_loss_coefficients` (``loss_agg_mode``,
    ``max_response_tokens_length`` and the batch's optional ``sample_weights``, exactly as
    :class:`~chatlearn.algorithms.grpo.GRPOLoss`: token-mean is c_i = w_i / T_global). The tokens are
    the ones a loss covers (``chatlearn.models.base.response_positions``: a multi-turn observation is
    not one). The batch must hold ``values`` (V_old: the critic's values before the update) and
    ``returns`` (R), both per token.

    The same interface as GRPOLoss for the trainers: :meth:`terms` per micro-batch, the sums named by
    :attr:`SUMS` (:meth:`token_sums`, all-reduced by the caller) and :meth:`metrics` of them. The
    critic has no entropy term, no rollout log-probs to track and no rollout correction.
    """

    with_entropy = False
    tracks_rollout = False
    correction = "none"
    SUMS = VALUE_SUMS

    def __init__(self, spec, batch: dict, device: torch.device):
        """``spec``: the critic's :class:`~chatlearn.models.specs.TrainerSpec` (its loss fields)."""
        self.spec, self.batch, self.device = spec, batch, device
        self.offsets = np.asarray(batch["offsets"])
        lens = loss_token_counts(batch)
        self.weights = GRPOLoss.sample_weights(batch)
        self.num_tokens = int(lens.sum())
        self.kept_tokens = float((self.weights * lens).sum())
        if self.num_tokens == 0:
            raise ValueError("the batch has no response tokens")
        missing = [key for key in ("values", "returns") if key not in batch]
        if missing:
            raise ValueError(f"the critic's value loss needs {' and '.join(missing)} in the batch")
        if spec.cliprange_value is not None and not spec.cliprange_value > 0:
            raise ValueError(f"cliprange_value={spec.cliprange_value} must be > 0 (or None: no clipping)")
        self.coef = sample_loss_coefficients(spec.loss_agg_mode, lens, self.weights,
                                             spec.max_response_tokens_length)
        self.old_values = np.asarray(batch["values"], np.float32)
        self.returns = np.asarray(batch["returns"], np.float32)

    def _tensor(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values)).to(self.device, torch.float32)

    def terms(self, values: torch.Tensor, entropy: torch.Tensor | None, pos: np.ndarray):
        """Per-token terms for the response tokens at positions ``pos`` of ``batch["tokens"]``
        (``values``: the critic's predictions for them, in that order; ``entropy`` is ignored).
        Returns ``(terms, coef, weight)``: ``{"loss": l (before c), "clipped", "values" (V,
        detached), "error" ((V - R)^2, detached)}``, and each token's c_i and w_i (float32)."""
        sample = np.searchsorted(self.offsets, pos, side="right") - 1
        old = self._tensor(self.old_values[pos])
        ret = self._tensor(self.returns[pos])
        loss, clipped = value_loss(values, old, ret, self.spec.cliprange_value, self.spec.value_loss_coef)
        with torch.no_grad():
            error = (values.detach() - ret) ** 2
        terms = {"loss": loss, "clipped": clipped, "values": values.detach(), "error": error}
        return terms, self._tensor(self.coef[sample]), self._tensor(self.weights[sample])

    def token_sums(self, terms: dict, coef: torch.Tensor, weight: torch.Tensor,
                   entropy: torch.Tensor | None = None) -> torch.Tensor:
        """float64 [len(SUMS)] sums of one micro-batch: sum c*l, and the weight-masked sums of the
        clipped indicator, of V and of (V - R)^2 (see :meth:`metrics`)."""
        with torch.no_grad():
            w = weight.double()
            return torch.stack([
                (terms["loss"].double() * coef.double()).sum(),
                (terms["clipped"].double() * w).sum(),
                (terms["values"].double() * w).sum(),
                (terms["error"].double() * w).sum(),
            ])

    def metrics(self, sums: list[float], *_ignored) -> dict:
        """Metrics of the global batch from the all-reduced :meth:`token_sums`: ``value_loss`` (the
        aggregated loss sum c*l) and ``loss`` (the same number: the trainers' step reads it),
        ``value_clip_frac``, ``values_mean`` and ``value_error`` (mean (V - R)^2) as token means over
        the kept tokens (weighted by the sample weights), ``num_tokens`` (all response tokens). The
        further arguments (GRPOLoss's max-reduced values) are ignored."""
        s = dict(zip(self.SUMS, sums))
        denom = max(self.kept_tokens, 1.0)
        return {"loss": s["loss"], "value_loss": s["loss"], "value_clip_frac": s["value_clipped"] / denom,
                "values_mean": s["values"] / denom, "value_error": s["value_error"] / denom,
                "num_tokens": float(self.num_tokens)}
