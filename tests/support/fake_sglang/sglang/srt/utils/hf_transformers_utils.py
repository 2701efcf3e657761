"""``sglang.srt.utils.hf_transformers_utils`` (SGLang 0.5.3; ``srt/utils/hf_transformers/common.py``
in 0.5.23, the same code): the model's context length."""
from __future__ import annotations

CONTEXT_LENGTH_KEYS = [
    "max_sequence_length",
    "seq_length",
    "max_seq_len",
    "model_max_length",
    "max_position_embeddings",
]


def get_hf_text_config(config):
    """The language model's part of a multimodal config; the config itself for a text model (the
    ``text_config`` case of SGLang's function, the one the fake's models need)."""
    if hasattr(config, "text_config"):
        return config.text_config
    return config


def get_context_length(config) -> int:
    """The first of ``CONTEXT_LENGTH_KEYS`` the config has, times a RoPE scaling factor (none when
    the scaling names ``original_max_position_embeddings`` or is llama3); 2048 when it has none."""
    rope_scaling = getattr(config, "rope_scaling", None)
    if rope_scaling:
        rope_scaling_factor = rope_scaling.get("factor", 1)
        if "original_max_position_embeddings" in rope_scaling:
            rope_scaling_factor = 1
        if rope_scaling.get("rope_type", None) == "llama3":
            rope_scaling_factor = 1
    else:
        rope_scaling_factor = 1
    for key in CONTEXT_LENGTH_KEYS:
        val = getattr(config, key, None)
        if val is not None:
            return int(rope_scaling_factor * val)
    return 2048
