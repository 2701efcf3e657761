"""Qwen2 as vLLM 0.11 - 0.15 build it for one tensor-parallel rank: fused ``qkv_proj`` and
``gate_up_proj`` parameters whose ``weight_loader`` takes a shard id, and ``load_weights``
that maps Hugging Face names through ``stacked_params_mapping`` (``vllm/model_executor/models/
qwen2.py``, ``Qwen2Model.load_weights`` and ``Qwen2ForCausalLM.load_weights``; linear layers
from ``layers/linear.py``). Unknown names fail as they do there (``KeyError`` / ``ValueError``)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from vllm.model_executor.model_loader.weight_utils import default_weight_loader


def _param(*shape) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape), requires_grad=False)


class QKVParallelLinear(nn.Module):
    def __init__(self, hidden: int, head_dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.sizes = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
        out = sum(self.sizes.values())
        self.weight, self.bias = _param(out, hidden), _param(out)
        for p in (self.weight, self.bias):
            p.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded_weight, loaded_shard_id: str):
        offset = {"q": 0, "k": self.sizes["q"], "v": self.sizes["q"] + self.sizes["k"]}[loaded_shard_id]
        dst = param.data.narrow(0, offset, self.sizes[loaded_shard_id])
        assert dst.shape == loaded_weight.shape, (dst.shape, loaded_weight.shape)
        dst.copy_(loaded_weight)


class MergedColumnParallelLinear(nn.Module):
    def __init__(self, hidden: int, sizes: list[int]):
        super().__init__()
        self.sizes = sizes
        self.weight = _param(sum(sizes), hidden)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded_weight, loaded_shard_id: int):
        offset = sum(self.sizes[:loaded_shard_id])
        dst = param.data.narrow(0, offset, self.sizes[loaded_shard_id])
        assert dst.shape == loaded_weight.shape, (dst.shape, loaded_weight.shape)
        dst.copy_(loaded_weight)


class RowParallelLinear(nn.Module):
    def __init__(self, inp: int, out: int):
        super().__init__()
        self.weight = _param(out, inp)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = _param(hidden)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = _param(vocab, hidden)


class Qwen2Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        head_dim = c["hidden_size"] // c["num_attention_heads"]
        self.qkv_proj = QKVParallelLinear(c["hidden_size"], head_dim, c["num_attention_heads"],
                                          c["num_key_value_heads"])
        self.o_proj = RowParallelLinear(c["num_attention_heads"] * head_dim, c["hidden_size"])


class Qwen2MLP(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(c["hidden_size"], [c["intermediate_size"]] * 2)
        self.down_proj = RowParallelLinear(c["intermediate_size"], c["hidden_size"])


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.self_attn = Qwen2Attention(c)
        self.mlp = Qwen2MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"])


class Qwen2Model(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Qwen2DecoderLayer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        stacked_params_mapping = [
            # (param_name, shard_name, shard_id)
            ("qkv_proj", "q_proj", "q"),
            ("qkv_proj", "k_proj", "k"),
            ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", 0),
            ("gate_up_proj", "up_proj", 1),
        ]
        params_dict = dict(self.named_parameters(remove_duplicate=False))
        loaded_params: set[str] = set()
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            for param_name, weight_name, shard_id in stacked_params_mapping:
                if weight_name not in name:
                    continue
                name = name.replace(weight_name, param_name)
                param = params_dict[name]
                weight_loader = getattr(param, "weight_loader", default_weight_loader)
                if weight_loader == default_weight_loader:
                    weight_loader(param, loaded_weight)
                else:
                    weight_loader(param, loaded_weight, shard_id)
                break
            else:
                param = params_dict[name]
                weight_loader = getattr(param, "weight_loader", default_weight_loader)
                weight_loader(param, loaded_weight)
            loaded_params.add(name)
        return loaded_params


class Qwen2ForCausalLM(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                              "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, hf_config: dict):
        super().__init__()
        self.config = hf_config
        self.model = Qwen2Model(hf_config)
        if hf_config.get("tie_word_embeddings", False):
            self.lm_head = self.model.embed_tokens  # ParallelLMHead.tie_weights
        else:
            self.lm_head = VocabParallelEmbedding(hf_config["vocab_size"], hf_config["hidden_size"])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``AutoWeightsLoader(self, skip_prefixes=["lm_head."] if tied)``: ``model.*`` goes to
        ``Qwen2Model.load_weights``; any other name that is not skipped must be a parameter."""
        tied = self.config.get("tie_word_embeddings", False)
        own = dict(self.named_parameters())
        loaded: set[str] = set()

        def inner():
            for name, tensor in weights:
                if tied and name.startswith("lm_head."):
                    continue
                if name.startswith("model."):
                    yield name[len("model."):], tensor
                elif name in own:
                    default_weight_loader(own[name], tensor)
                    loaded.add(name)
                else:
                    raise ValueError(f"There is no module or parameter named '{name}' in Qwen2ForCausalLM")

        loaded |= {"model." + n for n in self.model.load_weights(inner())}
        return loaded
