"""A tiny random mixture-of-experts model folder (Qwen3-MoE or Qwen2-MoE), built offline, for the routing
tests (until the asset ``assets/tiny_qwen3_moe`` is there): hidden 128, 4 heads (head_dim 32, what vLLM's CPU
attention takes), 2 KV heads, ``layers`` decoder layers each with ``experts`` routed experts, top-``top_k``
(Qwen2-MoE also a shared expert), the tokenizer of ``tiny_model.py``. The routers' weights are drawn with
std ``router_std`` (large enough that a token's top-k is decided, not a near tie of equal scores), the experts'
with std ``expert_std`` (large enough that which experts a token goes to moves its next-token distribution)."""
from __future__ import annotations

import os


def make_tiny_moe(path: str, seed: int = 0, arch: str = "qwen3_moe", layers: int = 2, experts: int = 8,
                  top_k: int = 2, router_std: float = 0.5, expert_std: float = 0.15, vocab_size: int = 320) -> str:
    import torch
    from tiny_model import make_tokenizer
    from transformers import GenerationConfig

    os.makedirs(path, exist_ok=True)
    tokenizer = make_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    common = dict(vocab_size=vocab_size, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=layers, intermediate_size=256, moe_intermediate_size=64, num_experts=experts,
                  num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                  max_position_embeddings=512, tie_word_embeddings=True, rope_theta=10000.0,
                  bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id, dtype="float32")
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig as Config, Qwen3MoeForCausalLM as Model

        config = Config(head_dim=32, **common)
    elif arch == "qwen2_moe":
        from transformers import Qwen2MoeConfig as Config, Qwen2MoeForCausalLM as Model

        config = Config(shared_expert_intermediate_size=128, **common)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = Model(config).to(torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 0.1)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, router_std)
            elif ".mlp.experts." in name:
                p.normal_(0.0, expert_std)
    model.generation_config = GenerationConfig(bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
