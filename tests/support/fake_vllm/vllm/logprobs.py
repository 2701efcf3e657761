"""``Logprob`` of vLLM 0.32 (``vllm/logprobs.py``): one position's entries are
``dict[token id, Logprob]``."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None
