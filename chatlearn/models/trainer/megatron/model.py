"""A megatron-core ``GPTModel`` for a Hugging Face Qwen2 / Llama checkpoint, or a Qwen3-MoE / Qwen2-MoE
one: megatron-core's ``MoELayer`` in the layers with experts (:func:`moe_config`, :func:`layer_spec`).

Architecture (from ``config.json``, :class:`chatlearn.checkpoint.megatron_mapping.HFArch`):
grouped-query attention (``num_query_groups``), RMSNorm, SwiGLU MLP, rotary embeddings with
the model's theta, QKV bias for Qwen2, no other biases, tied or untied input/output embeddings.
The weight mapping between the two and the weight layouts are in
:mod:`chatlearn.checkpoint.megatron_mapping` (a file format, without megatron-core).

Layer spec (chosen in one place, :func:`uses_transformer_engine`): on CUDA with
TransformerEngine importable, megatron-core's ``get_gpt_layer_with_transformer_engine_spec``
(fused RMSNorm + linear, TE's fused / flash attention, which takes packed rows in the ``thd``
format: :func:`thd_packed_seq_params`); otherwise its local spec (``get_gpt_layer_local_spec``:
plain torch, unfused attention with an explicit mask), with its norms replaced by
:class:`RMSNorm`, which also supports sequence parallelism. The final norm is
:class:`RMSNorm` with both. The two specs name the per-layer norms differently; parameters are
known everywhere else (mapping, checkpoints) by the local spec's names
(:func:`canonical_name`), so checkpoints do not depend on the spec.

The PPO critic (:func:`build_gpt_model` with ``value_head``) is the same model whose vocabulary
output layer is replaced by a scalar value head, :class:`ValueHead` (verl's Megatron critic:
``LinearForLastLayer`` in place of ``output_layer``), initialised as Hugging Face initialises
``AutoModelForTokenClassification``'s ``score`` (:func:`initial_value_head`).
"""
from __future__ import annotations

import dataclasses
import functools
import re

import torch
import torch.nn.functional as F

from chatlearn.checkpoint.megatron_mapping import HFArch

# --------------------------------------------------------------------------- the model


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with Megatron's norm constructor. Under sequence parallelism its
    weight is marked so that Megatron all-reduces its gradient over the tensor-parallel
    group (each rank saw only its slice of the sequence)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype,
                         device="cpu" if config.use_cpu_initialization else torch.cuda.current_device())
        self.weight.sequence_parallel = config.sequence_parallel


@dataclasses.dataclass(frozen=True)
class MoEOptions:
    """The trainer's mixture-of-experts keys (``TrainerModel``: docs/config.md, "Mixture of
    experts"), as megatron-core takes them (:func:`moe_config`)."""

    ep: int = 1  # expert_model_parallel_size
    etp: int | None = None  # expert_tensor_parallel_size; None: the tensor-parallel size
    dispatcher: str = "alltoall"  # moe_token_dispatcher_type
    aux_loss_coeff: float | None = None  # None: config.json's router_aux_loss_coef
    z_loss_coeff: float = 0.0
    force_load_balancing: bool = False
    layer_recompute: bool = False
    shared_expert_overlap: bool = False
    grouped_gemm: bool = False  # honoured on CUDA only (:func:`grouped_gemm_available`)
    replay: bool = False  # routing_replay: rollout (:mod:`.replay`)


def moe_config(arch: HFArch, moe: MoEOptions, recompute: str | None) -> dict:
    """megatron-core 0.16 ``TransformerConfig`` fields of ``arch``'s experts.

    Routing: Hugging Face's Qwen3-MoE / Qwen2-MoE router takes the softmax over every expert,
    keeps the top-k and, with ``norm_topk_prob``, renormalises them to sum to 1. megatron-core's
    softmax router without ``moe_router_pre_softmax`` takes the top-k of the logits and the
    softmax over those k, which is the renormalised probabilities (same experts: the softmax is
    monotonic); with ``moe_router_pre_softmax`` the softmax over every expert, then the top-k,
    which is Hugging Face without renormalisation. Dropless (no capacity factor), the router in
    the model's dtype (as Hugging Face's ``F.linear``). Layers without experts
    (``mlp_only_layers`` / ``decoder_sparse_step``) are the dense MLP: ``moe_layer_freq`` as a
    list. The aux loss is megatron-core's switch load-balancing loss (``aux_loss``), the z-loss
    its ST-MoE z-loss; both act in training only (they add to the gradients, not to the reported
    loss). ``moe_layer_recompute`` under full recomputation is already done (each whole layer is
    recomputed; megatron-core refuses the two together), so it is not passed then."""
    if arch.moe_topk == 1 and arch.norm_topk_prob:
        raise NotImplementedError(
            "num_experts_per_tok 1 with norm_topk_prob: the renormalised weight is always 1, which "
            "megatron-core's router refuses (its softmax over one expert has no gradient); use "
            "train_backend: fsdp")
    aux = arch.router_aux_loss_coef if moe.aux_loss_coeff is None else float(moe.aux_loss_coeff)
    return dict(
        num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_topk,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_layer_freq=[1 if i in arch.moe_layers else 0 for i in range(arch.num_layers)],
        moe_router_score_function="softmax", moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=aux,
        moe_z_loss_coeff=float(moe.z_loss_coeff) or None,
        moe_token_dispatcher_type=moe.dispatcher,
        moe_router_force_load_balancing=bool(moe.force_load_balancing),
        moe_layer_recompute=bool(moe.layer_recompute) and recompute != "full",
        moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=bool(arch.shared_expert_ffn_hidden_size),
        moe_shared_expert_overlap=bool(moe.shared_expert_overlap) and bool(arch.shared_expert_ffn_hidden_size),
        moe_grouped_gemm=bool(moe.grouped_gemm),
        moe_enable_routing_replay=bool(moe.replay),
        moe_permute_fusion=False, moe_router_fusion=False,
        expert_model_parallel_size=moe.ep, expert_tensor_parallel_size=moe.etp,
    )


def grouped_gemm_available(device: torch.device) -> tuple[bool, str]:
    """``(available, why not)``: megatron-core's grouped GEMM experts run CUDA kernels; this trainer
    takes TransformerEngine's (``TEGroupedMLP``, built by the TE layer spec: each local expert's
    weight is ``weight<j>`` of one grouped linear, in ``SequentialMLP``'s layout, see
    :func:`canonical_name`). megatron-core's legacy ``GroupedMLP`` (the ``grouped_gemm`` package, the
    local spec) keeps every local expert in one fused tensor that the weight mapping does not read."""
    if device.type != "cuda":
        return False, ("grouped GEMM runs CUDA kernels (TransformerEngine's grouped linear) and this "
                       "trainer runs on the CPU")
    if not uses_transformer_engine(device):
        return False, ("TransformerEngine is not importable (megatron-core's legacy GroupedMLP of the "
                       "grouped_gemm package is not supported)")
    return True, ""


def transformer_config(arch: HFArch, *, tp: int, pp: int, sequence_parallel: bool,
                       params_dtype: torch.dtype, cpu_init: bool, recompute: str | None,
                       moe: MoEOptions | None = None):
    """The megatron-core ``TransformerConfig`` of ``arch``.

    Fusions that need compiled extensions (softmax, rope, gradient accumulation) are off;
    the loss is summed per token (``calculate_per_token_loss``: Megatron then divides the
    gradients by the number of tokens of the global batch). The random initialisation is
    overwritten by the checkpoint, but is kept on: it is also where megatron-core tags the
    tensor-parallel weights (``tensor_model_parallel``), and untagged weights would be
    counted as replicas in the gradient norm.
    """
    from megatron.core.transformer import TransformerConfig

    if arch.num_heads % tp or arch.num_query_groups % tp:
        raise ValueError(f"tensor_model_parallel_size {tp} must divide the attention heads "
                         f"({arch.num_heads}) and the key/value heads ({arch.num_query_groups})")
    if arch.num_layers % pp:
        raise ValueError(f"pipeline_model_parallel_size {pp} must divide the number of layers "
                         f"({arch.num_layers})")
    extra_moe = moe_config(arch, moe or MoEOptions(), recompute) if arch.is_moe else {}
    if arch.is_moe and arch.moe_ffn_hidden_size % (extra_moe["expert_tensor_parallel_size"] or tp):
        raise ValueError(f"expert_tensor_parallel_size {extra_moe['expert_tensor_parallel_size'] or tp} must divide "
                         f"the experts' intermediate size ({arch.moe_ffn_hidden_size})")
    if recompute not in (None, "full", "selective"):
        raise ValueError(f"recompute must be None, 'full' or 'selective', not {recompute!r}")
    # full: every layer's input kept, the whole layer recomputed in backward (one layer per unit);
    # selective: only the core attention (megatron-core's default recompute_modules) is recomputed
    extra = ({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
             if recompute == "full" else {"recompute_granularity": "selective"} if recompute == "selective" else {})
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
        calculate_per_token_loss=True, qk_layernorm=arch.qk_norm,
        **extra, **extra_moe)


# TE spec parameter name -> local spec name (the norms fused into the following linear)
TE_NAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
            "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


# TransformerEngine's grouped experts (TEGroupedMLP): local expert j's weight is weight<j> of
# one grouped linear, in the layout of the sequential experts' linear_fc1 / linear_fc2
_TE_GROUPED = re.compile(r"\.mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def canonical_name(name: str) -> str:
    """A parameter's name under the local layer spec (sequential experts), whichever spec built
    it. Experts keep their local index here (the trainer renames them by global id)."""
    for te, local in TE_NAMES.items():
        if name.endswith("." + te):
            return name[:-len(te)] + local
    m = _TE_GROUPED.search(name)
    if m:
        return name[:m.start()] + f".mlp.experts.local_experts.{m.group(2)}.{m.group(1)}.weight"
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


def layer_spec(transformer_engine: bool, num_experts: int | None = None, grouped_gemm: bool = False,
               qk_norm: bool = False):
    """The transformer layer's ``ModuleSpec``: megatron-core's TransformerEngine spec, or its
    local spec with :class:`RMSNorm` norms (see the module docstring). ``num_experts``: the
    layer's MLP is megatron-core's ``MoELayer`` (router, experts as ``SequentialMLP``, or grouped
    GEMMs with ``grouped_gemm``, shared experts); ``qk_norm``: RMSNorm of each query and key
    head (Qwen3)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if transformer_engine:
        # norms fused into linear_qkv / linear_fc1 (RMSNorm: config.normalization); an MoE
        # layer's pre-MLP norm is its own TENorm
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=grouped_gemm, qk_layernorm=qk_norm)
    layer = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=grouped_gemm,
                                                     qk_layernorm=qk_norm, normalization="RMSNorm")
    attention = layer.submodules.self_attention
    if qk_norm:
        attention = dataclasses.replace(attention, submodules=dataclasses.replace(
            attention.submodules, q_layernorm=RMSNorm, k_layernorm=RMSNorm))
    return dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm, self_attention=attention))


class ValueHead(torch.nn.Linear):
    """The critic's value head in place of ``GPTModel.output_layer`` (last pipeline stage): a plain
    ``Linear(hidden_size, 1)`` with a bias, Hugging Face's ``score`` of
    ``*ForTokenClassification`` with one label, applied to the final-normed hidden states
    ``[s, b, h]`` -> ``[s, b, 1]`` (``GPTModel`` returns them as ``[b, s, 1]``).

    Not vocabulary-parallel: every tensor-parallel rank holds the whole head (no
    ``tensor_model_parallel`` attribute, so Megatron's gradient norm counts it once) and computes
    it on the whole sequence. Under sequence parallelism the hidden states are all-gathered over
    the tensor-parallel group first, with a backward that only takes this rank's slice of the
    gradient (``tensor_parallel_output_grad=False``: everything after the gather is computed
    identically on every rank, so the gradient is not summed over the ranks). The head's inputs,
    outputs and upstream gradients are thus the same on every tensor-parallel rank, and so are its
    gradients, its Adam steps and its weights (identical by construction, as for the replicated
    norms without sequence parallelism; no gradient all-reduce over the group is needed)."""

    def __init__(self, config):
        super().__init__(config.hidden_size, 1, bias=True, dtype=config.params_dtype,
                         device="cpu" if config.use_cpu_initialization else torch.cuda.current_device())
        self.sequence_parallel = bool(config.sequence_parallel)

    def reset_parameters(self) -> None:
        """Zeros (no random draw): the head is copied from the checkpoint or from
        :func:`initial_value_head` afterwards."""
        torch.nn.init.zeros_(self.weight)
        torch.nn.init.zeros_(self.bias)

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        """``(values [s, b, 1], None)``, the call signature of ``GPTModel.output_layer``
        (``weight`` and ``runtime_gather_output`` are not used)."""
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states,
                                                                 tensor_parallel_output_grad=False)
        return super().forward(hidden_states), None


def initial_value_head(path: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight [1, h], bias [1])``, float32 on the CPU: the value head that
    ``AutoModelForTokenClassification.from_pretrained(path, num_labels=1)`` newly initialises after
    ``torch.manual_seed(seed)``, which is what the FSDP critic's head starts from (so that both
    backends start from the same critic; Hugging Face's ``_init_weights``: normal(0,
    ``initializer_range``) weight, zero bias).

    It is Hugging Face's own initialisation rather than a copy of it: the same class,
    ``from_pretrained`` and seed, with ``num_hidden_layers=0`` so that the decoder layers are
    neither built nor kept (the head is the only missing tensor either way, so the generator
    draws the same numbers); should a config refuse that, the whole model is loaded. The global
    random state is left as it was (``fork_rng``); Hugging Face's load report (the decoder layers
    as unexpected keys) is silenced."""
    from transformers import AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with torch.random.fork_rng(devices=[]):
            try:
                torch.manual_seed(seed)
                model = AutoModelForTokenClassification.from_pretrained(
                    path, num_labels=1, dtype=torch.float32, num_hidden_layers=0)
            except (ValueError, TypeError, KeyError, IndexError):  # a config that needs its layers
                torch.manual_seed(seed)
                model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1,
                                                                        dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    head = model.score
    return head.weight.detach().clone(), head.bias.detach().clone()


def _moe_without_transformer_engine() -> None:
    """megatron-core 0.16's router (``moe_utils.router_gating_linear``) tests
    ``te_general_gemm is not None``, a name its module binds only when TransformerEngine imports:
    without TE every MoE forward raises ``NameError``. Bind it to None there (megatron-core's own
    fallback, a plain ``torch.mm``, then runs); nothing changes where TE is installed."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def build_gpt_model(arch: HFArch, config, transformer_engine: bool = False, value_head: bool = False):
    """This pipeline stage's ``GPTModel`` (parallel state must be initialised) with the layer
    spec of :func:`layer_spec`, with rotary positions taken from ``position_ids`` (see
    :func:`_gpt_model_class`).

    ``value_head``: the critic's model: untied embeddings, and on the last stage a
    :class:`ValueHead` in place of the vocabulary output layer (megatron-core builds that layer
    first; it is dropped at once, as verl does)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if arch.is_moe:
        _moe_without_transformer_engine()
    offset = get_transformer_layer_offset(config)
    specs = []
    for i in range(offset, offset + get_num_layers_to_build(config)):
        moe = i in arch.moe_layers
        specs.append(layer_spec(transformer_engine, num_experts=arch.num_experts if moe else None,
                                grouped_gemm=bool(config.moe_grouped_gemm) and moe, qk_norm=arch.qk_norm))
    block = TransformerBlockSubmodules(layer_specs=specs, layer_norm=RMSNorm)
    tp = config.tensor_model_parallel_size
    model = _gpt_model_class()(
        config=config, transformer_layer_spec=block, vocab_size=arch.padded_vocab(tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True, share_embeddings_and_output_weights=arch.tied_embeddings and not value_head,
        position_embedding_type="rope", rotary_base=arch.rope_theta,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0)
    if value_head and model.post_process:
        model.output_layer = ValueHead(config)
    if arch.padding_idx is not None and model.pre_process:
        model.embedding.word_embeddings.register_forward_hook(_no_gradient_at_padding_idx(arch.padding_idx))
    return model


def _no_gradient_at_padding_idx(padding_idx: int):
    """A forward hook for megatron-core's ``VocabParallelEmbedding`` that gives the embedding of
    ``padding_idx`` no gradient from the input side, as the Hugging Face model's
    ``nn.Embedding(padding_idx=...)`` does (the row still learns through a tied output layer): without it a
    batch in which the pad token is also a real token trains that row differently from the FSDP2 trainer.
    The output is ``[b, s, h]``, or under sequence parallelism this rank's ``[s / tp, b, h]`` slice."""

    def hook(module, args, output):
        at_pad = args[0] == padding_idx  # [b, s]
        if getattr(module, "reduce_scatter_embeddings", False):
            rows = output.shape[0]
            start = module.tp_group.rank() * rows
            at_pad = at_pad.transpose(0, 1)[start:start + rows]
        return torch.where(at_pad[..., None], output.detach(), output)

    return hook

