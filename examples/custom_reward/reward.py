"""A user reward function: a format reward with a length penalty.

Wired by path in ``grpo_custom_reward.yaml``::

    models.reward.functions:
      - {name: format, path: examples/custom_reward/reward.py:format_reward, weight: 0.5,
         kwargs: {max_chars: 64, length_penalty: 0.01}}

It is called once per batch with the keyword arguments below and runs in the reward workers.
"""
from __future__ import annotations

import re

BOXED = re.compile(r"\\boxed\{[^{}]+\}")


def format_reward(*, prompts: list[str], responses: list[str], ground_truths: list, data_sources: list[str],
                  extra: list[dict], max_chars: int = 64, length_penalty: float = 0.01) -> dict:
    """``score = has_boxed - length_penalty * max(0, len(response) - max_chars)`` per sample, where
    ``has_boxed`` is 1 when the response holds a non-empty ``\\boxed{...}``. Returns the score and its
    two parts, which are logged as ``train/reward/format/has_boxed`` and ``.../length_penalty``."""
    has_boxed = [1.0 if BOXED.search(r) else 0.0 for r in responses]
    penalty = [length_penalty * max(0, len(r) - max_chars) for r in responses]
    return {"score": [b - p for b, p in zip(has_boxed, penalty)], "has_boxed": has_boxed, "length_penalty": penalty}
