"""GRPO as pure functions: policy losses, loss aggregation, the trainers' loss (the advantage
estimators, numpy only, are in :mod:`chatlearn.algorithms.advantages`; the KL estimators in
:mod:`chatlearn.algorithms.kl`).

Nothing here knows about models, ranks or devices. Per-token functions take 1-D tensors of
the *response* tokens of some samples (flat, sample after sample, no padding) and return
per-token values; ``seq`` (int64, same length) gives each token's sample (0..S-1) where a
function needs the sample boundaries. Losses are aggregated over the GLOBAL batch by
per-sample coefficients (:func:`sample_loss_coefficients`): loss = sum_t c_{i(t)} * l_t,
so each rank can add up its own tokens and the sum over ranks is the global aggregate.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from chatlearn.algorithms.advantages import loss_token_counts
from chatlearn.algorithms.gkd import GKDRows, TeacherTopK
from chatlearn.algorithms.kl import kl_penalty
from chatlearn.config import registry

GSPO_LOG_RATIO_MAX = 10.0

# the names are declared in chatlearn.config.registry (what the config accepts); the functions
# registered below implement them
LOSS_AGG_MODES = registry.LOSS_AGG_MODES.names
POLICY_LOSSES = registry.POLICY_LOSSES.declared


# ---------------------------------------------------------------------------- policy losses
def importance_ratio(logp: torch.Tensor, old_logp: torch.Tensor, seq: torch.Tensor | None = None) -> torch.Tensor:
    """The ratio the policy loss clips: ``exp(logp - old_logp)`` per token, or with ``seq`` (each
    token's sample index) GSPO's sequence-level ratio in its per-token stop-gradient form (see
    :func:`policy_loss`)."""
    if seq is None:
        log_ratio = logp - old_logp
    else:
        diff = (logp - old_logp).detach()
        num = int(seq.max()) + 1 if seq.numel() else 0
        sums = torch.zeros(num, dtype=diff.dtype, device=diff.device).index_add_(0, seq, diff)
        counts = torch.bincount(seq, minlength=num).to(diff.dtype).clamp(min=1)
        log_ratio = logp - logp.detach() + (sums / counts)[seq]
        log_ratio = torch.clamp(log_ratio, max=GSPO_LOG_RATIO_MAX)
    return torch.exp(log_ratio)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                pos_clip_ratio: float, neg_clip_ratio: float, clip_ratio_c: float | None = None,
                seq: torch.Tensor | None = None):
    """Clipped surrogate loss per token (PPO, Schulman et al. 2017; asymmetric bounds as
    DAPO's clip-higher; verl ``compute_policy_loss``).

        ratio = exp(logp - old_logp)                              (token level)
        L1    = max(-A * ratio, -A * clamp(ratio, 1 - neg_clip_ratio, 1 + pos_clip_ratio))

    Dual clip (Ye et al. 2020, verl ``clip_ratio_c``), when ``clip_ratio_c`` is set (> 1):
    for A < 0 the loss is min(L1, -A * clip_ratio_c), which bounds it when the ratio is large.

    GSPO (Zheng et al. 2025, verl ``gspo``), when ``seq`` (each token's sample index) is given:
    the sequence-level ratio s_i = exp(mean_{t in i}(logp - old_logp)) replaces the token
    ratio, in the per-token stop-gradient form

        log ratio_t = logp_t - sg(logp_t) + sg(mean_{t' in i}(logp_t' - old_logp_t'))

    (its value is s_i; its gradient is s_i * d logp_t), clamped at 10 as verl.

    Returns ``(loss, clipped, clipped_lower)`` shaped like ``logp``: ``clipped`` marks the
    tokens where the clipped term is strictly larger (no gradient; verl ``pg_clipfrac``),
    ``clipped_lower`` those where the dual clip bound is strictly smaller (A < 0; verl
    ``pg_clipfrac_lower``; all False without dual clip).
    """
    ratio = importance_ratio(logp, old_logp, seq)
    unclipped = -advantages * ratio
    clipped_term = -advantages * torch.clamp(ratio, 1.0 - neg_clip_ratio, 1.0 + pos_clip_ratio)
    loss = torch.maximum(unclipped, clipped_term)
    clipped = clipped_term > unclipped
    if clip_ratio_c is None:
        return loss, clipped, torch.zeros_like(clipped)
    bound = -advantages * clip_ratio_c
    negative = advantages < 0
    clipped_lower = negative & (loss > bound)
    return torch.where(negative, torch.minimum(loss, bound), loss), clipped, clipped_lower


# Each policy loss (the built-ins below, and a plugged one: chatlearn.plugins.register_policy_loss):
# (logp, old_logp, advantages, seq, spec) -> (loss, clipped, clipped_lower, ratio), each shaped like logp: see
# grpo_token_losses, which calls it.
@registry.POLICY_LOSSES.register("vanilla")
def vanilla_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, seq: torch.Tensor,
                        spec):
    """PPO's clipped surrogate with the token ratio (:func:`policy_loss` without ``seq``; verl ``vanilla``)."""
    return _clipped(logp, old_logp, advantages, None, spec)


@registry.POLICY_LOSSES.register("gspo")
def gspo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, seq: torch.Tensor,
                     spec):
    """GSPO: the clipped surrogate with the sequence-level ratio (:func:`policy_loss` with ``seq``; verl
    ``gspo``)."""
    return _clipped(logp, old_logp, advantages, seq, spec)


def _clipped(logp, old_logp, advantages, seq, spec):
    """:func:`policy_loss` with the spec's clip settings, and the ratio it clips, detached."""
    loss, clipped, clipped_lower = policy_loss(logp, old_logp, advantages, spec.pos_clip_ratio,
                                               spec.neg_clip_ratio, spec.clip_ratio_c, seq)
    with torch.no_grad():
        ratio = importance_ratio(logp, old_logp, seq)
    return loss, clipped, clipped_lower, ratio


# ---------------------------------------------------------------------------- rollout correction
IS_LOG_RATIO_CLAMP = 20.0  # |log rho| bound before exp (verl's SAFETY_BOUND)
ROLLOUT_CORRECTIONS = ("none", "tis", "mis", "decoupled")
CORRECTION_LEVELS = ("token", "sequence", "geometric")


def correction_log_ratio(prox_logp: torch.Tensor, behav_logp: torch.Tensor, seq: torch.Tensor,
                         level: str) -> torch.Tensor:
    """log rho per token, detached, between the proximal policy (the trainer's log-probs before the
    update) and the behaviour policy (the rollout engine's), with ``d_t = prox_t - behav_t``:

        token       log rho_t = d_t
        sequence    log rho_t = sum_{t' in i(t)} d_t'        (the sequence's likelihood ratio)
        geometric   log rho_t = mean_{t' in i(t)} d_t'       (its geometric mean per token)

    clamped to [-20, 20]. ``seq``: each token's sample index (all of a sample's tokens are in
    the same call, as for GSPO)."""
    d = (prox_logp - behav_logp).detach()
    if level != "token":
        num = int(seq.max()) + 1 if seq.numel() else 0
        sums = torch.zeros(num, dtype=d.dtype, device=d.device).index_add_(0, seq, d)
        if level == "geometric":
            sums = sums / torch.bincount(seq, minlength=num).to(d.dtype).clamp(min=1)
        elif level != "sequence":
            raise ValueError(f"unknown rollout correction level {level!r}; one of {CORRECTION_LEVELS}")
        d = sums[seq]
    return torch.clamp(d, -IS_LOG_RATIO_CLAMP, IS_LOG_RATIO_CLAMP)


def rollout_is_weights(log_rho: torch.Tensor, mode: str, upper: float, lower: float | None,
                       anchored_at_behaviour: bool = False):
    """The detached per-token weight of the policy loss that corrects for the rollout engine's
    (behaviour) distribution, rho = exp(log_rho) (:func:`correction_log_ratio`), C = ``upper``:

        tis        w = min(rho, C)                       truncated IS (Yao et al. 2025; verl rollout_is)
        mis        w = rho * 1[lower <= rho <= C]        masked IS (Liu, Li et al. 2025; verl mask mode)
        decoupled  w = rho * 1[rho <= C]                 decoupled PPO's behaviour weight (Hilton et al.
                                                         2021; AReaL behav_imp_weight_cap)

    With ``anchored_at_behaviour`` (``old_logprobs: rollout``: the PPO ratio is taken against the
    behaviour policy, so its value at the current weights already holds rho) the weight is w / rho:
    ``min(1, C / rho)`` (tis) or the mask alone (mis), so that the product with the PPO ratio is the
    corrected weight; decoupled needs a proximal policy apart from the behaviour one and is refused
    there (chatlearn.config.algorithm_keys).

    Returns ``(w, clipped, masked)``: ``clipped`` the tokens whose rho exceeds C under tis,
    ``masked`` those whose weight the band zeroes (mis, decoupled)."""
    log_rho = log_rho.detach()
    rho = torch.exp(log_rho)
    none = torch.zeros_like(rho, dtype=torch.bool)
    if mode == "tis":
        clipped = rho > upper
        w = (torch.clamp(torch.exp(math.log(upper) - log_rho), max=1.0) if anchored_at_behaviour
             else torch.clamp(rho, max=upper))
        return w, clipped, none
    if mode == "mis":
        keep = (rho >= lower) & (rho <= upper)
    elif mode == "decoupled":
        keep = rho <= upper
    else:
        raise ValueError(f"unknown rollout correction {mode!r}; one of {ROLLOUT_CORRECTIONS[1:]}")
    w = keep.to(rho.dtype) if anchored_at_behaviour else torch.where(keep, rho, torch.zeros_like(rho))
    return w, none, ~keep


# ---------------------------------------------------------------------------- aggregation
def sample_loss_coefficients(mode: str, response_lens: np.ndarray, sample_weights: np.ndarray,
                             max_response_len: int) -> np.ndarray:
    """float64 [N]: c_i such that the global loss is sum_i sum_{t in i} c_i * l_t over the
    GLOBAL batch (all ranks, all micro-batches), with w_i the sample weights (0: filtered),
    n_i the response lengths, T = sum_i w_i n_i, S = sum_i w_i and L = ``max_response_len``
    (verl ``agg_loss`` mode names):

        token-mean               c_i = w_i / T                (DAPO; verl's default)
        seq-mean-token-mean      c_i = w_i / (n_i * S)        (GRPO paper)
        seq-mean-token-sum       c_i = w_i / S
        seq-mean-token-sum-norm  c_i = w_i / (L * S)          (Dr. GRPO: a constant length)

    A batch with T = 0 (or S = 0) gets all-zero coefficients.
    """
    w = np.asarray(sample_weights, dtype=np.float64)
    n = np.asarray(response_lens, dtype=np.float64)
    tokens, seqs = float((w * n).sum()), float(w.sum())
    if tokens == 0 or seqs == 0:
        return np.zeros_like(w)
    return registry.LOSS_AGG_MODES.get(mode)(w, n, tokens, seqs, max_response_len)


# Each mode: (w, n, T, S, L) as in sample_loss_coefficients -> c float64 [N].
@registry.LOSS_AGG_MODES.register("token-mean")
def _token_mean(w, n, tokens, seqs, max_response_len):
    return w / tokens


@registry.LOSS_AGG_MODES.register("seq-mean-token-mean")
def _seq_mean_token_mean(w, n, tokens, seqs, max_response_len):
    return w / (np.maximum(n, 1.0) * seqs)


@registry.LOSS_AGG_MODES.register("seq-mean-token-sum")
def _seq_mean_token_sum(w, n, tokens, seqs, max_response_len):
    return w / seqs


@registry.LOSS_AGG_MODES.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(w, n, tokens, seqs, max_response_len):
    return w / (float(max_response_len) * seqs)


def grpo_token_losses(spec, logp: torch.Tensor, old_logp: torch.Tensor,
                      advantages: torch.Tensor, seq: torch.Tensor,
                      ref_logp: torch.Tensor | None, entropy: torch.Tensor | None,
                      is_weight: torch.Tensor | None = None) -> dict:
    """The per-token terms of the trainers' loss, from the fields policy_loss (and the clip settings it
    reads), kl_coef, kl_estimator, kl_in_reward and entropy_coef of ``spec`` (the trainer's
    :class:`chatlearn.models.specs.TrainerSpec`, read as attributes):

        loss_t = w_t * pg_t + kl_coef * kl_t * [not kl_in_reward] - entropy_coef * H_t

    (pg_t from the policy loss ``spec.policy_loss`` of :data:`~chatlearn.config.registry.POLICY_LOSSES`:
    :func:`vanilla_policy_loss`, :func:`gspo_policy_loss` or a plugged one, called as
    ``(logp, old_logp, advantages, seq, spec)``; kl_t from :func:`kl_penalty`, w_t the detached rollout
    correction weight ``is_weight`` of :func:`rollout_is_weights`, 1 without it). Returns tensors
    ``loss, pg (weighted), kl (or None without ref_logp), clipped, clipped_lower`` and ``ratio``
    (the importance ratio the loss clips, detached: for the ``ratio_mean`` metric).
    """
    pg, clipped, clipped_lower, ratio = registry.POLICY_LOSSES.get(spec.policy_loss)(
        logp, old_logp, advantages, seq, spec)
    ratio = ratio.detach()  # a metric (a plugged loss may hand back the ratio it differentiates)
    if is_weight is not None:
        pg = pg * is_weight.detach()
    loss = pg
    kl = kl_penalty(logp, ref_logp, spec.kl_estimator) if ref_logp is not None else None
    if spec.kl_coef > 0 and not spec.kl_in_reward:
        loss = loss + spec.kl_coef * kl
    if spec.entropy_coef > 0:
        loss = loss - spec.entropy_coef * entropy
    return {"loss": loss, "pg": pg, "kl": kl, "clipped": clipped, "clipped_lower": clipped_lower, "ratio": ratio}


def needs_ref_logprobs(spec) -> bool:
    """Whether the trainer's loss needs ``ref_logprobs`` (a KL loss term; ``spec``: its
    :class:`~chatlearn.models.specs.TrainerSpec`)."""
    return spec.kl_coef > 0 and not spec.kl_in_reward


# ---------------------------------------------------------------------------- misc
def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim.

        H = logsumexp(z) - sum_v softmax(z)_v * z_v
    """
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] = z_target - logsumexp(z), without the [.., V] log_softmax."""
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


# with_entropy of the log-prob passes: the second output is the argmax agreement, not the entropy
TOP1 = "top1"


def _chunk_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor,
                            temperature: float, with_entropy):
    """One chunk: z = float(hidden @ weight.T + bias) / temperature, then log-probs and, with ``with_entropy``,
    the entropy (True) or, with ``"top1"``, 1.0 where the target is the distribution's most likely token (a
    distillation teacher's agreement with the student's samples); with a
    :class:`~chatlearn.algorithms.gkd.TeacherTopK` its outputs (the agreement, the top-k log-probs and ids),
    with a :class:`~chatlearn.algorithms.gkd.GKDRows` (this chunk's) the GKD divergence of each row."""
    raw = torch.nn.functional.linear(hidden, weight, bias).float()
    z = raw / temperature
    logp = logprobs_from_logits(z, targets)
    if isinstance(with_entropy, TeacherTopK):
        return (logp, *with_entropy.outputs(z, targets))
    if isinstance(with_entropy, GKDRows):
        return logp, with_entropy.outputs(raw)
    if with_entropy == TOP1:
        return logp, (z.argmax(dim=-1) == targets).float()
    return (logp, entropy_from_logits(z)) if with_entropy else (logp,)


def chunked_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                             temperature: float, chunk: int, with_entropy: bool,
                             bias: torch.Tensor | None = None):
    """Log-probs (and entropy) of ``targets`` under ``softmax((hidden @ weight.T + bias) / T)``,
    ``chunk`` rows at a time, so that no ``[rows, V]`` tensor is ever made.

    hidden [M, H], weight [V, H] (an LM head), targets int64 [M]. Returns ``(logp [M],
    entropy [M] or None)`` in float32 (``with_entropy`` :data:`TOP1`: 1.0/0.0 argmax agreement in place of
    the entropy; a :class:`~chatlearn.algorithms.gkd.TeacherTopK`: a tuple ``(agreement [M], top-k log-probs
    [M, k], ids [M, k])``; a :class:`~chatlearn.algorithms.gkd.GKDRows` of the M rows: the GKD divergence [M],
    differentiable) (the logits are cast to float32 before the division by
    the temperature, as the unchunked path does). Values equal :func:`logprobs_from_logits` /
    :func:`entropy_from_logits` of the full logits up to matmul blocking (float32 rounding).

    Memory: without autograd each chunk's ``[chunk, V]`` logits are dropped before the next.
    With autograd each chunk runs under non-reentrant ``torch.utils.checkpoint``: only the
    chunk's inputs (a view of ``hidden``; ``weight`` is shared) are saved, and the chunk's
    logits are recomputed in backward one chunk at a time (the approach of verl's
    ``utils/experimental/torch_functional.py`` / Liger's fused linear cross-entropy), so the
    peak is one chunk's ``[chunk, V]`` float32 logits and softmax, plus a ``[V, H]`` gradient
    of ``weight`` per chunk in backward. Zero rows still give a (0-row) result connected to
    ``hidden`` and ``weight``, so a backward through it reaches every layer.
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1")
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))
    logps, ents = [], []
    modes = (with_entropy.split(chunk) if isinstance(with_entropy, GKDRows)
             else [with_entropy] * len(torch.split(targets, chunk)))
    for h, t, mode in zip(torch.split(hidden, chunk), torch.split(targets, chunk), modes):
        if grad:
            out = torch.utils.checkpoint.checkpoint(
                _chunk_logprobs_entropy, h, weight, bias, t, temperature, mode,
                use_reentrant=False)
        else:
            out = _chunk_logprobs_entropy(h, weight, bias, t, temperature, mode)
        logps.append(out[0])
        if with_entropy:
            ents.append(out[1:])
    if not with_entropy:
        return torch.cat(logps), None
    second = [torch.cat(parts) for parts in zip(*ents)]
    return torch.cat(logps), (second[0] if len(second) == 1 else tuple(second))


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_j values_j * mask_j (mask bool or 0/1)."""
    return (values * mask.to(values.dtype)).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_j values_j * mask_j / max(sum_j mask_j, 1)."""
    return masked_sum(values, mask) / mask.to(values.dtype).sum().clamp(min=1.0)


LOSS_SUMS = ("loss", "policy_loss", "kl", "entropy", "clip_frac", "clip_frac_lower", "ratio_mean",
             "rollout_diff", "rollout_kl", "rollout_tokens",
             "is_weight", "is_clipped", "is_masked", "is_mismatch_kl")
# with a rollout correction (rollout_correction), the weight-masked sums of its weight, of the tokens it
# truncated (tis) or masked (mis, decoupled) and of the k3 mismatch term exp(d) - d - 1 of
# d = prox - behaviour log-prob per token; the largest weight is max-reduced apart (is_weight_max)
# with no old log-probs in the batch, the step's own forward stands for them, and the loss reports how
# far they are from the rollout engine's (metrics of every response token, sample weights left out):
# ROLLOUT_MISMATCH (chatlearn.algorithms.advantages) names those sums


def loss_metrics(sums: list[float], num_tokens: int, kept_tokens: float, has_ref: bool,
                 with_entropy: bool, dual_clip: bool, rollout_diff_max: float | None = None,
                 correction: str = "none", is_weight_max: float | None = None) -> dict:
    """Metrics of a global batch from the all-reduced sums named by ``LOSS_SUMS``: ``loss``
    and ``policy_loss`` are already aggregated (sum_t c_t * l_t); kl, entropy, clip_frac and
    clip_frac_lower and ratio_mean (the importance ratio's token mean) are summed over the kept tokens and divided by their number
    ``kept_tokens`` (token means). ``num_tokens``: all response tokens of the batch. With
    ``rollout_diff_max`` (the batch had no old log-probs), the ``ROLLOUT_MISMATCH`` sums too. With a
    ``correction`` (not "none"): ``is_weight_mean``, ``is_weight_max`` (max-reduced apart),
    ``is_mismatch_kl`` and ``is_clip_frac`` (tis) or ``is_masked_frac`` (mis, decoupled), token means
    over the kept tokens."""
    s = dict(zip(LOSS_SUMS, sums))
    denom = max(float(kept_tokens), 1.0)
    metrics = {"loss": s["loss"], "policy_loss": s["policy_loss"],
               "clip_frac": s["clip_frac"] / denom, "ratio_mean": s["ratio_mean"] / denom,
               "num_tokens": float(num_tokens)}
    if dual_clip:
        metrics["clip_frac_lower"] = s["clip_frac_lower"] / denom
    if has_ref:
        metrics["kl"] = s["kl"] / denom
    if with_entropy:
        metrics["entropy"] = s["entropy"] / denom
    if rollout_diff_max is not None:
        metrics.update(rollout_diff_sum=s["rollout_diff"], rollout_kl_sum=s["rollout_kl"],
                       rollout_tokens=s["rollout_tokens"], rollout_diff_max=float(rollout_diff_max))
    if correction != "none":
        metrics.update(is_weight_mean=s["is_weight"] / denom, is_weight_max=float(is_weight_max or 0.0),
                       is_mismatch_kl=s["is_mismatch_kl"] / denom)
        if correction == "tis":
            metrics["is_clip_frac"] = s["is_clipped"] / denom
        else:
            metrics["is_masked_frac"] = s["is_masked"] / denom
    return metrics


def token_sums(terms: dict, coef: torch.Tensor, weight: torch.Tensor,
               entropy: torch.Tensor | None) -> torch.Tensor:
    """float64 [len(LOSS_SUMS)] sums of one micro-batch: sum c*loss, sum c*pg, the
    weight-masked sums of kl, entropy, clipped, clipped_lower, ratio, the unweighted
    rollout mismatch sums when ``terms`` has them, and the weight-masked rollout correction sums
    when ``terms`` has ``is_weight`` (see :func:`loss_metrics`)."""
    zero = terms["loss"].new_zeros(())
    mismatch = terms.get("rollout_diff")
    corrected = "is_weight" in terms
    with torch.no_grad():
        return torch.stack([
            (terms["loss"] * coef).sum(), (terms["pg"] * coef).sum(),
            (terms["kl"] * weight).sum() if terms["kl"] is not None else zero,
            (entropy * weight).sum() if entropy is not None else zero,
            (terms["clipped"].to(weight.dtype) * weight).sum(),
            (terms["clipped_lower"].to(weight.dtype) * weight).sum(),
            (terms["ratio"] * weight).sum(),
            mismatch.abs().sum() if mismatch is not None else zero,
            (torch.exp(mismatch) - mismatch - 1).sum() if mismatch is not None else zero,
            zero + mismatch.numel() if mismatch is not None else zero,
            (terms["is_weight"] * weight).sum() if corrected else zero,
            (terms["is_clipped"].to(weight.dtype) * weight).sum() if corrected else zero,
            (terms["is_masked"].to(weight.dtype) * weight).sum() if corrected else zero,
            ((torch.exp(terms["is_d"]) - terms["is_d"] - 1) * weight).sum() if corrected else zero,
        ]).double()


class GRPOLoss:
    """The trainers' loss over one GLOBAL batch (every rank holds the full batch):

        loss = sum_{samples i} sum_{response tokens t of i} c_i * loss_t

    with ``loss_t`` from :func:`grpo_token_losses` and ``c_i`` from
    :func:`sample_loss_coefficients` (``loss_agg_mode``, ``max_response_tokens_length``,
    the batch's optional per-sample ``sample_weights``: 0 drops a sample from the loss and
    from every denominator). Each rank sums c_i * loss_t over its own tokens, in any
    micro-batch order; the sum over ranks is the global aggregate. ``sample_weights`` absent
    means every weight is 1.

    ``old_logprobs`` absent means the batch is trained on by the weights that generated it
    (its first optimizer step): the old log-probs are then the forward's own, detached, which
    is exactly what a separate pass with the same weights gives (the ratio is 1, its gradient
    that of the log-probs), and with ``rollout_logprobs`` in the batch the loss also reports
    how far they are from the rollout engine's (``ROLLOUT_MISMATCH``).

    ``old_logprobs: rollout`` (spec): the batch's ``rollout_logprobs`` are the old log-probs of every
    step (no pass; verl's bypass mode), and every step reports the mismatch of its own forward
    against them (the engine keeps the first step's).

    ``rollout_correction`` (spec, resolved: none | tis | mis | decoupled) weights the policy loss by
    :func:`rollout_is_weights` of rho = proximal / behaviour probability at
    ``rollout_correction_level``: the behaviour log-probs are ``rollout_logprobs`` (which the batch
    must then hold), the proximal ones the old log-probs of the pass, or the forward's own, detached,
    where no pass gave them (the first step of ``old_logprobs: auto``, every step of ``rollout``).

    The trainers read the names of the token sums as :attr:`SUMS` and add them up with
    :meth:`token_sums` (the critic's :class:`chatlearn.algorithms.value_loss.ValueLoss` has the same).
    """

    SUMS = LOSS_SUMS

    def __init__(self, spec, batch: dict, device: torch.device):
        """``spec``: the trainer's :class:`~chatlearn.models.specs.TrainerSpec` (its loss fields)."""
        self.spec, self.batch, self.device = spec, batch, device
        self.offsets = np.asarray(batch["offsets"])
        lens = loss_token_counts(batch)  # the model's response tokens (not a multi-turn observation)
        self.weights = self.sample_weights(batch)
        self.num_tokens = int(lens.sum())
        self.kept_tokens = float((self.weights * lens).sum())
        if self.num_tokens == 0:
            raise ValueError("the batch has no response tokens")
        self.has_ref = "ref_logprobs" in batch
        if needs_ref_logprobs(spec) and not self.has_ref:
            raise ValueError("kl_coef > 0 (KL loss term) needs ref_logprobs in the batch")
        self.with_entropy = spec.entropy_coef > 0
        self.coef = sample_loss_coefficients(spec.loss_agg_mode, lens, self.weights,
                                             spec.max_response_tokens_length)
        # per-token advantages (PPO's GAE) where the batch has them, else each sample's advantage on its tokens
        self.token_advantages = (np.asarray(batch["token_advantages"], np.float32) if "token_advantages" in batch
                                 else None)
        self.advantages = None if self.token_advantages is not None else np.asarray(batch["advantages"], np.float32)
        self.rollout_old = spec.old_logprobs == "rollout"
        self.own_old = "old_logprobs" not in batch and not self.rollout_old
        self.tracks_rollout = (self.own_old or self.rollout_old) and "rollout_logprobs" in batch
        if self.rollout_old and "rollout_logprobs" not in batch:
            raise ValueError("old_logprobs: rollout needs rollout_logprobs in the batch")
        self.rollout_diff_max = torch.zeros((), dtype=torch.float64, device=device)
        self.correction = spec.rollout_correction
        if self.correction != "none" and "rollout_logprobs" not in batch:
            raise ValueError(f"rollout_correction {self.correction!r} needs rollout_logprobs in the batch")
        self.is_weight_max = torch.zeros((), dtype=torch.float64, device=device)

    @staticmethod
    def sample_weights(batch: dict) -> np.ndarray:
        """float64 [N]: the batch's ``sample_weights``, or ones."""
        n = len(batch["offsets"]) - 1
        return (np.asarray(batch["sample_weights"], np.float64) if "sample_weights" in batch
                else np.ones(n))

    def _tensor(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values)).to(self.device, torch.float32)

    def terms(self, logp: torch.Tensor, entropy: torch.Tensor | None, pos: np.ndarray):
        """Per-token terms for the response tokens at positions ``pos`` of ``batch["tokens"]``
        (``logp``, ``entropy`` in that order). Returns ``(terms, coef, weight)``: the dict of
        :func:`grpo_token_losses`, and each token's c_i and w_i (float32)."""
        sample = np.searchsorted(self.offsets, pos, side="right") - 1
        seq = torch.from_numpy(np.unique(sample, return_inverse=True)[1].reshape(-1)).to(self.device)
        ref = (self._tensor(np.asarray(self.batch["ref_logprobs"])[pos]) if self.has_ref else None)
        behav = (self._tensor(np.asarray(self.batch["rollout_logprobs"])[pos])
                 if "rollout_logprobs" in self.batch else None)
        old = (logp.detach() if self.own_old else behav if self.rollout_old
               else self._tensor(np.asarray(self.batch["old_logprobs"])[pos]))
        weights = self._tensor(self.weights[sample])
        correction = None
        if self.correction != "none":
            prox = logp.detach() if (self.own_old or self.rollout_old) else old
            log_rho = correction_log_ratio(prox, behav, seq, self.spec.rollout_correction_level)
            lower = self.spec.rollout_is_threshold_lower
            w, clipped, masked = rollout_is_weights(
                log_rho, self.correction, self.spec.rollout_is_threshold,
                1.0 / self.spec.rollout_is_threshold if lower is None else lower, self.rollout_old)
            correction = {"is_weight": w, "is_clipped": clipped, "is_masked": masked,
                          "is_d": (prox - behav).detach()}
            kept = w[weights > 0]
            if kept.numel():
                self.is_weight_max = torch.maximum(self.is_weight_max, kept.max().double())
        adv = self.token_advantages[pos] if self.token_advantages is not None else self.advantages[sample]
        terms = grpo_token_losses(self.spec, logp, old, self._tensor(adv), seq, ref, entropy,
                                  correction["is_weight"] if correction else None)
        if correction:
            terms.update(correction)
        if self.tracks_rollout:
            diff = (logp.detach() - behav).double()
            terms["rollout_diff"] = diff
            if diff.numel():  # a running max: counting a token twice (tensor-parallel ranks) changes nothing
                self.rollout_diff_max = torch.maximum(self.rollout_diff_max, diff.abs().max())
        return terms, self._tensor(self.coef[sample]), weights

    def token_sums(self, terms: dict, coef: torch.Tensor, weight: torch.Tensor,
                   entropy: torch.Tensor | None) -> torch.Tensor:
        """float64 [len(SUMS)]: the module's :func:`token_sums` of one micro-batch."""
        return token_sums(terms, coef, weight, entropy)

    def metrics(self, sums: list[float], rollout_diff_max: float | None = None,
                is_weight_max: float | None = None) -> dict:
        """:func:`loss_metrics` of the all-reduced :func:`token_sums` (and of the max-reduced
        ``rollout_diff_max`` when :attr:`tracks_rollout`, ``is_weight_max`` with a correction)."""
        return loss_metrics(sums, self.num_tokens, self.kept_tokens, self.has_ref,
                            self.with_entropy, self.spec.clip_ratio_c is not None,
                            rollout_diff_max if self.tracks_rollout else None,
                            self.correction, is_weight_max)
