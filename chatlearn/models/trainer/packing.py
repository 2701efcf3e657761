"""Micro-batch plans of the trainers' log-prob and training passes, with and without
sequence packing, and the share of padding tokens they compute.

Without packing a rank's samples, longest first (ties in batch order), are cut into
micro-batches of ``size`` samples; each is a right-padded ``[rows, width]`` batch, so it
computes ``rows x width`` token positions of which ``sum(lens)`` are real. Grouping samples of
similar length keeps that padding small where lengths vary (responses that stop anywhere),
and the largest micro-batch comes first, so a pass that does not fit fails on its first
micro-step; the loss is a sum over tokens, so the order changes nothing but float rounding.

With packing (``packing: true``) a rank's samples are binned by **first-fit decreasing**:
samples sorted by length (longest first, ties in batch order) each go into the first bin
that still has room for them, a new bin when none has, with at most ``max_token_in_packing``
tokens per bin. A bin is one row of concatenated samples (no padding), so it computes
exactly ``sum(lens)`` positions. First-fit decreasing uses at most ``11/9 OPT + 6/9`` bins
(Dosa 2007); the order of the samples does not matter to the results, which are written back
by position. A sample longer than ``max_token_in_packing`` is an error (as in verl), since
splitting it would change its attention.

With ``share_prompt`` (:mod:`chatlearn.models.trainer.shared_prompt`) the samples that share a
prompt run it once: a rank's samples are taken group after group (groups in order of first
appearance, samples in batch order) into micro-batches of ``size`` samples, or with packing of at
most ``max_token_in_packing`` computed tokens (a sample whose prompt is already in the micro-batch
costs only its continuation). Nothing is padded; ``shared_token_frac`` is the share of the
samples' tokens not computed because their prompt was.
"""
from __future__ import annotations

import numpy as np

from chatlearn.errors import ConfigError


def pack_first_fit_decreasing(lens: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Bins of positions into ``lens`` (each bin in ascending order), each bin's total
    length at most ``max_tokens``; bins in order of creation. Raises a ConfigError naming
    ``max_token_in_packing`` when a single length exceeds ``max_tokens``."""
    lens = np.asarray(lens, dtype=np.int64)
    if len(lens) and int(lens.max()) > max_tokens:
        raise _too_long(int(lens.max()), max_tokens)
    bins: list[list[int]] = []
    room: list[int] = []
    for i in np.argsort(-lens, kind="stable"):
        n = int(lens[i])
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(int(i))
                room[b] -= n
                break
        else:
            bins.append([int(i)])
            room.append(max_tokens - n)
    return [np.sort(np.asarray(b, dtype=np.int64)) for b in bins]


def _too_long(longest: int, max_tokens: int) -> ConfigError:
    return ConfigError(
        f"a sample has {longest} tokens (prompt + response), more than "
        f"max_token_in_packing ({max_tokens}): with packing every sample must fit in one "
        "packed micro-batch. Raise max_token_in_packing to at least max_prompt_tokens_length "
        "+ max_response_tokens_length, or turn packing off.",
        key="models.policy_trainer.max_token_in_packing")


def plan_shared_micro_batches(lens: np.ndarray, prompt_lens: np.ndarray, groups: np.ndarray,
                              shares: list[np.ndarray], size: int, packing: bool,
                              max_tokens: int) -> tuple[list[list[np.ndarray]], dict]:
    """Micro-batches of every rank with shared prompts: like :func:`plan_micro_batches` (same
    return), ``groups[i]`` the prompt group of sample ``i`` (equal ids: equal prompt tokens).
    ``stats`` holds ``pad_token_frac`` (0), ``micro_steps`` and ``shared_token_frac`` = 1 -
    computed tokens / the samples' tokens, over all ranks."""
    lens = np.asarray(lens, dtype=np.int64)
    if packing and len(lens) and int(lens.max()) > max_tokens:
        raise _too_long(int(lens.max()), max_tokens)
    plans, computed = [], 0
    for share in shares:
        bins: list[list[int]] = []
        seen: set[int] = set()
        tokens = 0
        for i in share[np.argsort(groups[share], kind="stable")]:
            cost = int(lens[i] - prompt_lens[i]) if int(groups[i]) in seen else int(lens[i])
            if bins and ((packing and tokens + cost > max_tokens) or (not packing and len(bins[-1]) >= size)):
                computed += tokens
                seen, tokens, cost = set(), 0, int(lens[i])
                bins.append([])
            if not bins:
                bins.append([])
            bins[-1].append(int(i))
            seen.add(int(groups[i]))
            tokens += cost
        computed += tokens
        plans.append([np.sort(np.asarray(b, dtype=np.int64)) for b in bins])
    plans, steps = _same_steps(plans)
    real = sum(int(lens[share].sum()) for share in shares)
    stats = {"pad_token_frac": 0.0, "micro_steps": float(steps),
             "shared_token_frac": 1.0 - computed / real if real else 0.0}
    return plans, stats


def check_fixed_width(lens: np.ndarray, width: int) -> int:
    """``width`` when every sample fits in it; else a ConfigError naming ``seq_length``."""
    longest = int(np.max(lens)) if len(lens) else 0
    if longest > width:
        raise ConfigError(
            f"a sample has {longest} tokens (prompt + response), more than seq_length ({width}), the width "
            "every unpacked micro-batch is padded to. Raise it to at least models.policy.seq_length (or "
            "max_prompt_tokens_length + max_response_tokens_length), or set it to null.",
            key="models.policy_trainer.seq_length")
    return width


def plan_micro_batches(lens: np.ndarray, shares: list[np.ndarray], size: int, packing: bool,
                       max_tokens: int, width: int | None = None) -> tuple[list[list[np.ndarray]], dict]:
    """Micro-batches of every rank: ``shares[r]`` are rank r's sample indices into ``lens``.

    Returns ``(plans, stats)``: ``plans[r]`` is rank r's list of index arrays, padded with
    empty arrays to the same number of micro-steps on every rank (an empty array is a dummy
    micro-step: see the trainers). ``stats``: ``pad_token_frac`` = padding positions /
    positions computed over all ranks' real micro-steps (0 with packing; dummy micro-steps
    are not counted), ``micro_steps`` = micro-steps per rank. ``width``: unpacked micro-batches
    are padded to exactly that many tokens (``seq_length``) rather than to their longest sample.
    """
    lens = np.asarray(lens, dtype=np.int64)
    plans = []
    for share in shares:
        if packing:
            plans.append([share[b] for b in pack_first_fit_decreasing(lens[share], max_tokens)])
        else:
            longest_first = share[np.argsort(-lens[share], kind="stable")]
            plans.append([longest_first[i:i + size] for i in range(0, len(share), size)])
    computed = sum(int(lens[mb].sum()) if packing else len(mb) * (width or int(lens[mb].max()))
                   for p in plans for mb in p)
    real = sum(int(lens[share].sum()) for share in shares)
    plans, steps = _same_steps(plans)
    stats = {"pad_token_frac": 1.0 - real / computed if computed else 0.0,
             "micro_steps": float(steps)}
    return plans, stats


def _same_steps(plans: list[list[np.ndarray]]) -> tuple[list[list[np.ndarray]], int]:
    """Every rank's plan padded with empty arrays (dummy micro-steps) to the longest one's
    number of micro-steps, and that number."""
    steps = max((len(p) for p in plans), default=0)
    empty = np.zeros(0, dtype=np.int64)
    return [p + [empty] * (steps - len(p)) for p in plans], steps
