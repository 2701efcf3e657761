"""Tiny random mixture-of-experts model folders (Qwen3-MoE, Qwen2-MoE with a shared expert), built offline.

``make_tiny_moe_model(path, kind, seed)`` writes a Hugging Face folder that transformers 5 and vLLM (its CPU
backend included) load without network access: config, safetensors weights (``save_pretrained`` writes the
experts per expert, ``mlp.experts.{e}.gate_proj.weight``, while the model in memory holds them fused,
``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]), and the toy tokenizer of
``assets/tiny_qwen2``. Head size 32 (the smallest vLLM's CPU attention takes), 4 experts, top-2, 2 layers.
``moe_intermediate_size`` 48 is not a multiple of 32: vLLM's CPU MoE kernel pads it (zero columns).
"""
from __future__ import annotations

import os
import shutil

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
KINDS = ("qwen3_moe", "qwen2_moe")


def moe_config(kind: str, moe_intermediate_size: int = 64):
    """The transformers config of a tiny ``kind`` model (fp32, tied embeddings, vocabulary of the toy tokenizer)."""
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=320, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=2, max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=2,
                  pad_token_id=0, bos_token_id=None, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=moe_intermediate_size, intermediate_size=128, rope_theta=10000.0,
                  dtype="float32")
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=32, norm_topk_prob=True, **common)
    if kind == "qwen2_moe":
        return Qwen2MoeConfig(shared_expert_intermediate_size=96, **common)
    raise ValueError(f"kind: one of {KINDS}, got {kind!r}")


def make_tiny_moe_model(path: str, kind: str = "qwen3_moe", seed: int = 0, std: float = 0.05,
                        moe_intermediate_size: int = 64) -> str:
    """Write a random-init fp32 ``kind`` model to ``path`` (every matrix drawn from N(0, std)); returns ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    config = moe_config(kind, moe_intermediate_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(REPO, "assets", "tiny_qwen2", name), path)
    return path


def perturbed(model, seed: int, scale: float = 0.05):
    """``model`` with every parameter moved by N(0, scale) noise (in place); returns it."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


def per_expert(named):
    """``(name, tensor)`` pairs with every fused expert tensor of transformers 5 (``...experts.gate_up_proj``
    [E, 2I, H], ``...experts.down_proj`` [E, H, I]) split into the per-expert names a Hugging Face folder holds
    (``...experts.{e}.gate_proj.weight`` [I, H], ``up_proj``, ``down_proj`` [H, I])."""
    out = []
    for name, t in named:
        if name.endswith("experts.gate_up_proj"):
            prefix, half = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out += [(f"{prefix}{e}.gate_proj.weight", t[e, :half]), (f"{prefix}{e}.up_proj.weight", t[e, half:])]
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            out += [(f"{prefix}{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
        else:
            out.append((name, t))
    return out
