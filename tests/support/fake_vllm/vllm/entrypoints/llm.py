"""``vllm.LLM`` of vLLM 0.32 (``vllm/entrypoints/llm.py`` and ``entrypoints/common/offline.py``).

The constructor's named parameters are a subset of 0.32's, with its defaults; every other keyword
goes to :class:`~vllm.engine.arg_utils.EngineArgs`, which refuses the ones it lacks (as there).
``generate``, ``collective_rpc``, ``sleep``, ``wake_up`` and ``reset_prefix_cache`` have 0.32's
signatures (``tests/models/rollout/test_vllm_fake_strict.py`` compares them with the installed
vLLM).

``generate(prompts, sampling_params)``: one ``SamplingParams`` for all prompts or one per prompt
(else ``VLLMValidationError``); token prompts only (``TokensPrompt`` or a list of ids). Each request
is checked as vLLM checks it (``SamplingParams.verify``: log-probs at most ``max_logprobs``, stop
ids in the vocabulary; the prompt: not empty, shorter than ``max_model_len``, ids in the
vocabulary), then sampled by the fake's sampler (``v1/engine/_fake_sampling.py``) from the
weights' fingerprint: a paused engine (asleep, or woken in part) or weights that are asleep or
were discarded and not all reloaded fail (vLLM would hang or generate garbage). Requests get
clones of their ``SamplingParams`` with the EOS of the model (``config.json``) and the generation
config's EOS ids, as the engine's input processor does. Outputs come in prompt order.

With ``enable_return_routed_experts`` (an MoE model's config.json; vLLM 0.32's aux-output connector) each
finished output carries ``routed_experts``: ``[prompt + output tokens - 1, num_hidden_layers, top_k]`` (every
token the engine ran a forward of: the last sampled one has none), uint8 for 256 experts or fewer, else uint16;
row ``l`` the decoder layer ``l`` (a dense layer's row, never written, is 0); the experts of a token are a
function of the weights' fingerprint, the token and its position (distinct, a top-k's).

Fake-only attributes for tests: ``requests`` (the ``SamplingParams`` objects passed, in order),
``prefix_resets`` (prefix-cache resets, including the one of every sleep), ``worker``.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import _fake_sampling
from vllm.v1.engine.llm_engine import LLMEngine


class LLM:
    def __init__(self, model: str, *, trust_remote_code: bool = False, tensor_parallel_size: int = 1,
                 dtype: str = "auto", quantization: str | None = None, seed: int = 0,
                 gpu_memory_utilization: float = 0.92, enforce_eager: bool = False,
                 kv_cache_memory_bytes: int | None = None, **kwargs: Any) -> None:
        if "disable_log_stats" not in kwargs:
            kwargs["disable_log_stats"] = True
        engine_args = EngineArgs(
            model=model, trust_remote_code=trust_remote_code, tensor_parallel_size=tensor_parallel_size,
            dtype=dtype, quantization=quantization, seed=seed, gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes, enforce_eager=enforce_eager, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self.model_config = self.llm_engine.model_config
        self.request_counter = itertools.count()
        self.requests: list[SamplingParams] = []

    @property
    def worker(self):
        return self.llm_engine.worker

    @property
    def prefix_resets(self) -> int:
        return self.llm_engine.prefix_resets

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 use_tqdm: bool = True, lora_request=None, priority: int | Sequence[int] | None = None,
                 tokenization_kwargs: dict[str, Any] | None = None,
                 mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        if lora_request is not None or tokenization_kwargs or mm_processor_kwargs:
            raise NotImplementedError("the fake has no LoRA, tokenizer or multimodal processor")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(prompts, (dict, str, bytes)) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise VLLMValidationError(f"The lengths of prompts ({len(prompts)}) and params "
                                          f"({len(sampling_params)}) must be the same.")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        requests = [self._add_request(prompt, sp) for prompt, sp in zip(prompts, params)]
        self.requests += params
        engine = self.llm_engine
        if engine.paused:
            raise RuntimeError("the fake: the engine's scheduler is paused (sleep, or a wake_up of some tags "
                               f"only; sleeping: {sorted(engine.model_executor.sleeping_tags)}); vLLM would queue "
                               "these requests and wait for ever. wake_up all tags first.")
        fingerprint = engine.worker.model_runner.weights_fingerprint()
        outputs = [RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=ids, prompt_logprobs=None,
                                 outputs=[_fake_sampling.sample(ids, sp, i, fingerprint, self.model_config,
                                                                engine.generator) for i in range(sp.n)])
                   for request_id, ids, sp in requests]
        if engine.vllm_config.aux_output_config.enable_return_routed_experts:
            for out in outputs:
                for comp in out.outputs:
                    comp.routed_experts = _fake_sampling.routed_experts(
                        list(out.prompt_token_ids) + list(comp.token_ids), fingerprint, self.model_config)
        return outputs

    def _add_request(self, prompt, params: SamplingParams) -> tuple[str, list[int], SamplingParams]:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be either SamplingParams or PoolingParams, but got "
                            f"{type(params).__name__}")
        params.verify(self.model_config)
        ids = self.llm_engine.validate_prompt(prompt)
        if params.stop:
            raise NotImplementedError("the fake has no tokenizer: stop strings are not modelled")
        sp = params.clone()
        sp.update_from_generation_config(self.model_config.generation_config, self.llm_engine.eos_token_id())
        return str(next(self.request_counter)), ids, sp

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list:
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def sleep(self, level: int = 1, mode: str = "abort"):
        self.llm_engine.sleep(level=level, mode=mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        return self.llm_engine.wake_up(tags)
