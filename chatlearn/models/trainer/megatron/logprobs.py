"""Log-probabilities and entropy over a vocabulary split across tensor-parallel ranks.

With tensor parallelism the output layer is column-parallel: rank r holds the logits of
its vocabulary slice ``[r*V/tp, (r+1)*V/tp)`` only. Gathering the full ``[M, V]`` logits on
every rank would cost ``tp`` times the memory; instead a maximum and two or three sums per
token are all-reduced over the tensor-parallel group:

    m     = max_v z_v                                   (MAX;  a shift for stability)
    S     = sum_v exp(z_v - m)                          (SUM)
    z_tgt = z_target - m, taken on the rank that owns the target   (SUM; 0 elsewhere)
    E     = sum_v exp(z_v - m) * (z_v - m)              (SUM; only for the entropy)

    log p(target) = z_tgt - log S
    H             = log S - E / S

Gradients (per rank, for its own slice; the upstream gradients are the same on every rank
of the group because everything downstream is computed identically there)::

    d logp / d z_v = 1[v = target] - p_v
    d H    / d z_v = -p_v (log p_v + H)

so backward needs no communication. The caller divides logits by the sampling temperature
first (``z = logits / T``). Nothing here depends on Megatron: any process group works, and
``group=None`` means an unsplit vocabulary (one rank).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group, with_entropy):
        z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
        m = z.max(dim=-1).values
        _all_reduce(m, dist.ReduceOp.MAX, group)
        z = z - m.unsqueeze(-1)
        e = torch.exp(z)
        local = target - vocab_start
        owned = (local >= 0) & (local < z.shape[-1])
        index = torch.where(owned, local, torch.zeros_like(local))
        picked = torch.where(owned, z.gather(-1, index.unsqueeze(-1)).squeeze(-1),
                             torch.zeros_like(m))
        sums = [e.sum(-1), picked] + ([(e * z).sum(-1)] if with_entropy else [])
        sums = _all_reduce(torch.stack(sums), dist.ReduceOp.SUM, group)
        log_s = torch.log(sums[0])
        logp = sums[1] - log_s
        probs = e.div_(sums[0].unsqueeze(-1))  # softmax over the full vocabulary, local slice
        if with_entropy:
            entropy = log_s - sums[2] / sums[0]
        else:
            entropy = torch.zeros_like(logp)
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(probs, index, owned, entropy)
        ctx.with_entropy = with_entropy
        ctx.input_dtype = logits.dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        probs, index, owned, entropy = ctx.saved_tensors
        if grad_logp is None:
            grad = torch.zeros_like(probs)
        else:
            grad = probs * (-grad_logp).unsqueeze(-1)
            hit = torch.where(owned, grad_logp, torch.zeros_like(grad_logp))
            grad.scatter_add_(-1, index.unsqueeze(-1), hit.unsqueeze(-1))
        if ctx.with_entropy and grad_entropy is not None:
            # -p_v (log p_v + H); xlogy gives 0 where p_v underflows to 0
            grad -= (torch.xlogy(probs, probs) + probs * entropy.unsqueeze(-1)) \
                * grad_entropy.unsqueeze(-1)
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0,
                            group: dist.ProcessGroup | None = None,
                            with_entropy: bool = False):
    """log softmax(logits)[target] (and the entropy of softmax(logits)) over a vocabulary
    split across ``group``, without gathering the logits.

    logits: ``[..., V_local]``, this rank's vocabulary slice, which starts at global id
    ``vocab_start`` (already divided by the temperature, and without padding columns).
    target: ``[...]`` global token ids. Returns float32 ``(logp, entropy)`` shaped like
    ``target`` (float64 for float64 logits); ``entropy`` is ``None`` unless
    ``with_entropy``. Differentiable in ``logits``; a collective over ``group`` (every rank
    calls it with its own slice).
    """
    logp, entropy = _VocabParallelLogprobEntropy.apply(logits, target, vocab_start, group,
                                                       with_entropy)
    return logp, (entropy if with_entropy else None)
