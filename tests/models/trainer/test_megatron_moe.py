"""MegatronTrainer on mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with a shared expert), on CPU
under the test-only device shim, against plain transformers and the FSDP2 trainer: log-probs,
gradients and one optimizer step for expert parallelism 1, 2 and TP 2 x EP 2; the weight export
(transformers' fused expert tensors); routing replay (the trainer's top-k is the given one, -1 routes
itself); checkpoint resume and the offline merge of an EP-sharded checkpoint.

Tiny random models are built here (a handful of experts, top-2), so that no asset is needed. The
router's auxiliary loss is set to 0 where gradients are compared with FSDP (megatron-core's switch
loss and Hugging Face's differ in their normalisation; FSDP adds none unless asked).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_fsdp_trainer import add_logprobs, hf_logprobs, make_batch, run_ranks, trainer_spec
from test_megatron_trainer import needs_megatron

pytestmark = [needs_megatron, pytest.mark.slow]

TEMPERATURE = 0.8
LR = 1e-4
JOB_TIMEOUT_S = 240


def make_moe_model(path: str, kind: str = "qwen3_moe", seed: int = 0, **over) -> str:
    """A random tiny Qwen3-MoE (q/k norms, 4 experts, top-2, renormalised) or Qwen2-MoE (a shared
    expert with its sigmoid gate, qkv bias, top-2 not renormalised), saved with save_pretrained
    (per-expert tensor names on disk) and a copy of the tiny dense model's tokenizer files."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  router_aux_loss_coef=0.0)
    if kind == "qwen3_moe":
        conf = Qwen3MoeConfig(**{**common, "head_dim": 16, "norm_topk_prob": True, **over})
    else:
        conf = Qwen2MoeConfig(**{**common, "shared_expert_intermediate_size": 48, "norm_topk_prob": False, **over})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # routers with a clear preference, so top-2 is stable
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(path)
    return path
