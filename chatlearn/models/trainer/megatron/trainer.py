"""Megatron-core trainer: ``policy_trainer``, ``ref_policy`` and the PPO ``critic`` with tensor,
pipeline and data parallelism, interchangeable with the FSDP2 trainer (same config keys, batches,
log-probs, values, losses and metric names).

Ranks: ``world = tp * pp * dp`` in Megatron's default order (tensor-parallel ranks
adjacent); global rank 0 is tensor rank 0 of the first pipeline stage of data-parallel
replica 0.

Data: every rank receives the FULL batch (see ``chatlearn.models.base``); data-parallel
replica d works on its contiguous share of samples ``[d*N/dp, (d+1)*N/dp)``; all tensor and
pipeline ranks of a replica see the same samples. Results are all-reduced so that every
rank returns the same thing.

Loss: the loss of the FSDP trainer, aggregated over the whole global batch
(:class:`chatlearn.algorithms.grpo.GRPOLoss`)::

    per_token = policy_loss + kl_coef * KL(logp, ref_logp) - entropy_coef * H
    loss      = sum_{response tokens t of the global batch} c_{i(t)} * per_token_t

Each micro-batch returns ``T_global * sum(c * per_token)`` and its token count to Megatron's
schedule (``calculate_per_token_loss``); after the data-parallel gradient reduction Megatron
divides the gradients by the token count summed over replicas (T_global), so they are
exactly d(loss)/d(theta). The learning rate of each step is
:func:`chatlearn.algorithms.lr_schedule.learning_rate` of Adam's step count, set on the
optimizer's parameter groups (Megatron's own scheduler is not used). Log-probs and entropy are computed on the vocabulary-parallel logits
without gathering them (:mod:`.logprobs`).

Critic (``spec.role`` critic): the GPT model with a scalar value head in place of the vocabulary
output layer (:class:`.model.ValueHead`, replicated on the tensor-parallel ranks of the last
stage), the FSDP critic's model (``AutoModelForTokenClassification`` with one label): the backbone
from the ``load`` folder, a causal LM or a token-classification folder; the head from that folder's
``score`` when it has one, else initialised as the FSDP critic's (:func:`.model.initial_value_head`,
the same seed). Where the policy's passes take log-probs the critic's take values, the head on the
hidden state before each response token (:meth:`MegatronTrainer._token_values`), and its loss is
:class:`chatlearn.algorithms.value_loss.ValueLoss`; checkpoints record the role, and ``save_hf``
writes a ``*ForTokenClassification`` folder (``score.weight``, ``score.bias``).

Micro-batches: ``train_micro_batch_size`` (``logprob_micro_batch_size``) right-padded samples,
or with ``packing`` the first-fit-decreasing bins of the FSDP trainer
(:mod:`chatlearn.models.trainer.packing`), each one row of concatenated samples with position
ids restarting per sample (rotary angles follow them: :func:`.model.build_gpt_model`). With
the TransformerEngine layer spec (CUDA, :func:`.model.uses_transformer_engine`) a packed row
goes to TE's fused attention as ``thd`` ``PackedSeqParams`` (memory linear in the row width);
with the local spec (the CPU twin) as an explicit block-diagonal causal mask (quadratic). See
``_micro_batches``.

Megatron's schedules (``get_forward_backward_func``: 1F1B with pipeline parallelism, a plain
micro-batch loop without), its ``DistributedDataParallel`` wrapper (gradients in fp32
buffers) and its optimizer (Adam with decoupled weight decay on every parameter, gradient
clipping by the global norm, optionally the distributed optimizer) do the training.
megatron-core calls CUDA directly, so this trainer needs a GPU; with tensor parallelism the
worker must start with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (checked:
:func:`check_cuda_device_max_connections`).
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open

from chatlearn.algorithms.grpo import TOP1
from chatlearn.checkpoint import megatron_format as ckpt_format
from chatlearn.checkpoint import sharded
from chatlearn.checkpoint.megatron_mapping import (
    HFArch,
    Mapping,
    fuse_module_view,
    hf_shapes,
    local_shard,
    mappings,
    module_views,
    tied_output_mapping,
    to_hf,
    to_megatron,
)
from chatlearn.checkpoint.hf_files import value_head_config
from chatlearn.config.names import Part
from chatlearn.errors import UserError
from chatlearn.models.base import Batch, Trainer, response_positions, step_is_finite
from chatlearn.models.hf_folder import HFCheckpoint
from chatlearn.models.stash import release_device_memory
from chatlearn.models.trainer.fsdp import collective_timeout, init_distributed
from chatlearn.models.trainer.megatron import replay
from chatlearn.models.trainer.megatron.logprobs import vocab_parallel_logprobs, vocab_parallel_topk
from chatlearn.models.trainer.megatron.model import (
    MoEOptions,
    build_gpt_model,
    canonical_name,
    grouped_gemm_available,
    initial_value_head,
    thd_packed_seq_params,
    transformer_config,
    uses_transformer_engine,
)
from chatlearn.models.trainer.megatron.optimizer_state import (
    group_steps,
    param_step_device,
    restore_group_steps,
    step_count,
)
from chatlearn.models.trainer.packing import check_fixed_width, plan_micro_batches

if TYPE_CHECKING:
    from chatlearn.models.specs import TrainerSpec

_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json",
                    ".bin.index.json")


def _require_cuda() -> None:
    """megatron-core calls CUDA directly (current device, streams, its CUDA RNG tracker) in
    its forward/backward, DDP wrapper and schedules: fail early and clearly without it."""
    try:
        torch.cuda.current_device()
    except (AssertionError, RuntimeError) as err:
        raise RuntimeError(
            "the Megatron trainer needs a CUDA GPU (megatron-core calls CUDA directly); on a "
            f"machine without one use train_backend: fsdp ({err})") from err


def check_cuda_device_max_connections(device: torch.device, tp: int) -> None:
    """On CUDA with tensor parallelism (with or without sequence parallelism), require
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` in the environment.

    megatron-core (0.16, ``tensor_parallel/layers.py``) issues the tensor-parallel all-reduce /
    all-gather / reduce-scatter of a linear layer's backward asynchronously and relies on a
    single hardware queue to run them before the weight-gradient GEMM (it only warns when the
    variable differs). CUDA reads the variable once, when it starts, so it cannot be set from
    here: the worker's environment must carry it from process start
    (``chatlearn.runtime.cluster.worker_env.worker_env`` does for Megatron trainers)."""
    if device.type != "cuda" or tp <= 1:
        return
    value = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if value != "1":
        raise RuntimeError(
            f"the Megatron trainer with tensor_model_parallel_size {tp} needs the environment "
            f"variable CUDA_DEVICE_MAX_CONNECTIONS=1 set before CUDA starts (it is "
            f"{value!r}): start the worker with it in its environment")


def recompute_of(spec) -> str | None:
    """The activation recomputation of a trainer (``transformer_config``'s ``recompute``): none for a
    frozen model; ``recompute_granularity`` (full or selective) where set, else full where
    ``gradient_checkpointing``."""
    if not spec.trainable:
        return None
    return spec.recompute_granularity or ("full" if spec.gradient_checkpointing else None)


def _init_model_parallel(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> None:
    """megatron-core's parallel groups: tensor x pipeline x data for the attention (and dense
    MLPs), expert-tensor x expert x expert-data x pipeline for the experts (the same ranks,
    ``world = tp * dp * pp = etp * ep * edp * pp``); :func:`check_parallel_sizes` first."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():  # a second trainer in the same process
        have = (ps.get_tensor_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size(),
                ps.get_expert_model_parallel_world_size(),
                ps.get_expert_tensor_parallel_world_size())
        want = (tp, pp, ep, etp or tp)
        if have != want:
            raise ValueError(f"MegatronTrainer: this process already uses (tp, pp, ep, etp) = {have}, "
                             f"not {want}")
        return
    timeout = collective_timeout()  # its groups time out as the default group does
    minutes = {"distributed_timeout_minutes": math.ceil(timeout.total_seconds() / 60)} if timeout is not None else {}
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, **minutes)


def check_parallel_sizes(world: int, tp: int, pp: int, ep: int, etp: int | None, arch: HFArch | None,
                         key) -> None:
    """The parallel layout against the ranks and the model, before any group is made (one
    paragraph each; ``key(name)``: the config key of this model). Experts not divisible by
    ``expert_model_parallel_size`` is a config check of its own (``chatlearn.config.moe_keys``);
    it is repeated here for a direct caller."""
    if world % (tp * pp):
        raise UserError(f"{world} trainer ranks do not divide into tensor_model_parallel_size {tp} x "
                        f"pipeline_model_parallel_size {pp}: the data-parallel size would not be whole. Set the "
                        "sizes so that their product divides the trainer's devices.",
                        key=key("tensor_model_parallel_size"))
    moe = arch is not None and arch.is_moe
    if not moe:
        if ep != 1 or etp not in (None, tp):
            raise UserError(f"expert_model_parallel_size {ep} / expert_tensor_parallel_size {etp} apply to a "
                            "mixture-of-experts model, and this one has no experts. Leave them at 1 / null.",
                            key=key("expert_model_parallel_size"))
        return
    etp_ = etp or tp
    if ep < 1 or etp_ < 1:
        raise UserError(f"expert_model_parallel_size {ep} and expert_tensor_parallel_size {etp} must be >= 1.",
                        key=key("expert_model_parallel_size"))
    if world % (etp_ * ep * pp):
        raise UserError(
            f"{world} trainer ranks do not divide into expert_tensor_parallel_size {etp_} x expert_model_parallel_size "
            f"{ep} x pipeline_model_parallel_size {pp} (megatron-core lays the experts over the same ranks as the "
            f"attention: tp x dp x pp = etp x ep x expert-dp x pp). Choose expert_model_parallel_size (and "
            f"expert_tensor_parallel_size) so that their product with pipeline_model_parallel_size divides {world}.",
            key=key("expert_model_parallel_size"))
    if arch.num_experts % ep:
        raise UserError(f"the model's {arch.num_experts} experts do not divide over expert_model_parallel_size "
                        f"{ep}: each expert-parallel rank holds an equal share. Choose a divisor of "
                        f"{arch.num_experts}.", key=key("expert_model_parallel_size"))
    if arch.moe_ffn_hidden_size % etp_:
        raise UserError(f"expert_tensor_parallel_size {etp_} does not divide the experts' intermediate size "
                        f"{arch.moe_ffn_hidden_size} (moe_intermediate_size in config.json). Choose a divisor, or "
                        "1 (each expert whole on one rank).", key=key("expert_tensor_parallel_size"))


@dataclass
class _MicroBatch:
    ids: torch.Tensor  # int64 [rows, width]: right-padded samples, or one packed row
    positions: torch.Tensor  # int64 [rows, width]: rotary positions (restarting per packed sample)
    mask: torch.Tensor | None  # bool [1, 1, width, width], True = masked; None: causal
    packed: object | None  # thd PackedSeqParams of a packed row (TransformerEngine spec)
    rows: torch.Tensor  # [M] row of each response token in ids
    cols: torch.Tensor  # [M] its column (the logits that predict it are at cols - 1)
    pos: np.ndarray  # [M] its position in batch["tokens"]
    samples: np.ndarray  # indices of the samples in the batch (real rows only)
    routed: torch.Tensor | None = None  # int64 [rows, width, moe_layers, k]: the experts to replay, -1: none
    valid: torch.Tensor | None = None  # bool [rows, width]: a sample's token (not padding)


# megatron-core's names of the router losses in its aux-loss tracker -> the step's metrics
ROUTER_LOSSES = {"load_balancing_loss": "moe/aux_loss", "z_loss": "moe/z_loss"}


class MegatronTrainer(Trainer):
    """Megatron-core trainer of a Hugging Face Qwen2 / Llama checkpoint, or a Qwen3-MoE / Qwen2-MoE one with
    expert parallelism (docs/architecture.md, "The Megatron trainer on mixture-of-experts models") (``trainable``:
    policy_trainer; else ref_policy: frozen, no optimizer, forward only), or, with ``spec.role``
    critic, of the PPO critic (a value head in place of the LM head: see the module docstring)."""

    def __init__(self, spec: TrainerSpec):
        """``spec``: the trainer's settings, kept as ``self.spec`` and read as attributes: the FSDP
        trainer's fields (load, trust_remote_code, seed, trainable, lr, weight_decay, clip_grad,
        train_micro_batch_size, logprob_micro_batch_size, gradient_checkpointing, bf16, packing,
        max_token_in_packing, seq_length, logprob_chunk_tokens and the loss and learning-rate schedule
        fields) plus tensor_model_parallel_size, pipeline_model_parallel_size, sequence_parallel and
        use_distributed_optimizer; not share_prompt. bf16 applies on CUDA only (fp32 otherwise);
        gradient_checkpointing recomputes every layer (full recompute) unless recompute_granularity
        says otherwise (:func:`recompute_of`); trust_remote_code is
        not used (the architecture is read from config.json). ``role`` critic: the critic (and its
        cliprange_value and value_loss_coef)."""
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        self.spec = spec
        _require_cuda()
        self.tp = int(spec.tensor_model_parallel_size)
        self.pp = int(spec.pipeline_model_parallel_size)
        self.device = init_distributed()
        check_cuda_device_max_connections(self.device, self.tp)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.trainable = bool(spec.trainable)
        self.critic = spec.role == "critic"
        self.arch = HFArch.from_folder(spec.load)
        self.moe = self._moe_options() if self.arch.is_moe else None
        self.ep = self.moe.ep if self.moe else 1
        self.etp = (self.moe.etp or self.tp) if self.moe else self.tp
        check_parallel_sizes(self.world, self.tp, self.pp, self.ep, self.moe.etp if self.moe else None, self.arch,
                             self._config_key)
        _init_model_parallel(self.tp, self.pp, self.ep, self.moe.etp if self.moe else None)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.dp = self.dp_size = ps.get_data_parallel_world_size()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.etp_rank = ps.get_expert_tensor_parallel_rank()
        self.edp_rank = ps.get_expert_data_parallel_rank()
        self.etp_group = ps.get_expert_tensor_parallel_group()
        if self.rank == 0 and (self.tp_rank, self.pp_rank, self.dp_rank) != (0, 0, 0):
            raise RuntimeError("MegatronTrainer: global rank 0 must be tensor, pipeline and "
                               "data-parallel rank 0 (Megatron's default rank order)")
        seed = int(spec.seed)
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

        self.dtype = (torch.bfloat16 if spec.bf16 and self.device.type == "cuda"
                      else torch.float32)
        self.config = transformer_config(
            self.arch, tp=self.tp, pp=self.pp, sequence_parallel=bool(spec.sequence_parallel),
            params_dtype=self.dtype, cpu_init=self.device.type == "cpu",
            recompute=recompute_of(spec), moe=self.moe)
        local_vocab = self.arch.padded_vocab(self.tp) // self.tp
        self.vocab_start = self.tp_rank * local_vocab
        self.vocab_valid = max(0, min(local_vocab, self.arch.vocab_size - self.vocab_start))

        self.transformer_engine = uses_transformer_engine(self.device)
        self.gpt = build_gpt_model(self.arch, self.config, self.transformer_engine,
                                   value_head=self.critic).to(self.device)
        self._params = self._global_names()
        self.mappings = mappings(self.arch, value_head=self.critic)
        self._layer_stage = self._gather_layer_stages()
        self._coords = self._gather_coords()
        self._replays = (replay.install(self.gpt, self._recomputes_moe()) if self.moe and self.moe.replay else [])
        # this stage's MoE layers as indices among the model's MoE layers (the routed_experts column's order)
        self._stage_moe_slots = [self.arch.moe_layers.index(layer.layer_number - 1)
                                 for layer in self.gpt.decoder.layers
                                 if layer.layer_number - 1 in self.arch.moe_layers]
        self._moe_counts = self._count_routes() if self.arch.is_moe else None
        self._load_hf(spec.load)
        self.model, self.optimizer = self._wrap()
        self._stashes: dict = {}
        self._grads_freed = False
        self._routed: np.ndarray | None = None  # the pass's routed_experts (:meth:`_routed_column`)

    # ------------------------------------------------------------------ setup
    def _global_names(self) -> dict[str, torch.nn.Parameter]:
        """This stage's parameters by global Megatron name (global layer indices; the local
        layer spec's names, :func:`.model.canonical_name`)."""
        out = {}
        layers = self.gpt.decoder.layers
        local_experts = self.arch.num_experts // self.ep if self.arch.is_moe else 0
        for name, p in self.gpt.named_parameters():
            if name.startswith("decoder.layers."):
                local, rest = name[len("decoder.layers."):].split(".", 1)
                name = f"decoder.layers.{layers[int(local)].layer_number - 1}.{rest}"
            name = canonical_name(name)
            m = _LOCAL_EXPERT.search(name)
            if m:  # megatron-core's index among this expert-parallel rank's experts -> the global id
                expert = self.ep_rank * local_experts + int(m.group(1))
                name = f"{name[:m.start()]}.mlp.experts.local_experts.{expert}.{name[m.end():]}"
            out[name] = p
        return out

    def _moe_options(self) -> MoEOptions:
        """The MoE keys of this trainer's spec (``spec.moe``, ``spec.routing_replay``; docs/config.md,
        "Mixture of experts on the Megatron trainer"), with the
        checks only this backend can make (one paragraph each): the dispatcher's name,
        shared-expert overlap (megatron-core overlaps only with the alltoall dispatcher, and only a
        model with shared experts has anything to overlap), grouped GEMM (a CUDA kernel: on the CPU
        the experts run one after the other, with a warning), routing replay (the policy and the
        reference replay; the critic, a value model of its own, routes itself)."""
        spec, moe, key = self.spec, self.spec.moe, self._config_key
        dispatcher = str(moe.token_dispatcher_type)
        if dispatcher not in ("alltoall", "allgather"):
            raise UserError(f"{dispatcher!r} is not a token dispatcher of this trainer: choose alltoall or "
                            "allgather.", key=key("moe_token_dispatcher_type"))
        overlap = bool(moe.shared_expert_overlap)
        if overlap and dispatcher != "alltoall":
            raise UserError("moe_shared_expert_overlap computes the shared experts while the alltoall dispatcher "
                            "moves the tokens; megatron-core has no overlap with the allgather dispatcher. Set "
                            "moe_token_dispatcher_type: alltoall, or moe_shared_expert_overlap: false.",
                            key=key("moe_shared_expert_overlap"))
        if overlap and not self.arch.shared_expert_ffn_hidden_size:
            warnings.warn(f"{key('moe_shared_expert_overlap')}: the model ({self.arch.model_type}) has no shared "
                          "experts, so there is nothing to overlap; the key has no effect.", stacklevel=2)
        grouped = bool(moe.groupgemm)
        if grouped:
            ok, why = grouped_gemm_available(self.device)
            if not ok:
                warnings.warn(f"{key('groupgemm')}: not used here: {why}. The experts run as one GEMM each "
                              "(megatron-core's SequentialMLP; the same weights, checkpoints and results).",
                              stacklevel=2)
                grouped = False
        if bool(moe.layer_recompute) and recompute_of(spec) == "full":
            warnings.warn(f"{key('moe_layer_recompute')}: every layer is already recomputed whole (full "
                          "recomputation), the MoE layers with them.", stacklevel=2)
        etp = moe.expert_tensor_parallel_size
        return MoEOptions(
            ep=int(moe.expert_model_parallel_size), etp=None if etp is None else int(etp), dispatcher=dispatcher,
            aux_loss_coeff=None if moe.aux_loss_coeff is None else float(moe.aux_loss_coeff),
            z_loss_coeff=float(moe.z_loss_coeff), force_load_balancing=bool(moe.force_load_balancing),
            layer_recompute=bool(moe.layer_recompute), shared_expert_overlap=overlap,
            grouped_gemm=grouped, replay=spec.routing_replay == "rollout" and not self.critic)

    def _count_routes(self) -> torch.Tensor:
        """``[moe_layers, experts]`` float64 counts of the top-k choices of the training pass's real
        tokens (padding left out), filled by a forward hook on this stage's routers while
        ``self._counting`` (each router's output ``(probs, routing_map [tokens, experts])``); the
        step's ``moe/load_imbalance``."""
        counts = torch.zeros(len(self.arch.moe_layers), self.arch.num_experts, dtype=torch.float64)
        self._counting, self._valid_tokens = False, None
        slots = iter(self._stage_moe_slots)
        for layer in self.gpt.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is None:
                continue
            slot = next(slots)

            def hook(module, inputs, output, slot=slot):
                # once per forward: not again in a recomputation (a full or MoE-layer recompute runs the
                # first forward without autograd, the recomputation with it)
                if not self._counting or torch.is_grad_enabled() == self._recomputes_moe():
                    return
                routing_map = output[1]
                valid = self._valid_tokens
                if valid is not None and valid.numel() == routing_map.shape[0]:
                    routing_map = routing_map[valid]
                counts[slot] += routing_map.sum(dim=0).to("cpu", torch.float64)

            router.register_forward_hook(hook)
        return counts

    def compute_grads(self, batch: Batch, temperature: float = 1.0) -> dict:
        """:meth:`Trainer.compute_grads`; on a MoE model also ``moe/load_imbalance`` (per MoE layer the
        most top-k choices any expert got over the mean, over the step's real tokens on every rank, then
        the mean over layers: the FSDP trainer's definition) and, with routing replay, ``moe/routing_agreement``
        (the share of the recorded top-k choices that the routers made themselves in the training forward)."""
        if self._moe_counts is None:
            return super().compute_grads(batch, temperature)
        from megatron.core.transformer.moe import moe_utils

        self._moe_counts.zero_()
        moe_utils.clear_aux_losses_tracker()
        for r in self._replays:
            r.agree, r.slots, r.count = 0.0, 0.0, True
        self._counting = True
        try:
            metrics = super().compute_grads(batch, temperature)
        finally:
            self._counting = False
            for r in self._replays:
                r.count = False
        agree = [sum(r.agree for r in self._replays), sum(r.slots for r in self._replays)]
        sums = torch.cat([self._moe_counts.reshape(-1), torch.tensor(agree, dtype=torch.float64)]).to(self.device)
        dist.all_reduce(sums)  # tensor-parallel copies (without sequence parallelism) scale a layer's row evenly
        sums = sums.cpu()
        counts = sums[:-2].reshape(self._moe_counts.shape)
        rows = [c for c in counts if float(c.sum()) > 0]
        metrics["moe/load_imbalance"] = (sum(float(c.max() / c.mean()) for c in rows) / len(rows)) if rows else 0.0
        if self.moe.replay and "routed_experts" in batch:
            metrics["moe/routing_agreement"] = float(sums[-2] / sums[-1]) if float(sums[-1]) else 1.0
        metrics.update(self._router_losses(int(metrics["micro_steps"])))
        return metrics

    def _router_losses(self, micro_steps: int) -> dict:
        """``moe/aux_loss`` and ``moe/z_loss`` of the training pass, from megatron-core's aux-loss tracker
        (``moe_utils``: each router adds its loss without the coefficient, per layer and micro-step, in training
        forwards only, once also under recomputation), reduced as megatron-core's own logging reduces it (summed
        over pipeline stages and the router's group, averaged over data-parallel replicas; a collective), then the
        mean over the MoE layers and micro-steps: the FSDP trainer's definition, but over every token a micro-step
        computes (megatron-core's loss counts padding too). Each only where its coefficient is set (megatron-core
        computes neither otherwise)."""
        from megatron.core.transformer.moe import moe_utils

        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        names = [n for n in ROUTER_LOSSES if n in tracker]  # the same on every rank: the same config
        if not names:
            return {}
        moe_utils.reduce_aux_losses_tracker_across_ranks(names)
        layers = torch.tensor(self.arch.moe_layers, dtype=torch.long)
        out = {ROUTER_LOSSES[n]: float(tracker[n]["values"].cpu()[layers].mean()) / max(micro_steps, 1)
               for n in names}
        moe_utils.clear_aux_losses_tracker()
        return out

    def _recomputes_moe(self) -> bool:
        """Whether an MoE layer's forward runs again in backward (full recomputation, or
        ``moe_layer_recompute``): routing replay then replays it too."""
        return self.trainable and (recompute_of(self.spec) == "full" or bool(self.config.moe_layer_recompute))

    def _gather_coords(self) -> list[dict]:
        """Every rank's place in the parallel layout (on every rank; a collective): the
        checkpoint's metadata records it for ``chatlearn merge``, the export finds an expert's
        holder with it."""
        mine = {"tp": self.tp_rank, "pp": self.pp_rank, "dp": self.dp_rank, "ep": self.ep_rank,
                "etp": self.etp_rank, "edp": self.edp_rank}
        out = [None] * self.world
        dist.all_gather_object(out, mine)
        return out

    def _gather_layer_stages(self) -> dict[int, int]:
        """Global layer index -> pipeline stage that holds it (known on every rank)."""
        mine = [layer.layer_number - 1 for layer in self.gpt.decoder.layers]
        stages = [None] * self.pp
        dist.all_gather_object(stages, mine, group=self.pp_group)
        return {layer: stage for stage, layers in enumerate(stages) for layer in layers}

    def _owner(self, m: Mapping) -> int:
        if m.layer is not None:
            return self._layer_stage[m.layer]
        return 0 if m.first_stage else self.pp - 1

    @torch.no_grad()
    def _load_hf(self, path: str) -> None:
        """Copy this rank's shard of every parameter from the Hugging Face checkpoint (the
        critic's new value head: :meth:`_new_value_head`; a collective for the critic)."""
        ckpt = HFCheckpoint(path)
        new = self._new_value_head(ckpt) if self.critic else {}
        todo = [m for m in self.mappings if m.megatron in self._params]
        if "output_layer.weight" in self._params and self.arch.tied_embeddings and not self.critic:
            todo.append(tied_output_mapping())  # last stage's copy of the tied embeddings
        for m in todo:
            size, rank = self._split(m)
            full = to_megatron(self.arch, m, [new[n] if n in new else ckpt.get(n) for n in m.hf], size)
            param = self._params[m.megatron]
            shard = local_shard(full, m, size, rank)
            if shard.shape != param.shape:
                raise ValueError(f"{path}: {m.hf} give a {tuple(shard.shape)} shard for "
                                 f"{m.megatron}, which is {tuple(param.shape)}")
            param.copy_(shard)
        missing = set(self._params) - {m.megatron for m in todo}
        if missing:
            raise ValueError(f"MegatronTrainer: no checkpoint mapping for {sorted(missing)}")

    def _new_value_head(self, ckpt: HFCheckpoint) -> dict[str, torch.Tensor]:
        """The critic's value head where the ``load`` folder has none (a causal LM's folder):
        ``{"score.weight", "score.bias"}``, float32 on the CPU, as the FSDP critic initialises it
        (:func:`.model.initial_value_head`, with ``seed``); {} when the folder has a ``score`` of
        one output (a token-classification folder: loaded as is), a UserError naming ``load`` when
        its ``score`` has more. Rank 0 builds the head and broadcasts it (a collective, every rank
        calls it), so that one process, not every one, loads the Hugging Face model."""
        if ckpt.has("score.weight"):
            rows = ckpt.get("score.weight").shape[0]
            if rows != 1:
                raise UserError(f"{self.spec.load}: the value head (score) has {rows} outputs, not 1: the "
                                "critic's folder must be a causal LM or a token-classification model with "
                                "one label.", key=self._config_key("load"))
            return {}
        h = self.arch.hidden_size
        flat = torch.zeros(h + 1, dtype=torch.float32, device=self.device)
        if self.rank == 0:
            weight, bias = initial_value_head(self.spec.load, int(self.spec.seed))
            flat.copy_(torch.cat([weight.reshape(-1), bias.reshape(-1)]))
        dist.broadcast(flat, src=0)
        flat = flat.cpu()
        return {"score.weight": flat[:h].reshape(1, h), "score.bias": flat[h:]}

    def _wrap(self):
        """Trainable: Megatron's DDP wrapper and optimizer. Frozen: the bare model."""
        if not self.trainable:
            self.gpt.requires_grad_(False)
            return self.gpt, None
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        spec, distributed = self.spec, bool(self.spec.use_distributed_optimizer)
        ddp = DistributedDataParallel(
            config=self.config, module=self.gpt,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=distributed))
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=float(spec.lr),
                            weight_decay=float(spec.weight_decay),
                            adam_beta1=float(spec.adam_beta1), adam_beta2=float(spec.adam_beta2),
                            adam_eps=float(spec.adam_eps),
                            clip_grad=float(spec.clip_grad),  # <= 0: no clipping
                            bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
                            use_distributed_optimizer=distributed),
            [ddp],
            config_overrides={})  # weight decay on every parameter, as the FSDP trainer
        self.config.no_sync_func = ddp.no_sync
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = optimizer.scale_loss
        return ddp, optimizer

    # ------------------------------------------------------------------ batches
    def _micro_batches(self, batch: Batch, size: int) -> tuple[list[_MicroBatch], dict]:
        """This replica's micro-batches and the pass's stats: ``pad_token_frac`` (padding
        positions / positions computed, over all replicas' real micro-steps; a collective)
        and ``micro_steps`` (per replica).

        Without packing: ``size`` samples each, in order, right-padded (position ids
        ``0 .. width-1``, Megatron's causal mask). With packing: the first-fit-decreasing
        bins of :func:`chatlearn.models.trainer.packing.plan_micro_batches`, one row each
        (:meth:`_build_micro_batch`). Every rank computes every replica's plan (no collective)
        and runs ``max over replicas`` micro-steps, the missing ones as dummy micro-steps (no
        response token: loss 0, zero gradients). Shapes: :meth:`_micro_batch_shape`.
        """
        idx = self._my_samples(batch)
        if len(idx) == 0:
            raise ValueError("MegatronTrainer: the batch has no samples")
        self._routed = self._routed_column(batch)
        all_lens = np.diff(batch["offsets"])
        lens = all_lens[idx]
        fixed = (None if self.spec.packing or self.spec.seq_length is None
                 else check_fixed_width(all_lens, int(self.spec.seq_length)))
        size = min(size, len(idx))
        plan, longest = self._plan_micro_batches(all_lens, idx, size)
        out, computed = [], 0
        for mb in plan:
            nrows, width = self._micro_batch_shape(all_lens[mb], all_lens if self._same_shape_over_replicas()
                                                   else lens, size, longest, fixed)
            out.append(self._build_micro_batch(batch, mb, all_lens[mb], nrows, width))
            if len(mb):
                computed += nrows * width
        return out, self._pass_stats(lens, computed, len(out))

    def _routed_column(self, batch: Batch) -> np.ndarray | None:
        """The batch's ``routed_experts`` as int64 ``[tokens, moe_layers, k]`` where this trainer
        replays them (:mod:`.replay`), else None: replay off, the critic, or a batch without the column
        (the weight push's landing probe; a rollout that records none is refused by the driver at its
        first generate), whose tokens route themselves. A column of another shape is refused in one
        paragraph."""
        if not (self.moe and self.moe.replay) or "routed_experts" not in batch:
            return None
        key = "models.policy_trainer.routing_replay"
        layers, k = len(self.arch.moe_layers), self.arch.moe_topk
        col = np.asarray(batch["routed_experts"])
        total = int(batch["offsets"][-1])
        if col.shape[0] != total or col.size != total * layers * k:
            raise UserError(f"the batch's routed_experts column has shape {list(col.shape)}, not [{total} tokens, "
                            f"{layers} MoE layers, top-{k}] of this model ({self.spec.load}): it was recorded with "
                            "another model. Roll out with the model this trainer loads.", key=key)
        return replay.decode_column(col, layers, k)

    def _plan_micro_batches(self, all_lens: np.ndarray, idx: np.ndarray, size: int
                            ) -> tuple[list[np.ndarray], int | None]:
        """``(sample indices of each micro-batch, tokens of the longest bin or None)``: without
        packing, ``idx`` cut into runs of ``size``; with packing, this replica's plan of
        :func:`chatlearn.models.trainer.packing.plan_micro_batches` (bins of at most
        ``max_token_in_packing`` tokens; ``size`` is ignored; empty bins are dummy micro-steps)."""
        if not self.spec.packing:
            return [idx[start:start + size] for start in range(0, len(idx), size)], None
        share = len(idx)
        shares = [np.arange(d * share, (d + 1) * share) for d in range(self.dp)]
        plans, _ = plan_micro_batches(all_lens, shares, size, True,
                                      int(self.spec.max_token_in_packing))
        plan = plans[self.dp_rank]
        mine = plans if self._same_shape_over_replicas() else [plan]
        return plan, max(int(all_lens[mb].sum()) for p in mine for mb in p if len(mb))

    def _same_shape_over_replicas(self) -> bool:
        """Whether every micro-batch of every data-parallel replica has one shape: megatron-core's
        allgather token dispatcher all-gathers the tokens over the tensor x expert-parallel ranks,
        which hold different replicas' samples when ``expert_model_parallel_size`` > 1 (the alltoall
        dispatcher takes any number of tokens per rank)."""
        return bool(self.moe) and self.moe.dispatcher == "allgather" and self.ep > 1

    def _micro_batch_shape(self, mb_lens: np.ndarray, lens: np.ndarray, size: int,
                           longest: int | None, fixed: int | None) -> tuple[int, int]:
        """``(rows, width)`` of a micro-batch of samples of lengths ``mb_lens`` (``lens``: all
        of this replica's samples; ``longest``: its longest packed bin; ``fixed``:
        ``seq_length`` without packing, or None).

        With pipeline parallelism every micro-batch has the same shape, as the stages exchange
        activations of a fixed shape: padded, ``size`` rows of the replica's longest sample;
        packed, one row of its longest bin (the padding is a segment of its own that nothing
        else attends to, and counts as padding). Without, a padded micro-batch is as wide as
        its longest sample and a packed row is exactly its bin (a dummy row is one token).
        With ``fixed`` every micro-batch is exactly that wide (Megatron's fixed sequence
        length). Under sequence parallelism every width is a multiple of ``tp`` (rounded up
        with padding; a ``seq_length`` must already be one). With the allgather token dispatcher
        over several expert-parallel ranks every replica's micro-batches have one shape too
        (:meth:`_same_shape_over_replicas`: ``lens`` and ``longest`` are then over all replicas).
        """
        uniform = self.pp > 1 or self._same_shape_over_replicas()
        if self.spec.packing:
            width = longest if uniform else max(int(mb_lens.sum()), 1)
            nrows = 1
        else:
            width = fixed or int(lens.max() if uniform else mb_lens.max())
            nrows = size if uniform else len(mb_lens)
        multiple = self.tp if self.config.sequence_parallel else 1
        return nrows, -(-width // multiple) * multiple

    def _build_micro_batch(self, batch: Batch, mb: np.ndarray, mb_lens: np.ndarray, nrows: int,
                           width: int) -> _MicroBatch:
        """The tensors of micro-batch ``mb`` (sample indices, of lengths ``mb_lens``) on this
        rank's device: the samples right-padded in ``nrows`` rows of ``width``, or with packing
        concatenated in one row, position ids restarting at 0 for each sample (the padding after
        them counts on from 0), with the sample boundaries of :meth:`_packed_attention`."""
        off = batch["offsets"]
        packing = bool(self.spec.packing)
        ids = torch.zeros(nrows, width, dtype=torch.long)
        positions = torch.arange(width).repeat(nrows, 1)
        segment = torch.full((width,), -1, dtype=torch.long)  # -1: padding
        rows, cols, pos = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        routed = (None if getattr(self, "_routed", None) is None else
                  torch.full((nrows, width, *self._routed.shape[1:]), -1, dtype=torch.long))
        valid = torch.zeros(nrows, width, dtype=torch.bool)
        start = 0
        for b, (i, n) in enumerate(zip(mb, mb_lens)):
            n = int(n)
            row, col = (0, start) if packing else (b, 0)
            ids[row, col:col + n] = torch.as_tensor(np.array(batch["tokens"][off[i]:off[i + 1]]))  # copy: Ray arrays are read-only
            if packing:
                positions[0, col:col + n] = torch.arange(n)
                segment[col:col + n] = b
                start += n
            valid[row, col:col + n] = True
            if routed is not None:
                routed[row, col:col + n] = torch.from_numpy(self._routed[off[i]:off[i + 1]])
            resp = response_positions(batch, i)  # the model's tokens (not a multi-turn observation)
            rows.append(np.full(len(resp), row))
            cols.append(col + resp)
            pos.append(int(off[i]) + resp)
        mask = packed = None
        if packing and len(mb):
            positions[0, start:] = torch.arange(width - start)
            mask, packed = self._packed_attention(mb_lens, segment, width)
        return _MicroBatch(
            ids=ids.to(self.device), positions=positions.to(self.device),
            mask=mask, packed=packed,
            rows=torch.from_numpy(np.concatenate(rows)).to(self.device),
            cols=torch.from_numpy(np.concatenate(cols)).to(self.device),
            pos=np.concatenate(pos), samples=mb,
            routed=None if routed is None else routed.to(self.device), valid=valid.to(self.device))

    def _packed_attention(self, mb_lens: np.ndarray, segment: torch.Tensor, width: int):
        """``(mask, packed)`` confining attention to each sample of a packed row (``segment``:
        the sample of each position, -1 for padding): with the TransformerEngine spec ``thd``
        ``PackedSeqParams`` (:func:`.model.thd_packed_seq_params`, no mask), else an explicit
        block-diagonal causal mask (``mask[0, 0, q, k]`` True = masked: k after q, or k in
        another sample)."""
        if self.transformer_engine:
            return None, thd_packed_seq_params(mb_lens, width, self.device)
        segment = segment.to(self.device)
        q = torch.arange(width, device=self.device)
        mask = ((q[None, :] > q[:, None])  # [q, k]: k after q
                | (segment[:, None] != segment[None, :]))[None, None]
        return mask, None

    def _pass_stats(self, lens: np.ndarray, computed: int, steps: int) -> dict:
        """``pad_token_frac`` over all replicas (a collective: ``lens``, this replica's sample
        lengths; ``computed``, the positions its real micro-steps compute) and ``micro_steps``."""
        # every rank counts its replica's tokens: the world sums are tp*pp times the
        # replicas' sums, which leaves their ratio unchanged
        counts = torch.tensor([float(lens.sum()), float(computed)],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)
        real, computed = counts.tolist()
        return {"pad_token_frac": 1.0 - real / computed, "micro_steps": float(steps)}

    def _token_logprobs(self, mb: _MicroBatch, logits: torch.Tensor, temperature: float,
                        with_entropy: bool):
        """logits [rows, width, V/tp] (this rank's vocabulary slice) -> float32 log-probs
        (and entropy) of the response tokens of ``mb``, in order, ``logprob_chunk_tokens``
        tokens at a time (no float32 ``[tokens, V/tp]`` tensor beyond one chunk). The critic's
        model gives values instead (:meth:`_token_values`)."""
        if self.critic:
            return self._token_values(mb, logits)
        z = logits[mb.rows, mb.cols - 1, :self.vocab_valid]  # the model's dtype
        target = mb.ids[mb.rows, mb.cols]
        logp, ent = vocab_parallel_logprobs(z, target, self.vocab_start, self.tp_group, with_entropy is True,
                                            temperature=temperature,
                                            chunk_tokens=int(self.spec.logprob_chunk_tokens))
        if with_entropy == TOP1:  # a teacher's agreement with the sampled token: the argmax over every rank's slice
            _, ids = vocab_parallel_topk(z, 1, self.vocab_start, self.tp_group)
            return logp, (ids[:, 0] == target).float()
        return logp, ent

    def _token_values(self, mb: _MicroBatch, values: torch.Tensor):
        """``(values, None)``: the critic's float32 values of the response tokens of ``mb``, in
        order, from the value head's output ``[rows, width, 1]`` (the same on every tensor-parallel
        rank): the value of token ``[rows, cols]`` is the head on the hidden state before it,
        ``values[rows, cols - 1]``, as the FSDP critic's (``fsdp._token_values``)."""
        return values[mb.rows, mb.cols - 1, 0].float(), None

    def _run(self, micro_batches: list[_MicroBatch], loss_func, forward_only: bool) -> list:
        """Megatron's forward(-backward) schedule over ``micro_batches``; returns what
        ``loss_func`` reported for each (on the last pipeline stage; [] elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        replay.begin(self._replays, on=micro_batches[0].routed is not None)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            if mb.routed is not None and self._replays:
                targets = replay.layer_targets(mb.routed, self._stage_moe_slots, self.tp, self.tp_rank,
                                               bool(self.config.sequence_parallel))
                for r, t in zip(self._replays, targets):
                    r.set_target_indices(t)
            if self._moe_counts is not None:  # the real tokens in the routers' order ([s, b], this rank's slice)
                valid = mb.valid.t()
                if self.config.sequence_parallel and self.tp > 1:
                    valid = valid.chunk(self.tp, dim=0)[self.tp_rank]
                self._valid_tokens = valid.reshape(-1)
            logits = model(input_ids=mb.ids, position_ids=mb.positions, attention_mask=mb.mask,
                           packed_seq_params=mb.packed)
            return logits, partial(loss_func, mb)

        first = micro_batches[0]
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches),
            model=[self.model], num_microbatches=len(micro_batches),
            seq_length=first.ids.shape[1], micro_batch_size=first.ids.shape[0],
            forward_only=forward_only)

    def _reporter(self) -> bool:
        """The one rank per replica whose results count (last stage, tensor rank 0)."""
        return self.is_last_stage and self.tp_rank == 0

    # ------------------------------------------------------------------ log-probs
    def _logprob_pass(self, batch: Batch, micro_batches: list[_MicroBatch], temperature: float,
                      with_entropy: bool):
        """Megatron's forward-only schedule over ``micro_batches``; the reporting rank of each
        replica (:meth:`_reporter`) puts its values at their token positions, and one all-reduce
        gives every rank all of them."""
        def loss_func(mb, logits):
            if not len(mb.pos):  # a dummy micro-step
                none = logits.new_zeros(0, dtype=torch.float32)
                return logits.new_zeros(()), torch.tensor(0, dtype=torch.int, device=self.device), \
                    {"logp": none, "entropy": none}
            logp, ent = self._token_logprobs(mb, logits, temperature, with_entropy)
            count = torch.tensor(len(logp), dtype=torch.int, device=self.device)
            return logp.new_zeros(()), count, {"logp": logp, "entropy": ent}

        outs = self._run(micro_batches, loss_func, forward_only=True)
        total = int(batch["offsets"][-1])
        values = torch.zeros(2 if with_entropy else 1, total, dtype=torch.float32,
                             device=self.device)
        if self._reporter():
            for mb, out in zip(micro_batches, outs):
                pos = torch.from_numpy(mb.pos).to(self.device)
                values[0, pos] = out["logp"]
                if with_entropy:
                    values[1, pos] = out["entropy"]
        dist.all_reduce(values)  # one rank contributes each token; the others add zeros
        values = values.cpu().numpy()
        return (values[0], values[1]) if with_entropy else values[0]

    # ------------------------------------------------------------------ training
    def _accumulate_grads(self, batch: Batch, objective, temperature: float) -> tuple:
        """Megatron's forward-backward schedule (1F1B with pipeline parallelism); the gradients
        are left in Megatron's fp32 gradient buffers (freed ones are re-allocated first),
        reduced over replicas and divided by the global token count. The sums are the
        reporting ranks' (:meth:`_reporter`), zeros elsewhere."""
        self._restore_grads()

        def loss_func(mb, logits):
            if not len(mb.pos):  # a dummy micro-step: an empty sum (0, zero gradients)
                return (logits[:, :0].sum(), torch.tensor(0, dtype=torch.int, device=self.device),
                        {"sums": torch.zeros(len(objective.SUMS), dtype=torch.float64,
                                             device=self.device)})
            logp, ent = self._token_logprobs(mb, logits, temperature, objective.with_entropy)
            terms, coef, weight = objective.terms(logp, ent, mb.pos)
            count = torch.tensor(len(logp), dtype=torch.int, device=self.device)
            # Megatron divides by the global token count: scale the aggregate back up by it
            loss = (terms["loss"] * coef).sum() * objective.num_tokens
            return loss, count, {"sums": objective.token_sums(terms, coef, weight, ent)}

        micro, passes = self._micro_batches(batch, self.spec.train_micro_batch_size)
        outs = self._run(micro, loss_func, forward_only=False)
        sums = torch.zeros(len(objective.SUMS), dtype=torch.float64, device=self.device)
        if self._reporter():
            for out in outs:
                sums += out["sums"]
        return sums, passes

    def _optimizer_steps(self) -> int:
        """Optimizer steps taken so far: Adam's step count, wherever the optimizer in use keeps
        it (:func:`.optimizer_state.step_count`: per parameter group for TE's / Apex's
        FusedAdam, per parameter for torch's Adam), the largest over all ranks (a collective;
        the count is restored with the checkpoint, so the learning-rate schedule continues
        where it was on resume)."""
        steps = max([step_count(opt.optimizer) for opt in self._optimizers()] or [0])
        found = torch.tensor(float(steps), dtype=torch.float64, device=self.device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return int(found.item())

    def _set_lr(self, lr: float) -> None:
        for opt in self._optimizers():
            for group in opt.optimizer.param_groups:
                group["lr"] = lr

    @torch.no_grad()
    def _clip_and_step(self, loss: float) -> tuple[bool, float]:
        """``(stepped, grad norm)``: Megatron's ``optimizer.step()`` (megatron-core
        ``ChainedOptimizer.step``: prepare the main gradients, their global norm over the
        model-parallel ranks, clip by it, step) with the decision of
        :func:`chatlearn.models.base.step_is_finite` between the norm and the update. The loss
        is all-reduced and the norm is the same on every rank (data-parallel replicas hold the
        same reduced gradients), so every rank decides alike."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        if self.optimizer.prepare_grads():  # a loss scaler found inf/nan: Megatron's own skip
            return False, float("nan")
        norm = float(self.optimizer.get_grad_norm())
        if not step_is_finite(loss, norm):
            return False, norm
        for opt in self._optimizers():
            if getattr(opt, "is_stub_optimizer", False):
                continue
            params = opt.get_parameters()
            if not params or opt.config.clip_grad <= 0:
                continue
            clip_grad_by_total_norm_fp32(
                params, max_norm=opt.config.clip_grad, total_norm=norm,
                use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        return bool(self.optimizer.step_with_ready_grads()), norm

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Gradients by Hugging Face module name (:meth:`_module_views`), unsharded, on the CPU: complete on rank 0, empty
        on the others (a collective; for tests). Not available with the distributed
        optimizer, which keeps only each replica's reduced shard of the gradients."""
        if not self.trainable:
            raise RuntimeError("MegatronTrainer: this model is not trainable (ref_policy)")
        if self.spec.use_distributed_optimizer:
            raise NotImplementedError("MegatronTrainer.full_grads: gradients are "
                                      "reduce-scattered under the distributed optimizer")
        return {name: t for name, t in self._gather_views("grads", None, host=True) if t is not None}

    def zero_grad(self) -> None:
        """Zero Megatron's gradient buffers and the optimizer's gradients (nothing to do for a
        frozen model, or while the buffers are freed)."""
        if self.optimizer is not None and not self._grads_freed:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()

    # ------------------------------------------------------------------ residency
    def _grad_buffers(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [b.grad_data for b in self.model.buffers + self.model.expert_parallel_buffers]

    def _optimizers(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _optimizer_params(self, with_groups: bool = False) -> Iterator[tuple]:
        """``(key, param, state)`` for every parameter of every inner torch optimizer, in a
        fixed order (``key`` = "<optimizer>.<index>"); ``with_groups``: ``(key, param, state,
        param_group)``."""
        for i, opt in enumerate(self._optimizers()):
            inner = opt.optimizer
            params = [(p, group) for group in inner.param_groups for p in group["params"]]
            for j, (p, group) in enumerate(params):
                yield (f"{i}.{j}", p, inner.state) + ((group,) if with_groups else ())

    def _part_tensors(self, part: str) -> list[torch.Tensor]:
        """``weights``: the model parameters (in DDP's parameter buffers when the distributed
        optimizer is used). ``optimizer``: Adam's moments, and the fp32 main parameters of a
        mixed-precision optimizer (those that are not the model's own storage)."""
        weights = list(self.gpt.parameters())
        if part == Part.WEIGHTS:
            return weights
        if self.optimizer is None:
            return []
        # storages by address (a freed storage's is 0, like that of every view of it)
        weight_storages = {w.untyped_storage().data_ptr() for w in weights}
        out = []
        for _, p, state in self._optimizer_params():
            out += [v for k, v in (state[p] if p in state else {}).items() if k != "step" and torch.is_tensor(v)]
            if p.untyped_storage().data_ptr() not in weight_storages:
                out.append(p)
        return out

    def _free_grads(self) -> None:
        """Drop the gradients: free the storage of Megatron's gradient buffers."""
        if not self._grads_freed:
            self.zero_grad()
            for buf in self._grad_buffers():
                buf.untyped_storage().resize_(0)
            self._grads_freed = True

    def _restore_grads(self) -> None:
        """Re-allocate freed gradient buffers (zeros); the views into them stay valid."""
        if self._grads_freed:
            for buf in self._grad_buffers():
                buf.untyped_storage().resize_(buf.numel() * buf.element_size())
                buf.zero_()
            self._grads_freed = False

    def offload(self, parts: Iterable[str]) -> dict:
        """Free the device storage of ``weights`` and ``optimizer`` (Adam moments, fp32 main
        parameters), keeping a host copy; ``grads`` are dropped (their buffers freed; they
        come back as zeros). Parts already offloaded are skipped. Returns {"bytes": bytes
        copied to the host}."""
        parts = self._check_parts(parts)
        if Part.GRADS in parts:
            self._free_grads()
        moved = self._stash_parts(parts)
        release_device_memory(self.device)
        return {"bytes": moved}

    def onload(self, parts: Iterable[str]) -> dict:
        """Restore offloaded parts bit for bit (gradients as zeros). Returns {"bytes": bytes
        copied back}."""
        parts = self._check_parts(parts)
        if Part.GRADS in parts:
            self._restore_grads()
        return {"bytes": self._unstash_parts(parts)}

    # ------------------------------------------------------------------ checkpoints
    def _layout(self) -> dict:
        """The layout a checkpoint records and must be resumed with (a MoE model's: its expert-parallel
        sizes and expert count too)."""
        out = {"world_size": self.world, "tensor_model_parallel_size": self.tp,
               "pipeline_model_parallel_size": self.pp,
               "use_distributed_optimizer": bool(self.spec.use_distributed_optimizer),
               "dtype": sharded.dtype_name(self.dtype)}
        if self.arch.is_moe:
            out.update({"expert_model_parallel_size": self.ep, "expert_tensor_parallel_size": self.etp,
                        "num_experts": self.arch.num_experts})
        return out

    def save_checkpoint(self, path: str) -> None:
        """Write this rank's parameter shards, optimizer state and RNG states, and (rank 0)
        the metadata into the folder ``path`` (see :mod:`.checkpoint`).

        A collective: every rank calls it with the same path, on a file system all ranks
        share. Rank 0 writes the ``.complete`` marker last, once every rank has finished.
        Weights and optimizer must be onloaded.
        """
        from megatron.core import tensor_parallel
        from safetensors.torch import save_file

        self._require_onloaded("save_checkpoint")
        rng = sharded.capture_rng_state(self.device)  # before anything that could draw
        if self.trainable:
            self._require_finite_weights(self.gpt.parameters(), path)
        os.makedirs(path, exist_ok=True)
        if self.rank == 0:
            sharded.clear_complete(path)
        tensors = {f"model.{name}": p for name, p in self._params.items()}
        if self.optimizer is not None:
            weight_storages = {p.untyped_storage().data_ptr() for p in self.gpt.parameters()}
            for key, p, state in self._optimizer_params():
                for name, value in (state[p] if p in state else {}).items():
                    tensors[f"optimizer.{key}.{name}"] = torch.as_tensor(value)
                if p.untyped_storage().data_ptr() not in weight_storages:
                    tensors[f"main.{key}"] = p
            for i, opt in enumerate(self._optimizers()):
                for g, step in group_steps(opt.optimizer).items():
                    tensors[f"optimizer_group.{i}.{g}.step"] = step
        for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
            tensors[f"rng_tracker.{name}"] = state
        # copies: safetensors refuses tensors that share memory (views into DDP's buffers)
        save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()},
                  ckpt_format.rank_file(path, self.rank))
        sharded.save_rng_state(path, self.rank, rng)
        stepped = torch.tensor(float(any(k.startswith(("optimizer.", "optimizer_group."))
                                         for k in tensors)),
                               device=self.device)
        dist.all_reduce(stepped, op=dist.ReduceOp.MAX)
        if self.rank == 0:
            ckpt_format.write_meta(path, {
                **self._layout(),
                "trainable": self.trainable,
                "role": self.spec.role,
                "has_optimizer": self.optimizer is not None,
                "optimizer_stepped": bool(stepped.item()),
                "hf_source": (os.path.abspath(self.spec.load) if os.path.isdir(self.spec.load)
                              else self.spec.load),
                "torch_version": torch.__version__,
                "ranks": self._coords,  # each rank's tp, pp, dp, ep, etp, edp: where chatlearn merge reads shards
            })
        dist.barrier()
        if self.rank == 0:
            sharded.mark_complete(path)
        dist.barrier()  # on every rank, a return means the checkpoint is complete

    @torch.no_grad()
    def load_checkpoint(self, path: str) -> None:
        """Restore a checkpoint written by ``save_checkpoint`` with the same world size,
        parallel sizes and optimizer kind: parameters, optimizer state (when trainable), RNG
        states; pending gradients are dropped. A collective; weights and optimizer must be
        onloaded. A missing, incomplete or mismatched checkpoint raises a UserError on every
        rank before any collective."""
        from megatron.core import tensor_parallel

        self._require_onloaded("load_checkpoint")
        meta = ckpt_format.read_meta(path, self._layout())
        # no role recorded: saved before the critic existed on this backend, by a policy model
        saved_role = meta["role"] if "role" in meta else "policy"
        if (saved_role == "critic") != self.critic:
            raise UserError(f"checkpoint {path!r} was saved by a {saved_role} model, which "
                            f"cannot resume as a {self.spec.role} (the critic has a value head, the policy "
                            f"an LM head). Load a checkpoint of the "
                            f"{'critic' if self.critic else 'policy trainer'}.")
        if self.optimizer is not None and not meta.get("has_optimizer"):
            raise UserError(f"checkpoint {path!r} holds no optimizer state (it was saved by a "
                            "frozen reference model), so a trainable model cannot resume from "
                            f"it. Load a checkpoint of the {'critic' if self.critic else 'policy trainer'}.")
        file = ckpt_format.rank_file(path, self.rank)
        if not os.path.isfile(file):
            raise UserError(f"checkpoint {path!r} has no shard for rank {self.rank} ({file} is "
                            "missing): the checkpoint is damaged. Use another checkpoint.")
        rng = sharded.load_rng_state(path, self.rank)
        self.zero_grad()
        with safe_open(file, framework="pt") as f:
            keys = set(f.keys())
            missing = [f"model.{n}" for n in self._params if f"model.{n}" not in keys]
            if missing:
                raise UserError(f"checkpoint {path!r} does not fit this model: {missing[:3]} "
                                f"missing. Load a checkpoint saved from the same model (it was "
                                f"saved from {meta.get('hf_source')!r}).")
            for name, p in self._params.items():
                value = f.get_tensor(f"model.{name}")
                if value.shape != p.shape:
                    raise UserError(f"checkpoint {path!r} does not fit this model: {name} has "
                                    f"shape {list(value.shape)} there, {list(p.shape)} here.")
                p.copy_(value)
            if self.optimizer is not None:
                for key, p, state, group in self._optimizer_params(with_groups=True):
                    state.pop(p, None)
                    prefix = f"optimizer.{key}."
                    saved = {k[len(prefix):]: f.get_tensor(k) for k in keys if k.startswith(prefix)}
                    if saved:  # a per-parameter "step" where torch's Adam keeps it, the
                        # moments beside the parameter; copies: the file's tensors are not
                        # resizable, as offloading needs
                        state[p] = {k: v.to(param_step_device(group, p) if k == "step"
                                            else p.device, copy=True)
                                    for k, v in saved.items()}
                    if f"main.{key}" in keys:
                        p.copy_(f.get_tensor(f"main.{key}"))
                for i, opt in enumerate(self._optimizers()):  # fused Adam: per-group steps
                    prefix = f"optimizer_group.{i}."
                    restore_group_steps(opt.optimizer, {
                        int(k[len(prefix):].split(".")[0]): f.get_tensor(k)
                        for k in keys if k.startswith(prefix)})
            tracker = tensor_parallel.get_cuda_rng_tracker()
            states = {k.split(".", 1)[1]: f.get_tensor(k) for k in keys
                      if k.startswith("rng_tracker.")}
            if states:
                tracker.set_states(states)
        sharded.restore_rng_state(rng, self.device)

    # ------------------------------------------------------------------ weights out
    def _split(self, m: Mapping) -> tuple[int, int]:
        """``(ranks, this rank's index)`` of the ranks that split ``m``: a routed expert's over the
        expert-tensor-parallel ranks, everything else over the tensor-parallel ranks."""
        return (self.etp, self.etp_rank) if m.expert is not None else (self.tp, self.tp_rank)

    def _gather_tp(self, local: torch.Tensor, m: Mapping) -> torch.Tensor:
        size, _ = self._split(m)
        if m.split_dim is None or size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=self.etp_group if m.expert is not None else self.tp_group)
        return torch.cat(parts, dim=m.split_dim)

    def _gather_expert(self, m: Mapping, source: str, dtype: torch.dtype, shapes: list) -> list | None:
        """A routed expert's Hugging Face tensors on rank 0 (None elsewhere): the ranks that hold it
        (its expert-parallel rank on its stage, expert-data-parallel replica 0) gather its
        expert-tensor-parallel shards; the first of them sends the result to rank 0 unless it is
        rank 0 (point to point: the holder and rank 0 share no group in general)."""
        owner_ep = m.expert // (self.arch.num_experts // self.ep)
        stage = self._owner(m)
        holders = [r for r, c in enumerate(self._coords)
                   if c["pp"] == stage and c["ep"] == owner_ep and c["edp"] == 0]
        hf = None
        if self.rank in holders:
            param = self._params[m.megatron]
            local = param.main_grad if source == "grads" else param.detach()
            hf = to_hf(self.arch, m, self._gather_tp(local.to(dtype), m), self.etp)
        src = min(r for r in holders if self._coords[r]["etp"] == 0)
        if src == 0:
            return hf if self.rank == 0 else None
        sizes = [int(np.prod(s)) for s in shapes]
        if self.rank == src:
            dist.send(torch.cat([t.reshape(-1) for t in hf]).contiguous(), dst=0)
        elif self.rank == 0:
            flat = torch.empty(sum(sizes), dtype=dtype, device=self.device)
            dist.recv(flat, src=src)
            return [t.view(s) for t, s in zip(flat.split(sizes), shapes)]
        return None

    def _gather_hf(self, source: str, only: set | None = None, host: bool = True
                   ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``(hf_name, float32 tensor on rank 0, None elsewhere)`` for every parameter
        (``source``: "weights" or "grads"), in a fixed order; a collective. ``only``: just
        the mappings that produce one of these HF names (all of the mapping's names).
        ``host``: the tensors are copies on the CPU; else copies on this rank's device (never
        views of the parameters, which later steps change).

        The stage that holds a parameter gathers its tensor-parallel shards (replica 0
        only); when that stage is not the first, it sends the result to rank 0 over rank
        0's pipeline group.
        """
        ranks = dist.get_process_group_ranks(self.pp_group) if self.pp > 1 else [0]
        on_rank0_pipeline = self.dp_rank == 0 and self.tp_rank == 0
        dtype = torch.float32 if source == "grads" else self.dtype
        for m in self.mappings:
            if only is not None and not only.intersection(m.hf):
                continue
            owner = self._owner(m)
            shapes = hf_shapes(self.arch, m)
            if m.expert is not None:
                hf = self._gather_expert(m, source, dtype, shapes)
                for i, name in enumerate(m.hf):
                    yield name, (None if self.rank != 0 else hf[i].to("cpu" if host else hf[i].device,
                                                                    torch.float32, copy=True))
                continue
            hf = None
            if self.pp_rank == owner and self.dp_rank == 0:
                param = self._params[m.megatron]
                local = param.main_grad if source == "grads" else param.detach()
                hf = to_hf(self.arch, m, self._gather_tp(local.to(dtype), m), self.tp)
            if owner != 0 and on_rank0_pipeline:
                sizes = [int(np.prod(s)) for s in shapes]
                flat = (torch.cat([t.reshape(-1) for t in hf]) if hf is not None
                        else torch.empty(sum(sizes), dtype=dtype, device=self.device))
                dist.broadcast(flat, src=ranks[owner], group=self.pp_group)
                hf = [t.view(s) for t, s in zip(flat.split(sizes), shapes)]
            for i, name in enumerate(m.hf):
                if self.rank != 0:
                    yield name, None
                elif host:
                    yield name, hf[i].to("cpu", torch.float32, copy=True)
                else:
                    yield name, hf[i].to(torch.float32, copy=True)

    def _module_views(self) -> list[tuple[str, tuple, list[str], str | None, int]]:
        """The exported tensors: :func:`chatlearn.checkpoint.megatron_mapping.module_views` of
        every Hugging Face tensor, as ``(name, shape, checkpoint names, fusion, group)``:
        transformers' module names (a MoE layer's experts fused, ``mlp.experts.gate_up_proj`` and
        ``mlp.experts.down_proj``), the names the FSDP trainer exports. ``group``: the Megatron
        parameter the names come from (fused QKV -> q/k/v, fused gate-up -> gate/up), or one
        group per fused expert tensor, so that a bucket never splits a gather."""
        if getattr(self, "_views", None) is None:
            group, shape = {}, {}
            for i, m in enumerate(self.mappings):
                for name, sh in zip(m.hf, hf_shapes(self.arch, m)):
                    group[name], shape[name] = i, tuple(sh)
            views = module_views(self.arch, list(group))
            self._views = [(name, tuple(sh) if sh is not None else shape[name], parts, fusion,
                            group[name] if fusion is None else len(self.mappings) + k)
                           for k, (name, sh, parts, fusion) in enumerate(views)]
        return self._views

    def _gather_views(self, source: str, wanted: set | None, host: bool
                      ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """:meth:`_gather_hf` in the form of :meth:`_module_views` (``wanted``: those view names,
        None: all): a fused expert tensor is yielded once every expert of it has arrived (one
        layer's experts at a time on rank 0)."""
        views = [v for v in self._module_views() if wanted is None or v[0] in wanted]
        part_of = {p: v for v in views for p in v[2]}
        pending: dict[str, dict] = {}
        for name, tensor in self._gather_hf(source, only=set(part_of), host=host):
            view = part_of.get(name)
            if view is None:
                continue
            if view[3] is None:
                yield name, tensor
                continue
            got = pending.setdefault(view[0], {})
            got[name] = tensor
            if len(got) == len(view[2]):
                del pending[view[0]]
                yield view[0], (None if self.rank != 0 else
                                fuse_module_view(view[3], [got[p] for p in view[2]]))

    def weight_specs(self) -> list[tuple[str, str, tuple, int]]:
        """``(name, "float32", shape, group)`` in ``export_tensors`` order (the same on every
        rank; no collective): transformers' module tensors (:meth:`_module_views`; a dense model's
        are its checkpoint's). Tied output embeddings are not listed (they are
        ``model.embed_tokens.weight``); the critic's value head is ``score.weight`` and
        ``score.bias``."""
        return [(name, "float32", shape, group) for name, shape, _, _, group in self._module_views()]

    @torch.no_grad()
    def export_tensors(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``(name, float32 tensor on rank 0, None elsewhere)`` for the names given (whole
        groups of ``weight_specs``), gathered mapping by mapping (tensor-parallel all-gather,
        pipeline broadcast to rank 0; a routed expert: expert-tensor-parallel all-gather, sent
        from its expert-parallel rank to rank 0, the layer's experts stacked into the fused
        tensors): a collective, every rank iterates with the same names.

        The tensors stay on this rank's device (a copy, never a view of a parameter): the
        weight push copies each into its own slot buffer (device to device for ``cuda_ipc``,
        or straight into its host slot), so no extra pass through pageable host memory is
        made here."""
        self._require_weights()
        yield from self._gather_views("weights", set(names), host=False)

    def save_hf(self, path: str) -> None:
        """Write a Hugging Face folder at ``path`` (rank 0 writes; a collective): float32
        safetensors weights, and the other files of the ``load`` folder (config with its
        dtype set to float32, generation config, tokenizer, chat template). The critic's is a
        token-classification folder with one label, as the FSDP critic's: ``score.weight`` and
        ``score.bias``, the config's architectures the ``*ForTokenClassification`` class
        (:func:`chatlearn.checkpoint.hf_files.value_head_config`), no generation config."""
        self._require_weights()
        state = {name: t for name, t in self._gather_hf("weights") if t is not None}
        if self.rank == 0:
            from huggingface_hub import save_torch_state_dict

            os.makedirs(path, exist_ok=True)
            save_torch_state_dict(state, path, metadata={"format": "pt"})
            src = self.spec.load
            for name in os.listdir(src):
                file = os.path.join(src, name)
                if not os.path.isfile(file) or name.endswith(_WEIGHT_SUFFIXES):
                    continue
                if self.critic and name == "generation_config.json":
                    continue  # a token-classification model does not generate
                if name == "config.json":
                    with open(file, encoding="utf-8") as f:
                        conf = json.load(f)
                    if self.critic:
                        conf = value_head_config(conf)
                    for key in ("torch_dtype", "dtype"):
                        if key in conf:
                            conf[key] = "float32"
                    with open(os.path.join(path, name), "w", encoding="utf-8") as f:
                        json.dump(conf, f, indent=2)
                else:
                    shutil.copy2(file, os.path.join(path, name))
        dist.barrier()
