"""What a loss covers of a batch, numpy only: the response tokens (:func:`response_mask`), their count per
sample (:func:`loss_token_counts`), and the epsilon of the advantages' whitening. The advantage estimators
(:mod:`chatlearn.algorithms.advantages`, :mod:`chatlearn.algorithms.gae`) and the losses read them from here;
this module imports nothing of chatlearn.
"""
from __future__ import annotations

import numpy as np

WHITEN_EPS = 1e-8  # added to the variance before its square root when advantages are whitened


def response_mask(batch: dict) -> np.ndarray:
    """bool [T]: True on the response tokens a loss or a log-prob covers (the model's own: not the
    prompt, not the observations a multi-turn rollout appended, where ``loss_mask`` is 0)."""
    off, plen = batch["offsets"], batch["prompt_lens"]
    mask = np.zeros(int(off[-1]), dtype=bool)
    for i in range(len(plen)):
        mask[int(off[i] + plen[i]):int(off[i + 1])] = True
    if "loss_mask" in batch:
        mask &= np.asarray(batch["loss_mask"], dtype=bool)
    return mask


def loss_token_counts(batch: dict) -> np.ndarray:
    """int64 [N]: per sample, the response tokens a loss covers (see :func:`response_mask`)."""
    off = np.asarray(batch["offsets"], dtype=np.int64)
    if "loss_mask" not in batch:
        return np.diff(off) - np.asarray(batch["prompt_lens"], dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(response_mask(batch), dtype=np.int64)])
    return cum[off[1:]] - cum[off[:-1]]
