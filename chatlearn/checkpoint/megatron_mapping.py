"""The weight mapping between a Hugging Face Qwen2 / Llama checkpoint and a megatron-core
``GPTModel`` (:mod:`chatlearn.models.trainer.megatron.model` builds the model): the
architecture a ``config.json`` describes (:class:`HFArch`), every Megatron parameter with its
Hugging Face tensors (:func:`mappings`) and the conversion of their layouts both ways. A file
format, torch only: ``chatlearn merge`` turns a Megatron checkpoint into a Hugging Face folder
with it, without megatron-core.

Weight layouts. A Megatron tensor-parallel parameter is described here by its *full*
layout: the concatenation of the ``tp`` shards along the split dimension (what an all-gather
over the tensor-parallel group returns); rank r holds the r-th of ``tp`` equal chunks.

* ``linear_qkv`` (column-parallel): per query group g, the group's query heads, then its
  key head, then its value head: ``[q_g0, k_g0, v_g0, q_g1, k_g1, v_g1, ...]`` (rows; the
  same for the bias). Each rank holds ``num_query_groups / tp`` whole groups.
* ``linear_fc1`` (column-parallel, gated): each rank holds ``[gate_r; up_r]``, so the full
  layout is ``[gate_0; up_0; gate_1; up_1; ...]`` (``silu(gate) * up``, as Hugging Face).
* ``linear_proj``, ``linear_fc2`` (row-parallel): split along the input dimension (dim 1).
* ``word_embeddings``, ``output_layer`` (vocabulary-parallel): split along rows; the
  vocabulary is padded with zero rows to a multiple of ``tp`` (padding is cut on export and
  masked out of the log-probs).
* norms: replicated.
* the critic's value head (``output_layer`` of the critic's model: ``score`` of Hugging Face's
  ``*ForTokenClassification`` with one label, weight ``[1, hidden]`` and bias ``[1]``):
  replicated on every tensor-parallel rank of the last stage (kind ``value``).

Parameters are known by the names of megatron-core's local layer spec (the model module maps
the TransformerEngine spec's names to those: ``canonical_name``).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


@dataclass(frozen=True)
class HFArch:
    """What the Megatron model needs from a Hugging Face ``config.json``."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None  # Llama 3.1-style scaling, None: off
    qkv_bias: bool
    tied_embeddings: bool
    max_position_embeddings: int
    attention_dropout: float

    @classmethod
    def from_folder(cls, path: str) -> HFArch:
        """The architecture of a local HF model folder. Settings its ``config.json`` leaves out
        take the values of the model's transformers config class (``AutoConfig``), as the HF
        model itself would."""
        from transformers import AutoConfig

        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"{path}: model_type {model_type!r} is not supported by the Megatron trainer "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use train_backend: fsdp.")
        conf = AutoConfig.from_pretrained(path, trust_remote_code=False)
        if conf.hidden_act != "silu":
            raise NotImplementedError(f"{path}: hidden_act {conf.hidden_act!r} (only silu)")
        if model_type == "qwen2":  # Qwen2Config has no mlp_bias / attention_bias
            if conf.use_sliding_window:
                raise NotImplementedError(f"{path}: sliding-window attention is not supported")
            qkv_bias = True
        else:
            if conf.mlp_bias:
                raise NotImplementedError(f"{path}: mlp_bias is not supported")
            if conf.attention_bias:  # Llama's flag also adds a bias to o_proj
                raise NotImplementedError(f"{path}: attention_bias is not supported")
            qkv_bias = False
        heads = conf.num_attention_heads
        # transformers >= 5 keeps rope settings in rope_parameters, older ones in rope_theta and
        # rope_scaling
        if hasattr(conf, "rope_parameters"):
            rope = dict(conf.rope_parameters or {})
            theta = rope["rope_theta"]
            scaling = rope if rope["rope_type"] != "default" else None
        else:
            theta, scaling = conf.rope_theta, conf.rope_scaling
        head_dim = getattr(conf, "head_dim", None)  # Qwen2Config has none: hidden / heads
        return cls(
            model_type=model_type,
            num_layers=conf.num_hidden_layers,
            hidden_size=conf.hidden_size,
            ffn_hidden_size=conf.intermediate_size,
            num_heads=heads,
            num_query_groups=conf.num_key_value_heads or heads,
            head_dim=head_dim or conf.hidden_size // heads,
            vocab_size=conf.vocab_size,
            norm_eps=conf.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling_factor=_llama3_rope_factor(scaling, path),
            qkv_bias=qkv_bias,
            tied_embeddings=bool(conf.tie_word_embeddings),
            max_position_embeddings=conf.max_position_embeddings,
            attention_dropout=float(conf.attention_dropout),
        )

    def padded_vocab(self, tp: int) -> int:
        return math.ceil(self.vocab_size / tp) * tp


def _llama3_rope_factor(scaling: dict | None, path: str) -> float | None:
    """Megatron implements Llama 3.1's rope scaling with fixed constants; accept exactly that."""
    if not scaling:
        return None
    kind = scaling["rope_type"] if "rope_type" in scaling else scaling.get("type")
    # Megatron's constants; the HF config must state exactly these
    fixed = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
    if kind == "llama3" and all(k in scaling and float(scaling[k]) == v for k, v in fixed.items()):
        return float(scaling["factor"])
    raise NotImplementedError(f"{path}: rope scaling {scaling} is not supported")


# --------------------------------------------------------------------------- weight mapping


@dataclass(frozen=True)
class Mapping:
    """One Megatron parameter (global name: global layer index) and its Hugging Face tensors.

    kind: ``replicated`` | ``qkv`` | ``glu`` | ``vocab`` (column-parallel, dim 0) | ``row``
    (dim 1) | ``value`` (the critic's value head, replicated). ``layer``: global layer index, or
    ``None`` for the embedding (first stage) and the final norm / output layer (last stage).
    """

    megatron: str
    hf: tuple
    kind: str
    layer: int | None = None

    @property
    def split_dim(self) -> int | None:
        return None if self.kind in ("replicated", "value") else 1 if self.kind == "row" else 0

    @property
    def first_stage(self) -> bool:
        return self.megatron.startswith("embedding.")


def mappings(arch: HFArch, value_head: bool = False) -> list[Mapping]:
    """Every exported Megatron parameter, in Hugging Face order. ``value_head``: the critic's model,
    whose ``output_layer`` is the value head ``score`` (weight and bias) of Hugging Face's
    ``*ForTokenClassification``, never tied; else the causal LM's (``lm_head`` unless tied)."""
    out = [Mapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for i in range(arch.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn = [hf + f"self_attn.{p}_proj." for p in "qkv"]
        out.append(Mapping(mg + "self_attention.linear_qkv.weight",
                           tuple(a + "weight" for a in attn), "qkv", i))
        if arch.qkv_bias:
            out.append(Mapping(mg + "self_attention.linear_qkv.bias",
                               tuple(a + "bias" for a in attn), "qkv", i))
        out += [
            Mapping(mg + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",),
                    "row", i),
            Mapping(mg + "mlp.linear_fc1.weight",
                    (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), "glu", i),
            Mapping(mg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "row", i),
            Mapping(mg + "input_layernorm.weight", (hf + "input_layernorm.weight",),
                    "replicated", i),
            Mapping(mg + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",),
                    "replicated", i),
        ]
    out.append(Mapping("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if value_head:
        out += [Mapping("output_layer.weight", ("score.weight",), "value"),
                Mapping("output_layer.bias", ("score.bias",), "value")]
    elif not arch.tied_embeddings:
        out.append(Mapping("output_layer.weight", ("lm_head.weight",), "vocab"))
    return out


def tied_output_mapping() -> Mapping:
    """The last stage's copy of tied embeddings (pipeline parallel only): loaded, not exported."""
    return Mapping("output_layer.weight", ("model.embed_tokens.weight",), "vocab")


def hf_shapes(arch: HFArch, m: Mapping) -> list[tuple]:
    """Shapes of the Hugging Face tensors of ``m``."""
    h, hd = arch.hidden_size, arch.head_dim
    if m.kind == "vocab":
        return [(arch.vocab_size, h)]
    if m.kind == "qkv":
        rows = [arch.num_heads * hd, arch.num_query_groups * hd, arch.num_query_groups * hd]
        return [(r, h) if m.megatron.endswith("weight") else (r,) for r in rows]
    if m.kind == "glu":
        return [(arch.ffn_hidden_size, h)] * 2
    if m.kind == "row":
        inner = arch.ffn_hidden_size if "fc2" in m.megatron else arch.num_heads * hd
        return [(h, inner)]
    if m.kind == "value":
        return [(1, h) if m.megatron.endswith("weight") else (1,)]
    return [(h,)]


def to_megatron(arch: HFArch, m: Mapping, hf: list[torch.Tensor], tp: int) -> torch.Tensor:
    """Hugging Face tensors -> the full Megatron layout (see the module docstring)."""
    if m.kind == "qkv":
        g = arch.num_query_groups
        q, k, v = (t.reshape(g, -1, *t.shape[1:]) for t in hf)
        return torch.cat([q, k, v], dim=1).reshape(-1, *hf[0].shape[1:])
    if m.kind == "glu":
        gate, up = (t.chunk(tp, dim=0) for t in hf)
        return torch.cat([x for r in range(tp) for x in (gate[r], up[r])], dim=0)
    if m.kind == "vocab":
        pad = arch.padded_vocab(tp) - arch.vocab_size
        return torch.cat([hf[0], hf[0].new_zeros(pad, hf[0].shape[1])]) if pad else hf[0]
    return hf[0]


def to_hf(arch: HFArch, m: Mapping, full: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """The full Megatron layout -> Hugging Face tensors (inverse of :func:`to_megatron`)."""
    if m.kind == "qkv":
        g, hd = arch.num_query_groups, arch.head_dim
        per_group = arch.num_heads // g * hd
        grouped = full.reshape(g, per_group + 2 * hd, *full.shape[1:])
        q, k, v = grouped.split([per_group, hd, hd], dim=1)
        return [t.reshape(-1, *full.shape[1:]) for t in (q, k, v)]
    if m.kind == "glu":
        halves = [c.chunk(2, dim=0) for c in full.chunk(tp, dim=0)]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    if m.kind == "vocab":
        return [full[:arch.vocab_size]]
    return [full]


def local_shard(full: torch.Tensor, m: Mapping, tp: int, tp_rank: int) -> torch.Tensor:
    """Rank ``tp_rank``'s part of a full Megatron tensor."""
    return full if m.split_dim is None else full.chunk(tp, dim=m.split_dim)[tp_rank]
