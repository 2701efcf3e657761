import contextlib
from dataclasses import dataclass, field

_CURRENT = []


@dataclass
class ModelConfig:
    model: str
    hf_config: dict
    quantization: str | None = None
    dtype: str = "float32"
    logprobs_mode: str = "raw_logprobs"


@dataclass
class VllmConfig:
    model_config: ModelConfig
    extra: dict = field(default_factory=dict)


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
