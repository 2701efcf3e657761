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

so backward needs no communication. ``z = logits / T`` (the sampling temperature T), and
everything is computed ``chunk_tokens`` tokens at a time (see :func:`vocab_parallel_logprobs`).
Nothing here depends on Megatron: any process group works, and ``group=None`` means an
unsplit vocabulary (one rank).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """float32 (float64 for float64 input) ``logits / temperature``: a new tensor."""
    z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    return z / temperature


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    """Forward and backward ``chunk`` tokens at a time. Saved for backward: the input logits
    (already alive in the model's dtype) and, per token, the log-normaliser ``m + log S`` and
    the entropy; each chunk's probabilities are recomputed from them in backward (no
    communication), so no ``[tokens, V_local]`` float32 tensor larger than one chunk exists."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group, with_entropy, temperature, chunk):
        tokens, width = logits.shape
        out_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        logp = torch.empty(tokens, dtype=out_dtype, device=logits.device)
        entropy = torch.zeros(tokens, dtype=out_dtype, device=logits.device)
        lognorm = torch.empty(tokens, dtype=out_dtype, device=logits.device)
        for start in range(0, tokens, chunk):
            end = min(start + chunk, tokens)
            z = _scaled(logits[start:end], temperature)
            m = z.max(dim=-1).values
            _all_reduce(m, dist.ReduceOp.MAX, group)
            z.sub_(m.unsqueeze(-1))
            local = target[start:end] - vocab_start
            owned = (local >= 0) & (local < width)
            index = torch.where(owned, local, torch.zeros_like(local))
            picked = torch.where(owned, z.gather(-1, index.unsqueeze(-1)).squeeze(-1),
                                 torch.zeros_like(m))
            e = torch.exp(z)
            sums = [e.sum(-1), picked]
            if with_entropy:
                sums.append(e.mul_(z).sum(-1))  # in place: e is not needed any more
            del e, z
            sums = _all_reduce(torch.stack(sums), dist.ReduceOp.SUM, group)
            log_s = torch.log(sums[0])
            logp[start:end] = sums[1] - log_s
            lognorm[start:end] = m + log_s
            if with_entropy:
                entropy[start:end] = log_s - sums[2] / sums[0]
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logits, target, lognorm, entropy)
        ctx.args = (vocab_start, with_entropy, temperature, chunk)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, target, lognorm, entropy = ctx.saved_tensors
        vocab_start, with_entropy, temperature, chunk = ctx.args
        grad = torch.empty_like(logits)
        width = logits.shape[-1]
        for start in range(0, logits.shape[0], chunk):
            end = min(start + chunk, logits.shape[0])
            logq = _scaled(logits[start:end], temperature).sub_(lognorm[start:end].unsqueeze(-1))
            probs = torch.exp(logq)  # softmax over the full vocabulary, this rank's slice
            if grad_logp is None:
                g = torch.zeros_like(probs)
            else:
                g_logp = grad_logp[start:end]
                g = probs * (-g_logp).unsqueeze(-1)
                local = target[start:end] - vocab_start
                owned = (local >= 0) & (local < width)
                index = torch.where(owned, local, torch.zeros_like(local))
                hit = torch.where(owned, g_logp, torch.zeros_like(g_logp))
                g.scatter_add_(-1, index.unsqueeze(-1), hit.unsqueeze(-1))
            if with_entropy and grad_entropy is not None:
                # -p_v (log p_v + H)
                g -= probs * (logq + entropy[start:end].unsqueeze(-1)) \
                    * grad_entropy[start:end].unsqueeze(-1)
            grad[start:end] = g.div_(temperature)
        return grad, None, None, None, None, None, None


def vocab_parallel_logprobs(logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0,
                            group: dist.ProcessGroup | None = None,
                            with_entropy: bool = False, temperature: float = 1.0,
                            chunk_tokens: int | None = None):
    """log softmax(logits / temperature)[target] (and the entropy of that distribution) over
    a vocabulary split across ``group``, without gathering the logits.

    logits: ``[M, V_local]``, this rank's vocabulary slice, which starts at global id
    ``vocab_start`` (without padding columns; any float dtype, computed in float32).
    target: ``[M]`` global token ids. Returns float32 ``(logp, entropy)`` shaped like
    ``target`` (float64 for float64 logits); ``entropy`` is ``None`` unless
    ``with_entropy``. Differentiable in ``logits``; a collective over ``group`` (every rank
    calls it with its own slice and the same ``M`` and ``chunk_tokens``).

    ``chunk_tokens``: tokens per chunk (all at once when ``None``). Memory beyond the
    inputs and the ``[M]`` results is one chunk's ``[chunk_tokens, V_local]`` float32
    working set, forward and backward (plus the gradient of ``logits``, in their dtype);
    each chunk all-reduces its own maxima and sums.
    """
    if chunk_tokens is not None and int(chunk_tokens) < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    chunk = max(1, logits.shape[0]) if chunk_tokens is None else int(chunk_tokens)
    logp, entropy = _VocabParallelLogprobEntropy.apply(logits, target, vocab_start, group,
                                                       with_entropy, float(temperature), chunk)
    return logp, (entropy if with_entropy else None)


def vocab_parallel_topk(logits: torch.Tensor, k: int, vocab_start: int = 0,
                        group: dist.ProcessGroup | None = None, temperature: float = 1.0):
    """The ``k`` most likely tokens of ``softmax(logits / temperature)`` over a vocabulary split across ``group``
    (a distillation teacher's top-k and argmax with tensor parallelism): ``(log-probs [M, k] float32, global ids
    [M, k] int64)``, most likely first, the same on every rank. No gradient; a collective over ``group``.

    Each rank takes the top ``min(k, V_local)`` of its own slice (ids shifted by ``vocab_start``); the ranks'
    candidates are all-gathered (``tp x k`` per token, not the logits) and the top ``k`` of them kept: the
    global top ``k`` is among them, since each of its members is in its own rank's top ``k``. The log-normaliser
    is all-reduced as in :func:`vocab_parallel_logprobs` (a maximum, then a sum). Equal logits on different ranks
    are ordered by the gathered order (the lower rank's first), as one rank's ``topk`` would not promise either.
    ``k`` larger than the vocabulary is refused (ValueError)."""
    with torch.no_grad():
        z = _scaled(logits, temperature)
        world = dist.get_world_size(group) if group is not None else 1
        local = min(int(k), z.shape[-1])
        values, ids = z.topk(local, dim=-1)
        ids = ids + int(vocab_start)
        m = _all_reduce(z.max(dim=-1).values, dist.ReduceOp.MAX, group)
        norm = m + _all_reduce(torch.exp(z - m[:, None]).sum(-1), dist.ReduceOp.SUM, group).log()
        if world > 1:
            vs, gs = [torch.empty_like(values) for _ in range(world)], [torch.empty_like(ids) for _ in range(world)]
            dist.all_gather(vs, values.contiguous(), group=group)
            dist.all_gather(gs, ids.contiguous(), group=group)
            values, ids = torch.cat(vs, -1), torch.cat(gs, -1)
        if int(k) > values.shape[-1]:
            raise ValueError(f"k={k} is larger than the vocabulary ({values.shape[-1]} tokens)")
        best, where = values.topk(int(k), dim=-1)
        return (best - norm[:, None]).float(), ids.gather(-1, where)
