"""``EngineArgs`` of vLLM 0.32 (``vllm/engine/arg_utils.py``) for the fields below: a dataclass,
so an argument it does not have fails as there (``TypeError: EngineArgs.__init__() got an
unexpected keyword argument``); the defaults are 0.32's (compared with the installed vLLM by
``tests/models/rollout/test_vllm_fake_strict.py``).

``create_engine_config`` makes the checks of vLLM's configs that the fake can make without a
GPU: ``dtype`` and ``logprobs_mode`` among their literals, ``gpu_memory_utilization`` in (0, 1],
``max_model_len`` at most the model's ``max_position_embeddings``, ``max_num_batched_tokens`` at
least ``max_num_seqs`` (``SchedulerConfig.verify_max_model_len``), sleep mode only where the
platform has it (``ModelConfig``), a known ``distributed_executor_backend``. What the fake does
not model fails with ``NotImplementedError`` (tensor parallelism, quantization).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from vllm.config import AuxOutputConfig, CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig

DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
LOGPROBS_MODES = ("raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs")
EXECUTOR_BACKENDS = (None, "ray", "mp", "uni", "external_launcher")
DEFAULT_BLOCK_SIZE = 16  # CUDA
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass
class EngineArgs:
    model: str = "Qwen/Qwen3-0.6B"
    trust_remote_code: bool = False
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int = None
    distributed_executor_backend: str | None = None
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    gpu_memory_utilization: float = 0.92
    kv_cache_memory_bytes: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    disable_log_stats: bool = False
    quantization: str | None = None
    enforce_eager: bool = False
    worker_extension_cls: str = ""
    enable_sleep_mode: bool = False
    use_tqdm_on_load: bool = True
    enable_return_routed_experts: bool = False

    def create_engine_config(self) -> VllmConfig:
        from vllm.platforms import current_platform

        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: input should be one of {DTYPES}, got {self.dtype!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode: input should be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: input should be in (0, 1], got {self.gpu_memory_utilization}")
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"Unrecognized distributed executor backend {self.distributed_executor_backend}.")
        if self.enable_sleep_mode and not current_platform.is_sleep_mode_available():
            raise ValueError("Sleep mode is not supported on current platform.")
        if self.tensor_parallel_size != 1:
            raise NotImplementedError("the fake runs one worker (tensor_parallel_size 1)")
        if self.quantization is not None:
            raise NotImplementedError("the fake builds unquantized models")
        hf_config, generation_config = _read_model_folder(self.model)
        derived = int(hf_config.get("max_position_embeddings", 2048))
        max_model_len = derived if self.max_model_len is None else int(self.max_model_len)
        if max_model_len > derived and os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1":
            raise ValueError(f"User-specified max_model_len ({max_model_len}) is greater than the derived "
                             f"max_model_len (max_position_embeddings={derived} in model's config.json).")
        max_num_seqs = self.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        batched = self.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs)
        if batched < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({batched}) must be greater than or equal to "
                             f"max_num_seqs ({max_num_seqs}).")
        model_config = ModelConfig(
            self.model, hf_config, generation_config, max_model_len, quantization=self.quantization,
            dtype="float32", seed=self.seed, max_logprobs=self.max_logprobs, logprobs_mode=self.logprobs_mode,
            enable_sleep_mode=self.enable_sleep_mode)
        if self.enable_return_routed_experts:  # VllmConfig._verify_aux_output_compatibility
            if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0":
                raise ValueError("AuxOutput Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1.")
            if not model_config.is_moe:
                raise ValueError("AuxOutput Connector only supports MoE models.")
            if self.enable_prefix_caching is False:
                raise ValueError("AuxOutput Connector requires prefix caching.")
        return VllmConfig(
            model_config,
            CacheConfig(self.block_size or DEFAULT_BLOCK_SIZE, self.gpu_memory_utilization, self.kv_cache_memory_bytes),
            SchedulerConfig(max_num_seqs, batched),
            ParallelConfig(self.tensor_parallel_size, self.distributed_executor_backend, self.worker_extension_cls),
            AuxOutputConfig(self.enable_return_routed_experts))


def _read_model_folder(model: str) -> tuple[dict, dict]:
    """``config.json`` and, when present, ``generation_config.json`` of a local model folder; a
    folder without safetensors weights fails as vLLM's default loader does."""
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        hf_config = json.load(f)
    generation_config = {}
    path = os.path.join(model, "generation_config.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            generation_config = json.load(f)
    if not any(name.endswith(".safetensors") for name in os.listdir(model)):
        raise RuntimeError(f"Cannot find any model weights with `{model}`")
    return hf_config, generation_config
