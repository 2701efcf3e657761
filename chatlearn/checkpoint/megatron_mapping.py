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
* norms: replicated (Qwen3's per-head ``q_norm`` / ``k_norm``: ``q_layernorm`` / ``k_layernorm``).
* mixture of experts (Qwen3-MoE, Qwen2-MoE; :attr:`HFArch.moe_layers`): the router
  ``mlp.router.weight`` (Hugging Face ``mlp.gate.weight``, ``[experts, hidden]``) is
  replicated; expert ``e`` of a layer is ``mlp.experts.local_experts.<e>.linear_fc1`` /
  ``linear_fc2`` by its *global* id (megatron-core names it by its index among the
  ``experts / expert_model_parallel_size`` local experts of its expert-parallel rank: the
  trainer renames), with the layouts of ``linear_fc1`` / ``linear_fc2`` over the
  *expert*-tensor-parallel size (``Mapping.expert``); Hugging Face's on-disk names are per
  expert, ``mlp.experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj`` (what
  ``save_pretrained`` writes and vLLM loads; transformers fuses them in the module as
  ``mlp.experts.gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``: :func:`module_views`).
  Qwen2-MoE's shared expert is ``mlp.shared_experts.linear_fc1`` / ``linear_fc2`` (the dense
  layouts) and its sigmoid gate ``mlp.shared_experts.gate_weight`` (``[1, hidden]``,
  replicated; Hugging Face ``mlp.shared_expert_gate.weight``).
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

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3_moe", "qwen2_moe")
MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")


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
    # mixture of experts (0 / empty on a dense model)
    qk_norm: bool = False  # Qwen3: RMSNorm of every query and key head
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = False  # the top-k probabilities renormalised to sum to 1
    shared_expert_ffn_hidden_size: int = 0  # Qwen2-MoE's shared expert (with its sigmoid gate); 0: none
    moe_layers: tuple = ()  # the layers whose MLP is the experts' (the others are dense)
    router_aux_loss_coef: float = 0.0
    # the embedding's padding_idx (config.json's pad_token_id): the Hugging Face model's nn.Embedding gives
    # that row no gradient from the input side; None: no such row
    padding_idx: int | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

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
        moe = _moe_fields(conf, model_type, path) if model_type in MOE_MODEL_TYPES else {}
        if model_type in ("qwen2", "qwen2_moe"):  # Qwen2Config has no mlp_bias / attention_bias
            if getattr(conf, "use_sliding_window", False):
                raise NotImplementedError(f"{path}: sliding-window attention is not supported")
            qkv_bias = bool(getattr(conf, "qkv_bias", True))
        elif model_type == "qwen3_moe":
            if getattr(conf, "use_sliding_window", False):
                raise NotImplementedError(f"{path}: sliding-window attention is not supported")
            qkv_bias = bool(conf.attention_bias)
            if qkv_bias:  # Qwen3's flag adds a bias to q/k/v and to o_proj
                raise NotImplementedError(f"{path}: attention_bias is not supported")
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
            padding_idx=getattr(conf, "pad_token_id", None),
            **moe,
        )

    def padded_vocab(self, tp: int) -> int:
        return math.ceil(self.vocab_size / tp) * tp


def _moe_fields(conf, model_type: str, path: str) -> dict:
    """The mixture-of-experts fields of :class:`HFArch` from a Qwen3-MoE / Qwen2-MoE config:
    which layers have experts (Hugging Face's rule: not in ``mlp_only_layers`` and
    ``(layer + 1) % decoder_sparse_step == 0``), the router (softmax over all experts, top-k,
    renormalised when ``norm_topk_prob``), Qwen3's query/key norms, Qwen2-MoE's shared expert."""
    experts = int(conf.num_experts or 0)
    if experts <= 0:
        raise NotImplementedError(f"{path}: {model_type} with num_experts {experts}: no experts to map")
    step = int(getattr(conf, "decoder_sparse_step", 1) or 1)
    only_mlp = set(getattr(conf, "mlp_only_layers", None) or [])
    layers = tuple(i for i in range(conf.num_hidden_layers) if i not in only_mlp and (i + 1) % step == 0)
    if not layers:
        raise NotImplementedError(f"{path}: no layer has experts (decoder_sparse_step {step}, mlp_only_layers "
                                  f"{sorted(only_mlp)})")
    shared = int(getattr(conf, "shared_expert_intermediate_size", 0) or 0) if model_type == "qwen2_moe" else 0
    return {"qk_norm": model_type == "qwen3_moe", "num_experts": experts,
            "moe_topk": int(conf.num_experts_per_tok), "moe_ffn_hidden_size": int(conf.moe_intermediate_size),
            "norm_topk_prob": bool(conf.norm_topk_prob), "shared_expert_ffn_hidden_size": shared,
            "moe_layers": layers, "router_aux_loss_coef": float(getattr(conf, "router_aux_loss_coef", 0.0) or 0.0)}


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
    ``expert``: the global id of a routed expert's ``linear_fc1`` / ``linear_fc2`` (held by one
    expert-parallel rank, split over the expert-tensor-parallel ranks).
    """

    megatron: str
    hf: tuple
    kind: str
    layer: int | None = None
    expert: int | None = None  # a routed expert's global id: split over the expert-tensor-parallel ranks

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
        out.append(Mapping(mg + "self_attention.linear_proj.weight", (hf + "self_attn.o_proj.weight",),
                           "row", i))
        if arch.qk_norm:
            out += [Mapping(mg + "self_attention.q_layernorm.weight", (hf + "self_attn.q_norm.weight",),
                            "replicated", i),
                    Mapping(mg + "self_attention.k_layernorm.weight", (hf + "self_attn.k_norm.weight",),
                            "replicated", i)]
        if i in arch.moe_layers:
            out += _expert_mappings(arch, i)
        else:
            out += [Mapping(mg + "mlp.linear_fc1.weight",
                            (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"), "glu", i),
                    Mapping(mg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "row", i)]
        out += [
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


def _expert_mappings(arch: HFArch, i: int) -> list[Mapping]:
    """Layer ``i``'s router, routed experts (by global id) and shared expert with its gate."""
    hf, mg = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
    out = [Mapping(mg + "router.weight", (hf + "gate.weight",), "replicated", i)]
    for e in range(arch.num_experts):
        ex, me = f"{hf}experts.{e}.", f"{mg}experts.local_experts.{e}."
        out += [Mapping(me + "linear_fc1.weight", (ex + "gate_proj.weight", ex + "up_proj.weight"), "glu", i, e),
                Mapping(me + "linear_fc2.weight", (ex + "down_proj.weight",), "row", i, e)]
    if arch.shared_expert_ffn_hidden_size:
        out += [Mapping(mg + "shared_experts.linear_fc1.weight",
                        (hf + "shared_expert.gate_proj.weight", hf + "shared_expert.up_proj.weight"), "glu", i),
                Mapping(mg + "shared_experts.linear_fc2.weight", (hf + "shared_expert.down_proj.weight",), "row", i),
                Mapping(mg + "shared_experts.gate_weight", (hf + "shared_expert_gate.weight",), "replicated", i)]
    return out


def module_views(arch: HFArch, names: list[str]) -> list[tuple[str, tuple | None, list[str], str | None]]:
    """The tensors of transformers' module for the checkpoint tensors ``names`` (in order):
    ``(module name, shape or None: the tensor's own, checkpoint names it is made of, fusion)``.
    transformers (5.x) keeps a Qwen3-MoE / Qwen2-MoE layer's routed experts fused,
    ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows;
    fusion ``gate_up``) and ``mlp.experts.down_proj`` ``[E, H, I]`` (fusion ``stack``), and
    converts from and to the per-expert checkpoint names when it loads and saves; every other
    tensor is its own view (fusion None). The weight push exports this form (the FSDP trainer's
    export is the module's parameters, so both trainers push the same names):
    :func:`fuse_module_view`."""
    out, seen = [], set()
    h, inter, n = arch.hidden_size, arch.moe_ffn_hidden_size, arch.num_experts
    for name in names:
        parts = name.split(".")
        if arch.is_moe and len(parts) == 8 and parts[3:5] == ["mlp", "experts"] and parts[5].isdigit():
            layer = ".".join(parts[:3])
            if layer not in seen:
                seen.add(layer)
                gate_up = [f"{layer}.mlp.experts.{e}.{p}_proj.weight" for e in range(n) for p in ("gate", "up")]
                down = [f"{layer}.mlp.experts.{e}.down_proj.weight" for e in range(n)]
                out += [(f"{layer}.mlp.experts.gate_up_proj", (n, 2 * inter, h), gate_up, "gate_up"),
                        (f"{layer}.mlp.experts.down_proj", (n, h, inter), down, "stack")]
            continue
        out.append((name, None, [name], None))
    return out


def fuse_module_view(fusion: str | None, parts: list[torch.Tensor]) -> torch.Tensor:
    """The module tensor of :func:`module_views` from its checkpoint tensors, in that order:
    ``gate_up``: ``[gate_0, up_0, gate_1, up_1, ...]`` -> ``[E, 2I, H]``; ``stack``:
    ``[down_0, ...]`` -> ``[E, H, I]``; None: the one tensor."""
    if fusion is None:
        return parts[0]
    if fusion == "gate_up":
        return torch.stack([torch.cat(parts[k:k + 2]) for k in range(0, len(parts), 2)])
    return torch.stack(parts)


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
        return [(_ffn(arch, m), h)] * 2
    if m.kind == "row":
        inner = _ffn(arch, m) if "fc2" in m.megatron else arch.num_heads * hd
        return [(h, inner)]
    if m.kind == "value":
        return [(1, h) if m.megatron.endswith("weight") else (1,)]
    if m.megatron.endswith("mlp.router.weight"):
        return [(arch.num_experts, h)]
    if m.megatron.endswith("shared_experts.gate_weight"):
        return [(1, h)]
    if m.megatron.endswith(("q_layernorm.weight", "k_layernorm.weight")):
        return [(hd,)]
    return [(h,)]


def _ffn(arch: HFArch, m: Mapping) -> int:
    """The intermediate size of an MLP's ``linear_fc1`` / ``linear_fc2``: a routed expert's, the
    shared expert's or the dense MLP's."""
    if m.expert is not None:
        return arch.moe_ffn_hidden_size
    if ".shared_experts." in m.megatron:
        return arch.shared_expert_ffn_hidden_size
    return arch.ffn_hidden_size


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
