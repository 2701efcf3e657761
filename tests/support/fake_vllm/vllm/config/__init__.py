"""The parts of vLLM 0.32's ``VllmConfig`` (``vllm/config/``) the fake engine and the adapter's
worker extension read. Built by ``EngineArgs.create_engine_config`` (``engine/arg_utils.py``)."""
import contextlib
from dataclasses import dataclass

_CURRENT = []


@dataclass
class ModelConfig:
    model: str
    hf_config: dict
    generation_config: dict
    max_model_len: int
    quantization: str | None = None
    dtype: str = "float32"
    seed: int = 0
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    enable_sleep_mode: bool = False
    runner_type: str = "generate"

    def get_vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    def get_total_num_hidden_layers(self) -> int:
        return int(self.hf_config.get("num_hidden_layers", 0))

    def get_num_experts(self) -> int:
        return int(self.hf_config.get("num_experts") or self.hf_config.get("num_local_experts") or 0)

    def get_num_experts_per_tok(self) -> int:
        return int(self.hf_config.get("num_experts_per_tok") or 0)

    @property
    def is_moe(self) -> bool:
        return self.get_num_experts() > 0


@dataclass
class CacheConfig:
    block_size: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    worker_extension_cls: str = ""


@dataclass
class AuxOutputConfig:
    enable_return_routed_experts: bool = False

    @property
    def enabled(self) -> bool:
        return self.enable_return_routed_experts


@dataclass
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    aux_output_config: AuxOutputConfig


@contextlib.contextmanager
def set_current_vllm_config(vllm_config):
    _CURRENT.append(vllm_config)
    try:
        yield
    finally:
        _CURRENT.pop()


def get_current_vllm_config():
    if not _CURRENT:
        raise AssertionError("no current vLLM config")
    return _CURRENT[-1]
