"""Throughput and memory metrics of an episode (``perf/*``, ``memory/*``)."""
from __future__ import annotations

import numpy as np

from chatlearn.calls import get


def throughput(batch: dict, metrics: dict, epochs: int, generated: int | None = None) -> dict:
    """Tokens per second of the generate and train stages, from the stage times in ``metrics``.

    Generation counts the response tokens sampled (``generated`` when given: with dynamic sampling,
    those of every round, not only the batch's; a multi-turn batch's model tokens, not its observations); training counts every token of every sample
    (prompt and response) once per pass over the episode (``num_training_epoch``).
    """
    offsets = np.asarray(batch["offsets"])
    total = float(offsets[-1] - offsets[0])
    response = (float(generated) if generated is not None
                else float(np.sum(batch["loss_mask"])) if "loss_mask" in batch  # multi-turn: the model's tokens
                else total - float(np.sum(batch["prompt_lens"])))
    out = {}
    if metrics.get("time/generate", 0) > 0:
        out["perf/generate_tokens_per_s"] = response / metrics["time/generate"]
    if metrics.get("time/train", 0) > 0:
        out["perf/train_tokens_per_s"] = total * epochs / metrics["time/train"]
    return out


def peak_memory(groups: dict) -> dict:
    """``memory/<model>_peak_mb``: the largest peak over a model's actors, where they report one."""
    names = sorted(groups)
    refs = {name: [actor.memory.remote() for actor in groups[name].actors] for name in names}
    out = {}
    for name in names:
        peaks = [r["peak_mb"] for r in get(refs[name]) if r.get("peak_mb") is not None]
        if peaks:
            out[f"memory/{name}_peak_mb"] = max(peaks)
    return out
