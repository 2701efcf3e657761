"""The reference log-probs of a vision-language model's samples: transformers' own forward of each sample alone,
which computes the multimodal rotary positions itself (``get_rope_index`` from the token types and the grid)."""
from __future__ import annotations

import numpy as np
import torch


@torch.no_grad()
def sample_logprobs(model, tokens: np.ndarray, prompt_len: int, image: dict | None, image_id: int) -> np.ndarray:
    """Log-probs of ``tokens``' response tokens (those after ``prompt_len``) under ``model``, with the prompt's
    ``image`` (``pixel_values`` and ``image_grid_thw`` arrays; None for a text prompt)."""
    toks = torch.from_numpy(np.asarray(tokens).astype(np.int64))[None]
    kw = {} if image is None else dict(pixel_values=torch.from_numpy(image["pixel_values"]),
                                       image_grid_thw=torch.from_numpy(image["image_grid_thw"]),
                                       mm_token_type_ids=(toks == image_id).int())
    logits = model(input_ids=toks, **kw).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, toks[0, 1:, None])[:, 0][int(prompt_len) - 1:].numpy()


def batch_gap(model, batch: dict, logprobs: np.ndarray, images: list, image_id: int, samples=None) -> float:
    """The largest |``logprobs`` - reference| over the response tokens of ``batch``'s samples (``samples``: their
    indices, all by default); ``images[i]`` is sample i's image dict or None."""
    off, plen = batch["offsets"], batch["prompt_lens"]
    worst = 0.0
    for i in (range(len(plen)) if samples is None else samples):
        ref = sample_logprobs(model, batch["tokens"][off[i]:off[i + 1]], plen[i], images[i], image_id)
        worst = max(worst, float(np.abs(logprobs[off[i] + plen[i]:off[i + 1]] - ref).max()))
    return worst
