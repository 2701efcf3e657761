"""``ModelConfig._derive_context_length`` (SGLang 0.5.3 to 0.5.23 ``srt/configs/model_config.py``),
as a function of the fake's engine."""
from __future__ import annotations

import os
from typing import Optional

from sglang.srt.utils.hf_transformers_utils import get_context_length, get_hf_text_config


def _env_bool(name: str, default: bool = False) -> bool:
    """``EnvBool.get`` (``srt/environ.py``): read when called; an unknown spelling is an error."""
    value = os.getenv(name)
    if value is None:
        return default
    value = value.lower()
    if value in ["true", "1", "yes", "y"]:
        return True
    if value in ["false", "0", "no", "n"]:
        return False
    raise ValueError(f'"{value}" is not a valid boolean value')


def _is_in_ci() -> bool:
    """``sglang.test.test_utils.is_in_ci``: ``get_bool_env_var("SGLANG_IS_IN_CI")``."""
    return os.getenv("SGLANG_IS_IN_CI", "false").lower() in ("true", "1")


def derive_context_length(hf_config, context_length: Optional[int]) -> int:
    """The engine's context length: ``context_length`` when given, refused above the model's own
    (:func:`get_context_length`) unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN`` is true."""
    derived_context_len = get_context_length(get_hf_text_config(hf_config))
    if context_length is None:
        return derived_context_len
    if context_length > derived_context_len:
        msg = (
            f"Warning: User-specified context_length ({context_length}) is greater than the derived "
            f"context_length ({derived_context_len}). This may lead to incorrect model outputs or CUDA errors. "
            "Note that the derived context_length may differ from max_position_embeddings in the model's config."
        )
        if not (_env_bool("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN") or _is_in_ci()):
            raise ValueError(
                f"{msg} To allow overriding this maximum, set the env var SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"
            )
    return context_length
