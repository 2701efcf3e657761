"""Shared-prompt forwards: the samples of a micro-batch that start with the same prompt (the
``num_inference_per_prompt`` responses of a GRPO group, the trajectories of one task) run the
prompt once.

A micro-batch is one row of *units*: a unit is a prompt followed by the continuations (response,
or everything after the prompt of a multi-turn trajectory) of the samples that share it,
``[prompt | cont_1 | cont_2 | ...]``. Position ids restart at the prompt's length for each
continuation, so every token has the position it has in its own sample. Attention
(:func:`shared_prompt_attention`, registered with transformers' ``AttentionInterface``) lets a
prompt token see the earlier tokens of its prompt and a continuation token its prompt and the
earlier tokens of its own continuation: exactly the keys it has in its own sample, so the hidden
states, log-probs and gradients are those of the samples run one by one (up to float rounding:
the prompt's keys and values are computed once and their gradients summed over the continuations
that read them). A group of ``n`` samples with a prompt of ``P`` tokens computes ``(n - 1) * P``
tokens fewer: with GRPO's short answers to long prompts, most of the work.

Attention is ``scaled_dot_product_attention`` over gathered copies of the queries, keys and
values, at the cost of the samples' own attention (no ``T x T`` mask over the row), in one of two
forms. Small: two calls per layer for the whole row, the prompts ``[units, heads, P_max, d]``
(causal) and the continuations ``[samples, heads, L_max, d]`` against their prompt's and their
own keys ``[samples, heads, P_max + L_max, d]``, under explicit boolean masks. Where those masks
would pass ``MASK_ELEMENTS`` (long responses), per unit and without a mask tensor: the prompt
causal (``is_causal``), its continuations right-padded against the prompt's keys followed by their
own under the causal mask aligned to the bottom right (``torch.nn.attention.bias.
causal_lower_right``: query ``i`` sees the ``P + i + 1`` first keys, never a padded one), which
SDPA's memory-efficient CUDA kernel applies without materialising it. The outputs are put back in
row order with one gather.

Layouts reach the attention function through the decoder's keyword arguments
(``chatlearn_layout``; transformers passes a model's extra forward kwargs down to its
attention interface). A forward without one (a model not run through the trainer's batches)
is plain SDPA with transformers' own mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

ATTENTION = "chatlearn_shared_prompt"
KWARG = "chatlearn_layout"
MASK_ELEMENTS = 1 << 22  # above this many mask entries per row, attention runs per unit without masks


@dataclass
class Unit:
    """One prompt and the samples that share it, in row coordinates."""
    start: int                  # the prompt's first position in the row
    prompt_len: int
    conts: list[tuple[int, int]]  # (first position in the row, length) of each continuation


@dataclass
class UnitIndex:
    """Row positions of one unit's tokens, for the gathers of :func:`shared_prompt_attention`."""
    prompt: torch.Tensor        # [P]
    conts: torch.Tensor | None  # [n, L_max] each continuation's tokens, right-padded (None: no continuation)
    keys: torch.Tensor | None   # [n, P + L_max] the keys each continuation reads: its prompt's, then its own


@dataclass
class Layout:
    """Index tensors of one row of units, built once per forward and read by every layer: the
    batched form (``prompt_idx`` ... ``cont_mask``) or the per-unit form (``units``)."""
    inverse: torch.Tensor                     # [T] position of row token t in the concatenated outputs
    units: list[UnitIndex] | None = None
    prompt_idx: torch.Tensor | None = None    # [U, P_max] row positions of the prompts' tokens (padding: 0)
    prompt_mask: torch.Tensor | None = None   # bool [U, 1, P_max, P_max]
    cont_idx: torch.Tensor | None = None      # [R, L_max] row positions of the continuations' tokens
    cont_kv_idx: torch.Tensor | None = None   # [R, P_max + L_max] the keys each continuation reads
    cont_mask: torch.Tensor | None = None     # bool [R, 1, L_max, P_max + L_max]


def group_by_prompt(batch, idx) -> list[list[int]]:
    """The samples ``idx`` grouped by identical prompt tokens: groups in order of first appearance,
    samples in the order given."""
    off, plen, tokens = batch["offsets"], batch["prompt_lens"], batch["tokens"]
    groups: dict[bytes, list[int]] = {}
    for i in idx:
        start = int(off[i])
        key = np.asarray(tokens[start:start + int(plen[i])], dtype=np.int64).tobytes()
        groups.setdefault(key, []).append(int(i))
    return list(groups.values())


def prompt_group_ids(batch) -> np.ndarray:
    """int64 per sample: equal for samples whose prompt tokens are equal, numbered in order of
    first appearance (:func:`group_by_prompt` over the whole batch)."""
    out = np.zeros(len(batch["prompt_lens"]), np.int64)
    for g, members in enumerate(group_by_prompt(batch, range(len(out)))):
        out[members] = g
    return out


def build_layout(units: list[Unit], total: int, device, mask_elements: int | None = None) -> Layout:
    """The index tensors of ``units`` (a row of ``total`` tokens): batched with masks when these
    hold at most ``mask_elements`` (default ``MASK_ELEMENTS``) entries, else per unit."""
    mask_elements = MASK_ELEMENTS if mask_elements is None else mask_elements
    p_max = max(u.prompt_len for u in units)
    lens = [n for u in units for _, n in u.conts]
    l_max = max(lens, default=0)
    size = len(units) * p_max * p_max + len(lens) * l_max * (p_max + l_max)
    return (_batched_layout if size <= mask_elements else _unit_layout)(units, total, device)


def _batched_layout(units: list[Unit], total: int, device) -> Layout:
    """The batched form: every prompt, then every continuation, padded, with boolean masks."""
    p_max = max(u.prompt_len for u in units)
    conts = [c for u in units for c in u.conts]
    l_max = max((n for _, n in conts), default=0)
    n_units, n_conts = len(units), len(conts)
    prompt_idx = np.zeros((n_units, p_max), np.int64)
    prompt_valid = np.zeros((n_units, p_max), bool)
    cont_idx = np.zeros((n_conts, l_max), np.int64)
    cont_valid = np.zeros((n_conts, l_max), bool)
    kv_idx = np.zeros((n_conts, p_max + l_max), np.int64)
    kv_valid = np.zeros((n_conts, p_max + l_max), bool)
    inverse = np.zeros(total, np.int64)
    c = 0
    for u_i, u in enumerate(units):
        prompt_idx[u_i, :u.prompt_len] = np.arange(u.start, u.start + u.prompt_len)
        prompt_valid[u_i, :u.prompt_len] = True
        inverse[u.start:u.start + u.prompt_len] = u_i * p_max + np.arange(u.prompt_len)
        for start, n in u.conts:
            cont_idx[c, :n] = np.arange(start, start + n)
            cont_valid[c, :n] = True
            kv_idx[c, :u.prompt_len] = prompt_idx[u_i, :u.prompt_len]
            kv_valid[c, :u.prompt_len] = True
            kv_idx[c, p_max:p_max + n] = cont_idx[c, :n]
            kv_valid[c, p_max:p_max + n] = True
            inverse[start:start + n] = n_units * p_max + c * l_max + np.arange(n)
            c += 1
    causal_p = np.tril(np.ones((p_max, p_max), bool))
    # a padded query row sees key 0 (never NaN); its output is never gathered
    prompt_mask = (causal_p[None] & prompt_valid[:, None, :]) | ~prompt_valid[:, :, None]
    causal_c = np.tril(np.ones((l_max, l_max), bool))
    cont_mask = np.concatenate([np.broadcast_to(kv_valid[:, None, :p_max], (n_conts, l_max, p_max)),
                                causal_c[None] & kv_valid[:, None, p_max:]], axis=2)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return Layout(t(inverse), prompt_idx=t(prompt_idx), prompt_mask=t(prompt_mask[:, None]), cont_idx=t(cont_idx),
                  cont_kv_idx=t(kv_idx), cont_mask=t(cont_mask[:, None]))


def _unit_layout(units: list[Unit], total: int, device) -> Layout:
    """The per-unit form: index tensors only (the masks are causal, top-left or bottom-right)."""
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)  # noqa: E731
    index, inverse, done = [], np.zeros(total, np.int64), 0
    for u in units:
        prompt = np.arange(u.start, u.start + u.prompt_len)
        inverse[prompt] = done + np.arange(u.prompt_len)
        done += u.prompt_len
        if not u.conts:
            index.append(UnitIndex(t(prompt), None, None))
            continue
        l_max = max(n for _, n in u.conts)
        conts = np.zeros((len(u.conts), l_max), np.int64)
        for c, (start, n) in enumerate(u.conts):
            conts[c, :n] = np.arange(start, start + n)
            conts[c, n:] = start + n - 1  # padding repeats the last token; its outputs are never read
            inverse[start:start + n] = done + c * l_max + np.arange(n)
        done += len(u.conts) * l_max
        keys = np.concatenate([np.broadcast_to(prompt, (len(u.conts), u.prompt_len)), conts], axis=1)
        index.append(UnitIndex(t(prompt), t(conts), t(keys)))
    return Layout(t(inverse), units=index)


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [H, T, d], idx [B] -> [1, H, B, d]; idx [A, B] -> [A, H, B, d].

    ``index_select`` rather than advanced indexing: its backward is ``index_add_``, not the
    accumulating ``index_put_`` (three times faster on the CPU for these shapes)."""
    out = torch.index_select(x, 1, idx.reshape(-1)).view(x.shape[0], *idx.shape, x.shape[-1])
    return out[None] if idx.dim() == 1 else out.transpose(0, 1)


def _in_row_order(parts: list[torch.Tensor], layout: Layout) -> torch.Tensor:
    """The attention outputs ``parts`` (concatenated: ``[N, H, d]``) in row order: ``[1, T, H, d]``."""
    return torch.index_select(torch.cat(parts), 0, layout.inverse)[None]


def shared_prompt_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                            scaling: float | None = None, **kwargs):
    """transformers attention interface: query ``[1, H, T, d]``, key/value ``[1, H_kv, T, d]`` of a
    row of units (``kwargs[KWARG]``, a :class:`Layout`); returns ``([1, T, H, d], None)``."""
    from torch.nn.attention.bias import causal_lower_right

    layout: Layout | None = kwargs.pop(KWARG, None)
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"shared-prompt attention takes one row of units, got a batch of {query.shape[0]}")
    rep = query.shape[1] // key.shape[1]
    q, k, v = query[0], key[0], value[0]
    if rep > 1:  # grouped-query attention: kv head h // rep serves query head h (transformers' repeat_kv)
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
    heads, d = q.shape[0], q.shape[-1]
    parts = []
    if layout.units is None:
        p = layout.prompt_idx
        out = F.scaled_dot_product_attention(_gather(q, p), _gather(k, p), _gather(v, p),
                                             attn_mask=layout.prompt_mask, dropout_p=dropout, scale=scaling)
        parts.append(out.transpose(1, 2).reshape(-1, heads, d))
        if layout.cont_idx.numel():
            kv = layout.cont_kv_idx
            out = F.scaled_dot_product_attention(_gather(q, layout.cont_idx), _gather(k, kv), _gather(v, kv),
                                                 attn_mask=layout.cont_mask, dropout_p=dropout, scale=scaling)
            parts.append(out.transpose(1, 2).reshape(-1, heads, d))
        return _in_row_order(parts, layout), None
    for u in layout.units:
        p = u.prompt
        out = F.scaled_dot_product_attention(_gather(q, p), _gather(k, p), _gather(v, p), is_causal=True,
                                             dropout_p=dropout, scale=scaling)
        parts.append(out[0].transpose(0, 1))
        if u.conts is not None:
            n, l_max = u.conts.shape
            out = F.scaled_dot_product_attention(
                _gather(q, u.conts), _gather(k, u.keys), _gather(v, u.keys),
                attn_mask=causal_lower_right(l_max, u.keys.shape[1]), dropout_p=dropout, scale=scaling)
            parts.append(out.transpose(1, 2).reshape(n * l_max, heads, d))
    return _in_row_order(parts, layout), None


def register() -> None:
    """Make ``ATTENTION`` an attention implementation transformers knows (idempotent); its mask is
    SDPA's, used only by forwards without a layout."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, shared_prompt_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
