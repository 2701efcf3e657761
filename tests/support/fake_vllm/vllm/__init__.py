"""A strict fake of vLLM 0.15 (a release before ``model_loader/reload/layerwise.py``, which came
in 0.16) for the rollout adapter's weight paths and request building, on the CPU.

``LLM`` takes the engine arguments the adapter passes (unknown ones fail, as ``EngineArgs``
does), builds the worker with the ``worker_extension_cls`` mixed in (``WorkerWrapperBase``),
and runs ``collective_rpc(method_name, args=...)`` on it. With ``FAKE_VLLM_MULTIPROCESS=1``
the engine core is a ``SyncMPClient`` and every ``collective_rpc`` argument is round-tripped
through msgpack as vLLM's multiprocess engine sends it (no tensors, no pickled objects). The
model is the fake Qwen2 of ``model_executor/models/qwen2.py``, built from the folder's
``config.json`` with zero weights. ``generate`` records the ``SamplingParams`` it gets.
"""
from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from types import SimpleNamespace

__version__ = "0.15.1"


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    seed: int | None = None
    logprobs: int | None = None
    detokenize: bool = True

    def __post_init__(self):
        if self.seed is not None and not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed)}")


def _msgpack_round_trip(value):
    import msgspec

    return msgspec.msgpack.decode(msgspec.msgpack.encode(value))


class LLM:
    def __init__(self, model: str, *, trust_remote_code: bool = False, dtype: str = "auto",
                 seed: int = 0, max_num_seqs: int | None = None, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None, gpu_memory_utilization: float = 0.9,
                 kv_cache_memory_bytes: int | None = None,
                 enforce_eager: bool = False, tensor_parallel_size: int = 1,
                 distributed_executor_backend: str | None = None, enable_sleep_mode: bool = False,
                 logprobs_mode: str = "raw_logprobs", worker_extension_cls: str = "",
                 use_tqdm_on_load: bool = True):
        from vllm.config import ModelConfig, VllmConfig
        from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
        from vllm.v1.engine.core_client import InprocClient, SyncMPClient
        from vllm.v1.worker.gpu_worker import Worker

        if tensor_parallel_size != 1:
            raise NotImplementedError("the fake runs one worker")
        if logprobs_mode not in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"):
            raise ValueError(logprobs_mode)
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            hf_config = json.load(f)
        self.vllm_config = VllmConfig(ModelConfig(model, hf_config, dtype=dtype, logprobs_mode=logprobs_mode))
        bases = (Worker,)
        if worker_extension_cls:
            module, name = worker_extension_cls.rsplit(".", 1)
            bases += (getattr(importlib.import_module(module), name),)
        worker_cls = type("WorkerWithExtension", bases, {})
        self.worker = worker_cls(self.vllm_config, Qwen2ForCausalLM(hf_config))
        multiprocess = os.environ.get("FAKE_VLLM_MULTIPROCESS") == "1"
        self.llm_engine = SimpleNamespace(engine_core=SyncMPClient() if multiprocess else InprocClient())
        self.requests: list[SamplingParams] = []
        self.prefix_resets = 0
        self.sleeping: set[str] = set()

    def collective_rpc(self, method, timeout=None, args: tuple = (), kwargs: dict | None = None):
        if not isinstance(method, str):
            raise TypeError("the fake takes method names only")
        from vllm.v1.engine.core_client import SyncMPClient

        if isinstance(self.llm_engine.engine_core, SyncMPClient):
            args, kwargs = tuple(_msgpack_round_trip(list(args))), _msgpack_round_trip(kwargs or {})
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def generate(self, prompts, sampling_params, use_tqdm: bool = True):
        if len(prompts) != len(sampling_params):
            raise ValueError("one SamplingParams per prompt")
        self.requests += list(sampling_params)
        logprob = SimpleNamespace(logprob=-0.5)
        outs = []
        for i, sp in enumerate(sampling_params):
            ids = [7] * sp.max_tokens
            comp = SimpleNamespace(token_ids=ids, logprobs=[{7: logprob} for _ in ids],
                                   finish_reason="length")
            outs.append(SimpleNamespace(request_id=str(i), outputs=[comp]))
        return outs

    def reset_prefix_cache(self) -> bool:
        self.prefix_resets += 1
        return True

    def sleep(self, level: int = 1) -> None:
        self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleeping -= set(tags or ("weights", "kv_cache"))


__all__ = ["LLM", "SamplingParams"]
