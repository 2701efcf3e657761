"""The KV cache an episode needs (``models.policy.kv_cache: fit``).

A rollout engine runs at most ``generation_batch_size`` sequences at once (vLLM ``max_num_seqs``,
SGLang ``max_running_requests``), each at most ``seq_length`` tokens long, so a KV cache for that
many tokens lets every sequence of an episode be in flight and more memory adds nothing (without
prefix caching across episodes). The engines' own sizing takes whatever ``gpu_memory_utilization``
leaves instead (on the CPU, vLLM reads it as a share of the machine's memory). A colocated engine
drops and refills its cache on every turn, so the cache's size is also what each turn moves.

Bytes per token (standard multi-head / grouped-query attention): ``2 (K and V) x layers x KV heads
on this rank x head_dim x dtype bytes``, an upper bound where some layers attend over a sliding
window. Architectures whose cache is not that shape (MLA's latent cache, linear attention or
state-space layers) are left to the engine's own sizing: :func:`bytes_per_token` returns None.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np
from safetensors import safe_open

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def text_config(model_dir: str) -> dict:
    """The language model's part of ``config.json`` (``text_config`` of a multimodal model)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return config.get("text_config") or config


def bytes_per_token(config: dict, dtype: str, tp: int = 1) -> int | None:
    """KV-cache bytes of one token on one tensor-parallel rank, or None where the cache is not the
    standard ``[layers, 2, kv_heads, head_dim]`` shape (see the module docstring)."""
    if any(k in config for k in ("kv_lora_rank", "linear_attn_config", "attn_type_list", "ssm_cfg")):
        return None  # MLA, linear attention, state-space layers
    if set(config.get("layer_types") or ()) - {"full_attention", "sliding_attention"}:
        return None
    layers = config.get("num_hidden_layers")
    heads = config.get("num_attention_heads")
    if not layers or not heads or dtype not in DTYPE_BYTES:
        return None
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_rank = max(1, kv_heads // tp)  # fewer KV heads than ranks: each rank keeps a copy of one
    return 2 * layers * per_rank * head_dim * DTYPE_BYTES[dtype]


def fit_tokens(max_num_seqs: int, max_model_len: int, block_size: int = 1) -> int:
    """Tokens of a cache that holds ``max_num_seqs`` sequences of ``max_model_len`` tokens in
    blocks of ``block_size`` (each sequence rounds up to whole blocks; one more block for the
    engine's reserved null block)."""
    return (max_num_seqs * math.ceil(max_model_len / block_size) + 1) * block_size


def cuda_room(utilization: float) -> int | None:
    """Bytes of this CUDA device within ``utilization`` of its memory that nothing uses yet; None
    without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return int(total * utilization - (total - free))


def checkpoint_bytes(model_dir: str, dtype: str) -> int:
    """Bytes of the checkpoint's tensors at ``dtype``: sum(numel) * itemsize."""
    numel = 0
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), framework="pt") as f:
                for key in f.keys():
                    numel += int(np.prod(f.get_slice(key).get_shape()))
    return numel * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class KVCacheFit:
    """What ``kv_cache: fit`` gives an engine: ``tokens`` and ``bytes`` per rank, or None for the
    engine's own sizing, with ``note`` saying why."""

    tokens: int | None
    bytes: int | None
    note: str = ""


def fit(model_dir: str, dtype: str, max_num_seqs: int, max_model_len: int, tp: int,
        utilization: float, block_size: int = 128, weight_bytes: int | None = None,
        reserve: float = 0.25) -> KVCacheFit:
    """The KV cache of ``max_num_seqs`` sequences of ``max_model_len`` tokens (``block_size``: the
    largest block the engines use on these devices, each sequence rounded up to it). On CUDA it must
    fit in :func:`cuda_room` beside this rank's share of the weights (``weight_bytes``, all ranks; read
    from the checkpoint when not given) and ``reserve`` x that for activations, else the engine sizes
    it (a note says why)."""
    per_token = bytes_per_token(text_config(model_dir), dtype, tp)
    if per_token is None:
        return KVCacheFit(None, None, "the model's KV cache is not the standard attention shape")
    tokens = fit_tokens(max_num_seqs, max_model_len, block_size)
    need = tokens * per_token
    room = cuda_room(utilization)
    if room is not None:
        weights = weight_bytes if weight_bytes is not None else checkpoint_bytes(model_dir, dtype)
        room -= int(weights // tp * (1 + reserve))
        if need > room:
            return KVCacheFit(None, None, (
                f"{max_num_seqs} sequences of {max_model_len} tokens need {need / 2**30:.1f} GiB of KV cache, more "
                f"than about {max(room, 0) / 2**30:.1f} GiB left within gpu_memory_utilization {utilization:g}"))
    return KVCacheFit(tokens, need)
