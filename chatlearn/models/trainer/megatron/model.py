"""A megatron-core ``GPTModel`` for a Hugging Face Qwen2 / Llama checkpoint, and the weight
mapping between the two.

Architecture (from ``config.json``): grouped-query attention (``num_query_groups``), RMSNorm,
SwiGLU MLP, rotary embeddings with the model's theta, QKV bias for Qwen2, no other biases,
tied or untied input/output embeddings.

Layer spec (chosen in one place, :func:`uses_transformer_engine`): on CUDA with
TransformerEngine importable, megatron-core's ``get_gpt_layer_with_transformer_engine_spec``
(fused RMSNorm + linear, TE's fused / flash attention, which takes packed rows in the ``thd``
format: :func:`thd_packed_seq_params`); otherwise its local spec (``get_gpt_layer_local_spec``:
plain torch, unfused attention with an explicit mask), with its norms replaced by
:class:`RMSNorm`, which also supports sequence parallelism. The final norm is
:class:`RMSNorm` with both. The two specs name the per-layer norms differently; parameters are
known everywhere else (mapping, checkpoints) by the local spec's names
(:func:`canonical_name`), so checkpoints do not depend on the spec.

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
"""
from __future__ import annotations

import dataclasses
import functools
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


# --------------------------------------------------------------------------- the model


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with Megatron's norm constructor. Under sequence parallelism its
    weight is marked so that Megatron all-reduces its gradient over the tensor-parallel
    group (each rank saw only its slice of the sequence)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype,
                         device="cpu" if config.use_cpu_initialization else torch.cuda.current_device())
        self.weight.sequence_parallel = config.sequence_parallel


def transformer_config(arch: HFArch, *, tp: int, pp: int, sequence_parallel: bool,
                       params_dtype: torch.dtype, cpu_init: bool, recompute: bool):
    """The megatron-core ``TransformerConfig`` of ``arch``.

    Fusions that need compiled extensions (softmax, rope, gradient accumulation) are off;
    the loss is summed per token (``calculate_per_token_loss``: Megatron then divides the
    gradients by the number of tokens of the global batch). The random initialisation is
    overwritten by the checkpoint, but is kept on: it is also where megatron-core tags the
    tensor-parallel weights (``tensor_model_parallel``), and untagged weights would be
    counted as replicas in the gradient norm.
    """
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    if arch.num_heads % tp or arch.num_query_groups % tp:
        raise ValueError(f"tensor_model_parallel_size {tp} must divide the attention heads "
                         f"({arch.num_heads}) and the key/value heads ({arch.num_query_groups})")
    if arch.num_layers % pp:
        raise ValueError(f"pipeline_model_parallel_size {pp} must divide the number of layers "
                         f"({arch.num_layers})")
    extra = ({"recompute_granularity": "full", "recompute_method": "uniform",
              "recompute_num_layers": 1} if recompute else {})
    return TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size, num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_query_groups, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0, attention_dropout=arch.attention_dropout,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=cpu_init, perform_initialization=True,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        calculate_per_token_loss=True,
        **extra)


# TE spec parameter name -> local spec name (the norms fused into the following linear)
TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def canonical_name(name: str) -> str:
    """A parameter's name under the local layer spec, whichever spec built it."""
    for te, local in TE_NAMES.items():
        if name.endswith("." + te):
            return name[:-len(te)] + local
    return name


def uses_transformer_engine(device: torch.device) -> bool:
    """Whether to build the TransformerEngine layer spec: on a CUDA device when
    ``transformer_engine.pytorch`` imports (TE's modules and kernels are CUDA-only). Else the
    local spec, the CPU twin (same math; attention unfused, quadratic in the row width)."""
    if device.type != "cuda":
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def thd_packed_seq_params(lengths, width: int, device):
    """megatron-core's ``PackedSeqParams`` (0.16, ``packed_seq_params.py``) for one packed row
    of ``width`` tokens holding samples of ``lengths`` one after the other, then padding.

    ``qkv_format="thd"``: TE's attention (``TEDotProductAttention``, which megatron-core turns to
    a ``padding_causal`` mask for ``thd``) and megatron-core's rotary embedding
    (``_apply_rotary_pos_emb_thd``: positions restart at every ``cu_seqlens`` boundary) treat
    each segment as its own sequence. The padding at the end of the row (to the pipeline's
    fixed width, or to a multiple of the tensor-parallel size under sequence parallelism, the
    only padding megatron-core needs without context parallelism) is one more segment, so
    ``cu_seqlens[-1] == width`` and no padded variants are needed. ``cu_seqlens`` are int32 on
    ``device``; the max lengths are Python ints (TE >= 1.3 takes them so as not to read them
    from the device)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + int(n))
    if bounds[-1] > width:
        raise ValueError(f"samples of {bounds[-1]} tokens do not fit a row of {width}")
    if bounds[-1] < width:
        bounds.append(width)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = max(b - a for a, b in zip(bounds, bounds[1:]))
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


@functools.cache
def _gpt_model_class():
    """megatron-core's ``GPTModel`` whose rotary embedding follows ``position_ids``.

    megatron-core's ``"rope"`` ignores ``position_ids``: it rotates the token in row b,
    column s by the angles of position s (``RotaryEmbedding(seq_len)``: ``[s, 1, 1, d]``).
    Here the table is indexed by the position ids instead, ``freqs[s, b] = table[position_ids[b, s]]``
    (``[s, b, 1, d]``, which the unfused ``_apply_rotary_pos_emb_bshd`` broadcasts over
    the heads), so that a packed row whose position ids restart at 0 for each sample rotates
    every sample as if it were alone. Position ids ``0 .. s-1`` in every row give the same
    angles as megatron-core's own. Needs ``apply_rope_fusion`` off (see
    :func:`transformer_config`). With ``thd`` ``PackedSeqParams`` the table is left as it is:
    megatron-core then restarts the positions at every sequence boundary itself.
    """
    from megatron.core.models.gpt import GPTModel

    class PositionedGPTModel(GPTModel):
        def _preprocess(self, input_ids, position_ids, *args, **kwargs):
            out = super()._preprocess(input_ids, position_ids, *args, **kwargs)
            table = out[1]  # [S, 1, 1, d]: the angles of positions 0 .. S-1 (S >= every id)
            packed = kwargs.get("packed_seq_params")
            if table is None or position_ids is None or packed is not None:
                return out
            freqs = table[:, 0][position_ids.t()]  # [s, b, 1, d]
            return (out[0], freqs, *out[2:])

    return PositionedGPTModel


def layer_spec(transformer_engine: bool):
    """The transformer layer's ``ModuleSpec``: megatron-core's TransformerEngine spec, or its
    local spec with :class:`RMSNorm` norms (see the module docstring)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if transformer_engine:
        # norms fused into linear_qkv / linear_fc1 (RMSNorm: config.normalization)
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=False)
    layer = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    return dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm))


def build_gpt_model(arch: HFArch, config, transformer_engine: bool = False):
    """This pipeline stage's ``GPTModel`` (parallel state must be initialised) with the layer
    spec of :func:`layer_spec`, with rotary positions taken from ``position_ids`` (see
    :func:`_gpt_model_class`)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = layer_spec(transformer_engine)
    block = TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config),
                                       layer_norm=RMSNorm)
    tp = config.tensor_model_parallel_size
    return _gpt_model_class()(
        config=config, transformer_layer_spec=block, vocab_size=arch.padded_vocab(tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True, share_embeddings_and_output_weights=arch.tied_embeddings,
        position_embedding_type="rope", rotary_base=arch.rope_theta,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0)


# --------------------------------------------------------------------------- weight mapping


@dataclass(frozen=True)
class Mapping:
    """One Megatron parameter (global name: global layer index) and its Hugging Face tensors.

    kind: ``replicated`` | ``qkv`` | ``glu`` | ``vocab`` (column-parallel, dim 0) | ``row``
    (dim 1). ``layer``: global layer index, or ``None`` for the embedding (first stage) and
    the final norm / output layer (last stage).
    """

    megatron: str
    hf: tuple
    kind: str
    layer: int | None = None

    @property
    def split_dim(self) -> int | None:
        return None if self.kind == "replicated" else 1 if self.kind == "row" else 0

    @property
    def first_stage(self) -> bool:
        return self.megatron.startswith("embedding.")


def mappings(arch: HFArch) -> list[Mapping]:
    """Every exported Megatron parameter, in Hugging Face order."""
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
    if not arch.tied_embeddings:
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


# --------------------------------------------------------------------------- checkpoint files


class HFCheckpoint:
    """Reads single tensors of a Hugging Face model folder (safetensors or torch .bin,
    single file or sharded with an index), without loading the whole checkpoint."""

    def __init__(self, path: str):
        self.path = path
        self.files: dict[str, str] = {}
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            file = os.path.join(path, index)
            if os.path.isfile(file):
                with open(file, encoding="utf-8") as f:
                    self.files = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
                break
        else:
            for single in ("model.safetensors", "pytorch_model.bin"):
                if os.path.isfile(os.path.join(path, single)):
                    self.files = {"*": os.path.join(path, single)}
                    break
        if not self.files:
            raise FileNotFoundError(f"{path}: no model.safetensors or pytorch_model.bin "
                                    "(with or without an index) found")
        self._bins: dict[str, dict] = {}

    def get(self, name: str) -> torch.Tensor:
        file = self.files[name] if name in self.files else self.files.get("*")
        if file is None:
            raise KeyError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(file, framework="pt") as f:
                if name not in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    raise KeyError(f"{file}: tensor {name!r} is not in the checkpoint")
                return f.get_tensor(name)
        if file not in self._bins:
            self._bins[file] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        return self._bins[file][name]
