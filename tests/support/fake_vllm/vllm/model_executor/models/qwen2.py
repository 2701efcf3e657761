"""Qwen2 as vLLM 0.32 builds it for one tensor-parallel rank: fused ``qkv_proj`` and
``gate_up_proj`` parameters whose ``weight_loader`` takes a shard id, and ``load_weights``
that maps Hugging Face names onto them (``vllm/model_executor/models/qwen2.py``:
``Qwen2Model.hf_to_vllm_mapper``; ``AutoWeightsLoader`` in ``models/utils.py``; linear layers
from ``layers/linear.py``). Unknown names fail as they do there (``ValueError``), a tied
``lm_head.weight`` is skipped as an alias of the embedding. The parameters are float32, zeros
until the engine loads the checkpoint. Writing into a parameter whose memory sleep mode released
fails (``device_allocator/cumem.py``)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from vllm.device_allocator.cumem import check_mapped
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
        check_mapped(param)
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
        check_mapped(param)
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

    # Qwen2Model.hf_to_vllm_mapper (orig_to_new_stacked): weight name part -> (parameter, shard id)
    stacked = {".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"), ".v_proj": (".qkv_proj", "v"),
               ".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``AutoWeightsLoader(self).load_weights(weights, mapper=hf_to_vllm_mapper)``: rotary
        caches dropped, stacked names mapped to the fused parameter and its shard id; a name that
        is no parameter fails (``ValueError``), except one ending in ``.bias`` (ignored, for GPTQ
        checkpoints)."""
        params_dict = dict(self.named_parameters(remove_duplicate=False))
        loaded_params: set[str] = set()
        for name, loaded_weight in weights:
            if "rotary_emb.inv_freq" in name or "rotary_pos_emb.inv_freq" in name:
                continue
            shard_id = None
            for part, (fused, shard) in self.stacked.items():
                if part in name:
                    name, shard_id = name.replace(part, fused, 1), shard
            param = params_dict.get(name)
            if param is None:
                if name.endswith(".bias"):
                    continue
                raise ValueError(f"There is no module or parameter named '{name}' in Qwen2Model")
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            if shard_id is None:
                weight_loader(param, loaded_weight)
            else:
                weight_loader(param, loaded_weight, shard_id)
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
        """``AutoWeightsLoader(self).load_weights(weights)`` of vLLM 0.32: ``model.*`` goes to
        ``Qwen2Model.load_weights``; a tied ``lm_head.weight`` is an alias of
        ``model.embed_tokens.weight`` and is skipped, but only when that name is loaded by the
        same call (else ``ValueError``: the tied weight would be left uninitialised); any other
        name must be a parameter (a ``.bias`` that is not is ignored)."""
        tied = self.config.get("tie_word_embeddings", False)
        aliases = {"lm_head.weight": "model.embed_tokens.weight"} if tied else {}
        own = dict(self.named_parameters())
        loaded: set[str] = set()
        skipped: dict[str, str] = {}

        def inner():
            for name, tensor in weights:
                if "rotary_emb.inv_freq" in name:
                    continue
                if name in aliases:
                    skipped[name] = aliases[name]
                elif name.startswith("model."):
                    yield name[len("model."):], tensor
                elif name in own:
                    default_weight_loader(own[name], tensor)
                    loaded.add(name)
                elif not name.endswith(".bias"):
                    raise ValueError(f"There is no module or parameter named '{name}' in Qwen2ForCausalLM")

        loaded |= {"model." + n for n in self.model.load_weights(inner())}
        for alias, canonical in skipped.items():
            if canonical not in loaded:
                raise ValueError(f"{alias!r} was skipped because it is tied to {canonical!r} in Qwen2ForCausalLM, "
                                 f"but {canonical!r} was not found in the checkpoint, so the tied weight is "
                                 "uninitialized.")
        return loaded
