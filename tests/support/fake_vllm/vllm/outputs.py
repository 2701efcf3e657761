"""``CompletionOutput`` and ``RequestOutput`` of vLLM 0.32 (``vllm/outputs.py``), the fields an offline
``LLM.generate`` fills. ``logprobs`` and ``cumulative_logprob`` are None unless the request asked for
log-probs; ``routed_experts`` is None unless the engine was started with ``enable_return_routed_experts``
(then ``[prompt + output tokens - 1, decoder layers, top_k]``, uint8 for 256 experts or fewer, else uint16:
see ``entrypoints/llm.py``); ``finish_reason`` is "stop" (EOS or a stop token id, which is then the
``stop_reason``) or "length" (``max_tokens``, or the sequence reached ``max_model_len``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm.logprobs import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    routed_experts: np.ndarray | None = None  # [seq_len,layer_num,topk]
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    num_cached_tokens: int | None = 0
