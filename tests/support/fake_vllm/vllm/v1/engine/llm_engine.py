"""vLLM 0.32's ``LLMEngine`` (``vllm/v1/engine/llm_engine.py``) with its engine core
(``v1/engine/core.py``) folded in: the executor, the scheduler's pause state, the prefix cache,
the engine's generator for unseeded requests, and request validation
(``v1/engine/input_processor.py``).

Sleep (``EngineCore.sleep`` / ``wake_up``): ``sleep(level)`` pauses the scheduler (mode "abort";
"wait" is refused by an in-process engine core; level >= 1 clears the prefix cache), then, for
level >= 1, the executor sleeps. ``wake_up(tags)`` drops "scheduling" from ``tags``, wakes the
executor's tags, and resumes the scheduler only once nothing sleeps; it returns whether the
engine is fully awake. Requests added while the scheduler is paused are queued and never run, so
``LLM.generate`` would wait for ever: the fake raises instead.
"""
from __future__ import annotations

import os

import numpy as np

from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.core_client import InprocClient, SyncMPClient
from vllm.v1.executor.abstract import Executor

PAUSE_MODES = ("abort", "wait", "keep")


class LLMEngine:
    def __init__(self, vllm_config, multiprocess: bool):
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.engine_core = SyncMPClient() if multiprocess else InprocClient()
        self.model_executor = Executor(vllm_config, multiprocess)
        self.generator = np.random.default_rng(self.model_config.seed)
        self.paused = False
        self.prefix_resets = 0

    @classmethod
    def from_engine_args(cls, engine_args) -> "LLMEngine":
        return cls(engine_args.create_engine_config(), os.environ.get("FAKE_VLLM_MULTIPROCESS") == "1")

    @property
    def worker(self):
        return self.model_executor.driver_worker

    def collective_rpc(self, method, timeout=None, args: tuple = (), kwargs: dict | None = None) -> list:
        return self.model_executor.collective_rpc(method, timeout, args, kwargs)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.prefix_resets += 1
        return True

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {mode}")
        if mode == "wait" and isinstance(self.engine_core, InprocClient):
            raise ValueError("'wait' mode can't be used in inproc-engine mode")
        self.paused = True
        if level >= 1:
            self.prefix_resets += 1  # _finish_pause(clear_cache=True)
            self.model_executor.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
        if tags is None or tags:
            self.model_executor.wake_up(tags)
        fully_awake = not self.model_executor.is_sleeping
        if fully_awake:
            self.paused = False
        return fully_awake

    def is_sleeping(self) -> bool:
        return self.paused or self.model_executor.is_sleeping

    def validate_prompt(self, prompt) -> list[int]:
        """A token prompt's ids, checked as ``InputProcessor._validate_model_input`` does."""
        if isinstance(prompt, (list, tuple)):
            prompt = {"prompt_token_ids": list(prompt)}
        if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
            raise NotImplementedError(f"the fake takes token prompts only, got {type(prompt).__name__}")
        ids = list(prompt["prompt_token_ids"])
        max_model_len = self.model_config.max_model_len
        if not ids:
            raise VLLMValidationError("The decoder prompt cannot be empty")
        if len(ids) > max_model_len:
            raise VLLMValidationError(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum model length of "
                f"{max_model_len}. Make sure that `max_model_len` is no smaller than the number of text tokens.")
        if len(ids) == max_model_len:
            raise VLLMValidationError(
                f"The decoder prompt (length {len(ids)}) plus the number of requested output tokens (at least 1) "
                f"is longer than the maximum model length of {max_model_len}. Make sure that `max_model_len` is "
                "no smaller than the number of text tokens (prompt + requested output tokens).")
        if min(ids) < 0:
            raise VLLMValidationError(f"Token id {min(ids)} is out of vocabulary")
        if max(ids) > self.model_config.get_vocab_size() - 1:
            raise VLLMValidationError(f"Token id {max(ids)} is out of vocabulary")
        return ids

    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS; the fake reads it from ``config.json`` (the first of a list)."""
        eos = self.model_config.hf_config.get("eos_token_id")
        return eos[0] if isinstance(eos, list) else eos
