"""Whether a model folder's ``config.json`` describes its weights, read from the safetensors headers
alone (no tensor is loaded): validation runs it before any process starts, so a config.json edited
after the weights were written (``hidden_size``, ``vocab_size``, the head or layer counts changed) is
one paragraph naming the tensor, whatever backend would have loaded the folder. The model's context length
is read from ``config.json`` here too (:func:`model_context_length`: the config's checks and the reward model's
spec)."""
from __future__ import annotations

import json
import os
import re

# tensor name suffix -> the shape config.json implies, from its sizes (h: hidden_size, v: vocab_size,
# i: intermediate_size, q: num_attention_heads x head_dim, kv: num_key_value_heads x head_dim)
EXPECTED = (
    ("embed_tokens.weight", ("v", "h")),
    ("lm_head.weight", ("v", "h")),
    ("model.norm.weight", ("h",)),
    ("input_layernorm.weight", ("h",)),
    ("post_attention_layernorm.weight", ("h",)),
    ("self_attn.q_proj.weight", ("q", "h")),
    ("self_attn.k_proj.weight", ("kv", "h")),
    ("self_attn.v_proj.weight", ("kv", "h")),
    ("self_attn.o_proj.weight", ("h", "q")),
    ("mlp.gate_proj.weight", ("i", "h")),
    ("mlp.up_proj.weight", ("i", "h")),
    ("mlp.down_proj.weight", ("h", "i")),
)
SIZE_KEYS = {"v": "vocab_size", "h": "hidden_size", "i": "intermediate_size",
             "q": "num_attention_heads x head_dim", "kv": "num_key_value_heads x head_dim"}
_LAYER = re.compile(r"(?:^|\.)(?:model|language_model)\.layers\.(\d+)\.")
# tensors of other towers (vision, audio, an encoder) or extra predictors, whose sizes config.json gives elsewhere
_OTHER = ("vision", "visual", "audio", "encoder", "speech", "mtp")
# attention whose projections are not heads x head_dim (DeepSeek's multi-head latent attention)
_LATENT = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim")


def read_shapes(folder: str) -> dict[str, tuple[str, list]]:
    """Tensor name -> (file, shape) of every safetensors file in ``folder`` (headers only); files whose
    header cannot be read are left out (their framing is checked, and named, elsewhere)."""
    out: dict[str, tuple[str, list]] = {}
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
        try:
            with open(os.path.join(folder, name), "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if isinstance(header, dict):
            out.update({k: (name, v.get("shape")) for k, v in header.items()
                        if k != "__metadata__" and isinstance(v, dict)})
    return out


def implied_sizes(conf: dict) -> dict[str, int]:
    """The sizes of :data:`EXPECTED` that ``conf`` (config.json; a multimodal model's ``text_config``)
    gives; a size it does not give is left out (its tensors are not checked)."""
    text = conf.get("text_config") if isinstance(conf.get("text_config"), dict) else conf
    num = {k: text[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                "num_key_value_heads", "head_dim") if isinstance(text.get(k), int) and text[k] > 0}
    sizes = {s: num[k] for s, k in (("v", "vocab_size"), ("h", "hidden_size"), ("i", "intermediate_size"))
             if k in num}
    heads = num.get("num_attention_heads")
    head_dim = num.get("head_dim") or (num["hidden_size"] // heads if heads and "hidden_size" in num
                                        and num["hidden_size"] % heads == 0 else None)
    if heads and head_dim:
        sizes["q"] = heads * head_dim
        sizes["kv"] = num.get("num_key_value_heads", heads) * head_dim
    return sizes


def shape_mismatch(folder: str, conf: dict) -> str | None:
    """The first way the weights in ``folder`` differ from what ``conf`` (its config.json) implies: a
    tensor of another shape, or another number of layers; None when they agree (or cannot be told)."""
    if conf.get("quantization_config") is not None:  # packed weights: their shapes are not the config's
        return None
    shapes = {t: v for t, v in read_shapes(folder).items() if not any(o in t for o in _OTHER)}
    if not shapes:
        return None
    sizes = implied_sizes(conf)
    text = conf.get("text_config") if isinstance(conf.get("text_config"), dict) else conf
    if any(text.get(k) for k in _LATENT):
        sizes.pop("q", None)
        sizes.pop("kv", None)
    for tensor, (file, shape) in shapes.items():
        for suffix, dims in EXPECTED:
            if not tensor.endswith(suffix) or not all(d in sizes for d in dims) or not isinstance(shape, list):
                continue
            want = [sizes[d] for d in dims]
            if shape != want:
                given = ", ".join(f"{SIZE_KEYS[d]} {sizes[d]}" for d in dict.fromkeys(dims))
                return (f"{tensor} in {file} has shape {shape}, but config.json ({given}) implies {want}")
            break
    layers = {int(m.group(1)) for t in shapes for m in [_LAYER.search(t)] if m}
    want_layers = text.get("num_hidden_layers")
    # fewer layers than config.json: the model would start its missing layers from random weights
    # (more are left unused with a warning, as extra prediction layers are)
    if layers and isinstance(want_layers, int) and max(layers) + 1 < want_layers:
        return (f"the weights hold {max(layers) + 1} layers (layers.0 to layers.{max(layers)}), but config.json "
                f"has num_hidden_layers {want_layers}")
    return None


# the config.json keys vLLM reads for a model's context length (the smallest one present wins)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                "max_seq_length", "seq_len")


def model_context_length(path: str) -> int | None:
    """The longest prompt + response the model at ``path`` takes, from its config.json (as vLLM derives
    it: the smallest length key present, times a linear/dynamic/yarn RoPE scaling factor); ``None``
    when the config says nothing."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        conf = json.load(f)
    conf = conf.get("text_config") if isinstance(conf.get("text_config"), dict) else conf
    lengths = [conf[k] for k in CONTEXT_KEYS if isinstance(conf.get(k), int) and conf[k] > 0]
    if not lengths:
        return None
    limit = min(lengths)
    scaling = conf.get("rope_scaling")
    if isinstance(scaling, dict) and isinstance(scaling.get("factor"), (int, float)):
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in ("linear", "dynamic", "yarn"):
            limit = int(limit * scaling["factor"])
    return limit
