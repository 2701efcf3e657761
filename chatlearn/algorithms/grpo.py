"""GRPO as pure functions: group-relative advantages, the PPO-clip loss, the k3 KL estimator.

Nothing here knows about models, ranks or batches: per-token functions take 1-D (or any
shape, elementwise) tensors of the *response* tokens only, and return per-token values that
the caller reduces (see ``masked_sum`` / ``masked_mean``).
"""
from __future__ import annotations

import numpy as np
import torch

KL_LOG_RATIO_CLAMP = 20.0


def group_advantages(rewards: np.ndarray, group_size: int, eps: float = 1e-6) -> np.ndarray:
    """GRPO advantages; the ``group_size`` samples of one prompt are contiguous.

        A_i = (r_i - mean_g) / (std_g + eps),   std_g = sqrt(sum_j (r_j - mean_g)^2 / (G - 1))

    (unbiased std, as ``torch.std`` and verl). A group whose rewards are all equal gets
    A = 0 exactly. With ``group_size == 1`` the std is undefined: every advantage is 0.
    Returns float32 [N].
    """
    r = np.asarray(rewards, dtype=np.float64)
    if group_size < 1 or r.size % group_size:
        raise ValueError(f"{r.size} rewards do not split into groups of {group_size}")
    g = r.reshape(-1, group_size)
    mean = g.mean(axis=1, keepdims=True)
    if group_size == 1:
        return np.zeros(r.size, dtype=np.float32)
    std = g.std(axis=1, ddof=1, keepdims=True)
    adv = (g - mean) / (std + eps)
    adv[np.all(g == g[:, :1], axis=1)] = 0.0  # exact zero for constant groups
    return adv.reshape(-1).astype(np.float32)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                pos_clip_ratio: float, neg_clip_ratio: float):
    """PPO-clip loss per token with asymmetric bounds.

        ratio = exp(logp - old_logp)
        loss  = max(-A * ratio, -A * clamp(ratio, 1 - neg_clip_ratio, 1 + pos_clip_ratio))

    ``clipped`` marks the tokens where the clipped term is strictly larger (those give no
    gradient), as verl's ``pg_clipfrac``. Returns ``(loss, clipped)``, both shaped like
    ``logp`` (``clipped`` is bool).
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped_term = -advantages * torch.clamp(ratio, 1.0 - neg_clip_ratio, 1.0 + pos_clip_ratio)
    return torch.maximum(unclipped, clipped_term), clipped_term > unclipped


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per token (Schulman), always >= 0.

        d  = clamp(ref_logp - logp, -20, 20)
        k3 = exp(d) - d - 1
    """
    d = torch.clamp(ref_logp - logp, -KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim.

        H = logsumexp(z) - sum_v softmax(z)_v * z_v
    """
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[target] = z_target - logsumexp(z), without the [.., V] log_softmax."""
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_j values_j * mask_j (mask bool or 0/1)."""
    return (values * mask.to(values.dtype)).sum()


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_j values_j * mask_j / max(sum_j mask_j, 1)."""
    return masked_sum(values, mask) / mask.to(values.dtype).sum().clamp(min=1.0)


def loss_metrics(sums: list[float], num_tokens: int, has_ref: bool, with_entropy: bool) -> dict:
    """Token means over a global batch from the all-reduced sums
    ``[loss, policy_loss, kl, entropy, clipped]`` of its ``num_tokens`` response tokens."""
    mean = [x / num_tokens for x in sums]
    metrics = {"loss": mean[0], "policy_loss": mean[1], "clip_frac": mean[4], "num_tokens": float(num_tokens)}
    if has_ref:
        metrics["kl"] = mean[2]
    if with_entropy:
        metrics["entropy"] = mean[3]
    return metrics
