"""FSDP2 trainer around a Hugging Face causal LM: ``policy_trainer`` and ``ref_policy``; and around
a Hugging Face token-classification model with one label: the PPO ``critic`` (``spec.role``).

Sharding: ``fully_shard`` on every decoder layer, then on the root, over a 1-D device mesh
of all ranks (so each parameter, its gradient and its Adam states are split on dim 0).

Data: every rank receives the FULL batch (see ``chatlearn.models.base``); rank r works on
its contiguous share of samples ``[r*N/W, (r+1)*N/W)``, and results are gathered or
all-reduced so that every rank returns the same thing.

The loss is aggregated over the whole global batch (:class:`chatlearn.algorithms.grpo.GRPOLoss`)::

    per_token = policy_loss + kl_coef * KL(logp, ref_logp) - entropy_coef * H
    loss      = sum_{response tokens t of the global batch} c_{i(t)} * per_token_t

(c_i = 1 / T_global for ``loss_agg_mode: token-mean``; the critic's loss is
:class:`chatlearn.algorithms.value_loss.ValueLoss`, aggregated the same way). Each micro-batch backpropagates
``sum(c * per_token) * W``; FSDP's reduce-scatter averages gradients over the W ranks, so
the summed shards are exactly d(loss)/d(theta). The learning rate of each step is
:func:`chatlearn.algorithms.lr_schedule.learning_rate` of Adam's step count.
"""
from __future__ import annotations

import json
import os
import shutil
import types
from datetime import timedelta
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (FSDPModule, MixedPrecisionPolicy, fully_shard,
                                    register_fsdp_forward_method)
from torch.distributed.tensor import DTensor

from chatlearn.algorithms.gkd import GKDTargets, TeacherTopK
from chatlearn.algorithms.grpo import chunked_logprobs_entropy
from chatlearn.checkpoint import sharded
from chatlearn.config.names import Part
from chatlearn.errors import UserError
from chatlearn.models.base import Batch, Trainer, response_positions, step_is_finite
from chatlearn.models.hf_folder import HFCheckpoint, checkpoint_renames
from chatlearn.models.moe import layout as moe_layout
from chatlearn.models.moe.routing import RouterPatch, micro_batch_target, routers
from chatlearn.models.stash import own_storage, release_device_memory
from chatlearn.models.trainer import lora as lora_lib
from chatlearn.models.trainer import moe as moe_lib
from chatlearn.models.trainer import shared_prompt
from chatlearn.models import vision as vision_lib
from chatlearn.models.trainer.packing import check_fixed_width, plan_micro_batches, plan_shared_micro_batches

if TYPE_CHECKING:
    from chatlearn.models.specs import TrainerSpec

# Files of a model folder that save_pretrained writes itself; save_hf copies the others
# (tokenizer, chat template, remote code) from the folder the model was loaded from.
_WRITTEN_BY_SAVE = ("config.json", "generation_config.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json",
                    ".bin.index.json")


def init_distributed() -> torch.device:
    """Join the process group (from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) if needed.

    nccl and ``cuda:LOCAL_RANK`` when CUDA is available (``cuda:0`` when the process sees a
    single GPU, as a Ray actor does), else gloo and ``cpu``.
    """
    if torch.cuda.is_available():
        index = int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ and torch.cuda.device_count() > 1 else 0
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        timeout = collective_timeout()
        dist.init_process_group(backend, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                **({"timeout": timeout} if timeout is not None else {}))
    return device


def collective_timeout() -> timedelta | None:
    """How long a collective of this process's groups may wait for the other ranks before it fails
    (NCCL, with its asynchronous error handling, then takes the process down; gloo raises):
    ``CHATLEARN_COLLECTIVE_TIMEOUT_S`` of the rendezvous environment the driver gives the ranks
    (4 x ``runtime_args.stage_timeout_s``); None: torch's default."""
    name = "CHATLEARN_COLLECTIVE_TIMEOUT_S"
    seconds = float(os.environ[name]) if name in os.environ else 0.0
    return timedelta(seconds=seconds) if seconds > 0 else None


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules of the classes HF marks as not splittable (the decoder layers)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to shard "
                         f"(_no_split_modules={sorted(names)})")
    return layers


# Config attributes of models whose logits are not ``lm_head(last hidden state)``: the
# chunked log-prob path (``_token_logprobs``) would silently skip their scaling.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                     "output_multiplier_scale")


def _token_logprobs(model, input_ids, attention_mask, position_ids, rows, cols,
                    temperature: float, chunk: int, with_entropy: bool, prev_cols=None, layout=None, images=None):
    """``(logp, entropy or None)`` of the tokens ``input_ids[rows, cols]`` given their prefix.

    Bound to the model; when it is sharded, registered with ``register_fsdp_forward_method``, so
    it runs as a forward of the root: FSDP2's root pre-forward all-gathers the root's own
    parameters (embeddings, final norm, ``lm_head``; a tied ``lm_head.weight`` is the
    embedding), they stay unsharded through backward (the root does not reshard after
    forward; its pre-backward hook on these outputs re-gathers them if needed), and the
    decoder layers gather their own. The decoder (``get_decoder()``) gives the last hidden
    states; only the rows before the wanted tokens go through the LM head, chunk by chunk
    (:func:`chatlearn.algorithms.grpo.chunked_logprobs_entropy`), so neither the model's
    ``[B, L, V]`` logits nor a ``[tokens, V]`` float32 copy is ever made. This is the same
    computation as HF's ``XForCausalLM.forward`` (``logits = lm_head(hidden_states)``,
    transformers 5.x ``modeling_qwen2.py``) followed by ``log_softmax(logits.float() / T)``.

    The hidden state that predicts token ``[rows, cols]`` is at ``[rows, prev_cols]`` (default
    ``cols - 1``; in a shared-prompt row the first token of a continuation is predicted from its
    prompt's last token), and ``layout`` (a shared-prompt
    :class:`~chatlearn.models.trainer.shared_prompt.Layout`) goes to the attention function.

    ``images`` (a vision-language model's ``(pixel_values, image_grid_thw, placeholders)`` of the images in the
    order of their placeholders, row after row; ``placeholders``: where they are, bool of ``input_ids``' shape): the decoder takes the embeddings with the vision tower's features in place of
    the placeholders (:func:`chatlearn.models.vision.embed_with_images`, the model's own forward's) and
    ``position_ids`` are its multimodal rotary positions.
    """
    extra = {} if layout is None else {shared_prompt.KWARG: layout}
    if images is not None:
        extra["inputs_embeds"] = vision_lib.embed_with_images(model, input_ids, *images)
    hidden = model.get_decoder()(input_ids=None if images is not None else input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, use_cache=False, **extra).last_hidden_state
    head = model.get_output_embeddings()
    prev = cols - 1 if prev_cols is None else prev_cols
    return chunked_logprobs_entropy(hidden[rows, prev], head.weight, input_ids[rows, cols],
                                    temperature, chunk, with_entropy, bias=head.bias)


def _put_rows(into, values, pos: torch.Tensor, total: int):
    """``values`` (a tensor [M, ...], or a tuple of them) put at rows ``pos`` of ``into`` (the same shape with
    ``total`` rows; made of zeros when None); returns ``into``."""
    if isinstance(values, tuple):
        into = into if into is not None else (None,) * len(values)
        return tuple(_put_rows(i, v, pos, total) for i, v in zip(into, values))
    if into is None:
        into = values.new_zeros((total, *values.shape[1:]))
    into[pos] = values
    return into


def _full_tensor(p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter: gathered from the ranks for a DTensor (a collective)."""
    return p.full_tensor() if isinstance(p, DTensor) else p


def _value_head(model) -> torch.nn.Module:
    """The value head of a token-classification model: ``score`` (transformers'
    ``GenericForTokenClassification``: Qwen2, Llama, ...) or ``classifier``."""
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, torch.nn.Module):
            return head
    raise ValueError(f"{type(model).__name__}: no value head (neither a score nor a classifier module)")


def _token_values(model, input_ids, attention_mask, position_ids, rows, cols,
                  temperature: float, chunk: int, with_entropy: bool, prev_cols=None, layout=None):
    """``(values, None)``: the critic's float32 [M] values of the tokens ``input_ids[rows, cols]``,
    the value of the state before each token is generated::

        V[rows, cols] = score(hidden[rows, prev_cols])        (prev_cols: cols - 1 by default)

    (verl's critic: ``values[:, -response_length - 1:-1]``). The critic's counterpart of
    :func:`_token_logprobs`, bound to the model as ``token_logprobs`` (with its signature, so
    that the trainer's passes run unchanged; ``temperature``, ``chunk`` and ``with_entropy`` are
    not used) and registered as an FSDP forward method the same way: the root's parameters (the
    embeddings, the final norm and the value head) are all-gathered by the root's pre-forward.
    The backbone (``model.base_model``: ``model.model`` of transformers' ``*ForTokenClassification``)
    gives the last hidden states, with the shared-prompt ``layout`` passed to its attention as for
    the log-probs; only the rows of the wanted tokens go through the head. This is HF's
    ``XForTokenClassification.forward`` (``logits = score(dropout(hidden_states))``, transformers
    5.x ``modeling_layers.py``) without the dropout (0 for the critic) at the positions before the
    tokens.
    """
    extra = {} if layout is None else {shared_prompt.KWARG: layout}
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids, use_cache=False, **extra).last_hidden_state
    prev = cols - 1 if prev_cols is None else prev_cols
    return _value_head(model)(hidden[rows, prev]).float().squeeze(-1), None


def bf16_compute(bf16: bool | None, device_type: str) -> bool:
    """Whether the trainer computes in bfloat16 (FSDP2's ``MixedPrecisionPolicy``: parameters
    all-gathered as bfloat16, gradients reduced in float32): ``bf16`` on a CUDA device. On the CPU
    ``bf16`` is off (resolved to false there): float32."""
    return bool(bf16) and device_type == "cuda"


def param_dtype(trainable: bool, lora: bool, bf16: bool | None, device_type: str) -> torch.dtype:
    """dtype the model is loaded in, and the one its frozen parameters are stored in.

    float32 for a fully trained model on every device: these are the master weights Adam updates;
    with bfloat16 compute (:func:`bf16_compute`) FSDP2 all-gathers them as bfloat16 and reduces
    gradients in float32. With bfloat16 compute a frozen reference model (``trainable`` false) and
    the frozen base of a LoRA model (``lora``) are stored in bfloat16, the dtype they compute in
    anyway (the same log-probs, half the memory); the LoRA adapters and the copies of
    ``modules_to_save``, the only parameters that train, are made float32 by
    :func:`chatlearn.models.trainer.lora.wrap` (FSDP2 requires one dtype among the trainable
    parameters of a group only). Without bfloat16 compute (the CPU): float32.
    """
    if bf16_compute(bf16, device_type) and (lora or not trainable):
        return torch.bfloat16
    return torch.float32


def _set_config_dtype(folder: str, dtype: str) -> None:
    """Set ``dtype`` in the ``config.json`` of ``folder``: ``save_pretrained`` writes the dtype of the
    model's first parameter there, which with LoRA is the base's (bfloat16 with ``bf16`` on CUDA) while
    ``save_hf`` writes the merged weights in float32 (``from_pretrained(dtype="auto")`` reads it)."""
    file = os.path.join(folder, "config.json")
    with open(file, encoding="utf-8") as f:
        config = json.load(f)
    config["dtype"] = dtype
    with open(file, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def damaged_shards(path: str, err: Exception) -> str:
    """One paragraph for a checkpoint at ``path`` whose shards do not read back (``err``: DCP's or
    torch.load's error): the files, what happened and the ways on."""
    shards = sorted(f for f in os.listdir(path) if f.endswith(".distcp")) if os.path.isdir(path) else []
    failures = getattr(err, "failures", None)  # DCP's CheckpointException: {rank: (the rank's error, its traceback)}
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        err = first[0] if isinstance(first, tuple) and isinstance(first[0], BaseException) else err
    lines = str(err).strip().splitlines()
    reason = " ".join(lines[0].split()).split(". ")[0] if lines else ""  # its first sentence
    reason = reason if len(reason) <= 160 else reason[:160].rsplit(" ", 1)[0] + " (...)"
    return (f"checkpoint {path!r} is damaged: its shard files ({', '.join(shards) or 'none found'}) do not read back "
            f"({type(err).__name__}: {reason}). Their bytes changed after the save (a storage fault, a copy gone "
            "wrong) while their sizes still match the manifest. Resume from the checkpoint before it (delete or move "
            "this one), or restore it from a copy.")


class FSDPTrainer(Trainer):
    """FSDP2 trainer of a Hugging Face causal LM (``trainable``: policy_trainer; else
    ref_policy: frozen, no optimizer, forward only), or, with ``spec.role`` critic, of the
    critic: ``AutoModelForTokenClassification`` with one label (the backbone of the ``load``
    folder, a causal LM or a critic's own folder, and a scalar value head), whose forward gives
    values (:func:`_token_values`) where the policy's gives log-probs, trained on the value loss
    (:class:`chatlearn.algorithms.value_loss.ValueLoss`).

    Training runs the model in train mode (HF gradient checkpointing needs it), so any
    dropout in the model config is active; RL usually wants it 0 (Qwen2's default).
    """

    def __init__(self, spec: TrainerSpec):
        """``spec``: the trainer's settings, kept as ``self.spec`` and read as attributes: load,
        trust_remote_code, seed, trainable, lr, weight_decay, adam_beta1, adam_beta2, adam_eps (read
        when trainable), clip_grad, train_micro_batch_size, logprob_micro_batch_size, gradient_checkpointing,
        bf16, packing, max_token_in_packing, seq_length, logprob_chunk_tokens, meta_init, share_prompt, the
        loss fields (:class:`chatlearn.algorithms.grpo.GRPOLoss`) and the learning-rate schedule's (the
        lr_* iters resolved to optimizer steps), role (and the critic's cliprange_value and value_loss_coef),
        routing_replay (rollout, on an MoE model: every forward of a batch with ``routed_experts`` routes its
        tokens to the recorded experts, ``chatlearn/models/moe/routing.py``);
        the Megatron parallelism fields are not read."""
        self.spec = spec
        self.device = init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = self.rank, self.world  # FSDP shards data-parallel only
        self.trainable = bool(spec.trainable)
        torch.manual_seed(int(spec.seed))
        self.model = self._build_model()
        self._push_renames: dict | None = None  # push_view's, with LoRA adapters
        self.optimizer = (torch.optim.AdamW([p for _, p in lora_lib.trained_params(self.model)], lr=spec.lr,
                                            weight_decay=spec.weight_decay,
                                            betas=(spec.adam_beta1, spec.adam_beta2),
                                            eps=spec.adam_eps, fused=self.device.type in ("cpu", "cuda"))
                          if self.trainable else None)
        self._stashes: dict = {}

    # ------------------------------------------------------------------ setup
    def _param_dtype(self) -> torch.dtype:
        """dtype the model is loaded and its frozen parameters are stored in (:func:`param_dtype`)."""
        return param_dtype(self.trainable, self.spec.lora is not None, self.spec.bf16, self.device.type)

    def _build_model(self) -> torch.nn.Module:
        """The sharded model. With ``meta_init`` every rank builds it on the meta device from
        the config, it is sharded there, and only rank 0 reads the checkpoint (see
        :meth:`_load_from_rank0`); otherwise every rank loads the checkpoint, then shards.

        On one rank without mixed precision (``self.sharded`` False) the model stays a plain
        module on the device: FSDP2 over a mesh of one would still copy every parameter into
        an all-gather buffer and out again before each use and every gradient through a
        reduce-scatter buffer (measured on the 38M model on CPU: about a fifth of a training
        step), for the same numbers. Checkpoints are the same DCP folders either way (DCP
        reshards plain tensors and DTensors alike), so a run resumes on any number of ranks.
        With ``bf16`` on CUDA one rank is still wrapped: FSDP2's ``MixedPrecisionPolicy``
        gives the bfloat16 compute copies of the float32 master weights (with LoRA: of the
        float32 adapters; the frozen base is stored in bfloat16, :func:`param_dtype`).

        The critic (``role`` critic) is ``AutoModelForTokenClassification`` with ``num_labels=1``
        (:meth:`_auto_class`): from a causal LM's folder the backbone loads and the value head is
        newly initialised (from the generator seeded with ``seed`` in the constructor, the same on
        every rank), as verl initialises its critic; a critic's own folder loads as is. Its
        classifier dropout is set to 0, and its forward gives values (:func:`_token_values`)."""
        spec = self.spec
        critic = spec.role == "critic"
        dtype = self._param_dtype()
        mixed = bf16_compute(spec.bf16, self.device.type)
        self.sharded = self.world > 1 or mixed
        loaded = None
        if spec.meta_init and self.sharded:
            model, loaded = self._meta_model(dtype)
        else:
            auto, head = self._auto_class()
            model = auto.from_pretrained(spec.load, dtype=dtype, trust_remote_code=spec.trust_remote_code, **head)
        # (the critic's value is score(hidden states) in HF's own forward too: no logit transform to skip)
        scaled = [] if critic else [a for a in _LOGIT_TRANSFORMS
                                    if getattr(model.config, a, None) not in (None, 1, 1.0)]
        if scaled:
            raise UserError(f"{type(model).__name__} transforms its logits ({', '.join(scaled)}); "
                            "the FSDP trainer computes logits as lm_head(hidden states) only. Use "
                            "a model without logit scaling or soft-capping.", key=self._config_key("load"))
        if critic:
            self._check_value_head(model)
        self.vlm = vision_lib.is_vlm(model)
        if self.vlm and self.trainable and spec.freeze_vision_tower:  # before LoRA: its adapters stay trainable
            vision_lib.vision_tower(model).requires_grad_(False)
        self._wrap_lora(model, loaded)
        self.moe = self._apply_moe(model)
        # routing_replay: rollout: the MoE routers route each token of a batch with routed_experts to the experts
        # the rollout recorded (chatlearn/models/moe/routing.py), in every forward: log-probs, values, training
        self.routing = (RouterPatch(model) if spec.routing_replay == "rollout" and routers(model) else None)
        model.config.use_cache = False
        self.share_prompt = self._resolve_share_prompt(model)
        if self.share_prompt:
            shared_prompt.register()
            model.set_attn_implementation(shared_prompt.ATTENTION)
        if self.trainable and spec.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        if not self.trainable:
            model.requires_grad_(False)
        model.train(False)
        model.token_logprobs = types.MethodType(_token_values if critic else _token_logprobs, model)
        if not self.sharded:  # one rank, one dtype: nothing to shard, gather or reduce
            own_storage(model.to(self.device).parameters())
            return model
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mixed else MixedPrecisionPolicy())
        mesh = init_device_mesh(self.device.type, (self.world,))
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        if spec.meta_init:
            self._load_from_rank0(model, loaded)
        register_fsdp_forward_method(model, "token_logprobs")
        return model

    def _wrap_lora(self, model, loaded) -> None:
        """With ``spec.lora``: the adapters injected into ``model`` (and into rank 0's ``loaded`` copy of
        ``meta_init``, whose values the other ranks receive), before sharding; ``self.peft`` the
        ``PeftModel`` around ``model`` (None without adapters), ``self.merged`` the merged view the
        weight push reads (:mod:`chatlearn.models.trainer.lora`)."""
        self.peft = self.merged = None
        if self.spec.lora is None:
            return
        self.peft = lora_lib.wrap(model, self.spec.lora, int(self.spec.seed))
        problem = moe_lib.lora_problem(model, self.spec.lora.target_modules)
        if problem is not None:
            raise UserError(problem, key="models.policy_trainer.lora.target_modules")
        if loaded is not None:
            lora_lib.wrap(loaded, self.spec.lora, int(self.spec.seed))
        self.merged = lora_lib.Merged(model)

    def _apply_moe(self, model) -> "moe_lib.RouterTaps | None":
        """The MoE keys of this trainer section acting on ``model`` (:mod:`chatlearn.models.trainer.moe`):
        the router taps (aux and z-loss, forced balancing, the step's MoE metrics), the experts
        implementation (``groupgemm``), the recomputed MoE blocks (``moe_layer_recompute``, unless
        ``gradient_checkpointing`` recomputes the whole layers already); None for a dense model."""
        spec = self.spec.moe or moe_lib.DEFAULT
        if self.spec.gradient_checkpointing and self.trainable:
            spec = spec.replace(layer_recompute=False)
        self._moe_recording = False
        return moe_lib.apply(model, spec, self._config_key)

    def _adapters_disabled(self):
        if self.peft is None:
            return super()._adapters_disabled()
        return self.peft.disable_adapter()

    def _resolve_share_prompt(self, model) -> bool:
        """``share_prompt``: false: off; null: on where it can be (the model's attention goes through
        transformers' ``AttentionInterface``, plain SDPA attention: no sliding-window layers, no logit
        soft-capping; no fixed ``seq_length``);
        true: on, or a UserError naming the key where it cannot be."""
        setting = self.spec.share_prompt
        if setting is False:
            return False
        why = None
        layer_types = set(getattr(model.config, "layer_types", None) or ())
        if vision_lib.is_vlm(model):
            why = f"{type(model).__name__} takes images, whose features a shared-prompt row does not lay out"
        elif not getattr(model, "_supports_attention_backend", False):
            why = f"{type(model).__name__} does not compute attention through transformers' AttentionInterface"
        elif layer_types - {"full_attention"} or getattr(model.config, "use_sliding_window", False):
            why = f"{type(model).__name__} has layers that are not full attention ({sorted(layer_types)})"
        elif getattr(model.config, "attn_logit_softcapping", None):
            why = f"{type(model).__name__} soft-caps its attention logits"
        elif self.spec.seq_length is not None and not self.spec.packing:
            why = "seq_length pads every micro-batch to a fixed width, which a shared-prompt row does not have"
        if why is None:
            return True
        if setting:
            raise UserError(f"share_prompt: true cannot be honoured: {why}. Set it to null (on where it can "
                            "be) or false.", key=self._config_key("share_prompt"))
        return False

    def _meta_model(self, dtype: torch.dtype):
        """``(model on the meta device built from the config, the checkpoint loaded on the
        CPU on rank 0 / None elsewhere)``. Ranks other than 0 read only ``config.json`` and
        ``generation_config.json``. Rank 0 loads the checkpoint with ``from_pretrained`` in
        ``dtype`` (transformers applies its own key conversions; a bfloat16 checkpoint is
        read as bfloat16, never through a float32 copy). The critic's class and head:
        :meth:`_auto_class` (rank 0's copy initialises a new value head)."""
        from transformers import AutoConfig, GenerationConfig

        spec = self.spec
        remote = spec.trust_remote_code
        auto, head = self._auto_class()
        config = AutoConfig.from_pretrained(spec.load, trust_remote_code=remote, **head)
        with torch.device("meta"):
            model = auto.from_config(config, dtype=dtype, trust_remote_code=remote)
        if spec.role != "critic":
            try:  # save_hf writes the model's generation config: keep the checkpoint's
                model.generation_config = GenerationConfig.from_pretrained(spec.load)
            except OSError:  # none in the folder
                pass
        loaded = (auto.from_pretrained(spec.load, dtype=dtype, trust_remote_code=remote, **head)
                  if self.rank == 0 else None)
        return model, loaded

    def _auto_class(self):
        """``(transformers auto class, from_pretrained / AutoConfig keyword arguments)`` of this
        model: ``AutoModelForTokenClassification`` with ``num_labels=1`` for the critic,
        ``AutoModelForCausalLM`` otherwise."""
        from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

        if self.spec.role == "critic":
            if vision_lib.model_class(self.spec.load, None, self.spec.trust_remote_code) is not None:
                raise UserError(f"the critic's model at {self.spec.load!r} is a vision-language model: a critic on "
                                "prompts with images is not supported. Use GRPO (no critic), or a text-only "
                                "critic on text data.", key=self._config_key("load"))
            return AutoModelForTokenClassification, {"num_labels": 1}
        return vision_lib.model_class(self.spec.load, AutoModelForCausalLM, self.spec.trust_remote_code), {}

    def _check_value_head(self, model) -> None:
        """The critic's model has a value head of one output (or a UserError naming ``load``);
        its classifier dropout is set to 0 (the config's ``classifier_dropout`` where it has one,
        and the head's dropout module)."""
        try:
            head = _value_head(model)
        except ValueError as err:
            raise UserError(f"{err}: the critic needs a token-classification model with a value head.",
                            key=self._config_key("load")) from None
        out = getattr(head, "out_features", 1)
        if out != 1:
            raise UserError(f"{type(model).__name__}'s value head has {out} outputs, not 1: the critic's "
                            "folder must be a causal LM or a token-classification model with one label.",
                            key=self._config_key("load"))
        if getattr(model.config, "classifier_dropout", None) is not None:
            model.config.classifier_dropout = 0.0
        dropout = getattr(model, "dropout", None)
        if isinstance(dropout, torch.nn.Dropout):
            dropout.p = 0.0

    @torch.no_grad()
    def _load_from_rank0(self, model: torch.nn.Module, loaded) -> None:
        """Fill the sharded meta ``model`` from rank 0's ``loaded`` copy (a collective).

        ``to_empty`` gives every shard and buffer (uninitialised) storage on this rank's
        device; ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)``
        broadcasts rank 0's full tensors and keeps each rank's shard (torch
        ``distributed/checkpoint/state_dict.py``); tied weights are one parameter. The
        non-persistent buffers (rotary ``inv_freq``, ``original_inv_freq``) are not in a state
        dict: rank 0 broadcasts the ones its loaded model computed in its ``__init__``.
        """
        model.to_empty(device=self.device)
        state = loaded.state_dict() if self.rank == 0 else {}
        set_model_state_dict(model, state, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        del state
        names = [f"{prefix}.{b}" if prefix else b for prefix, m in model.named_modules()
                 for b in sorted(m._non_persistent_buffers_set)]
        for name in names:
            buf = model.get_buffer(name)
            if self.rank == 0:
                buf.copy_(loaded.get_buffer(name))
            dist.broadcast(buf, src=0)

    def _reshard(self) -> None:
        """Free every unsharded parameter (the root keeps them after a forward)."""
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    # ------------------------------------------------------------------ batches
    def _forward(self, batch: Batch, idx: np.ndarray, temperature: float, with_entropy: bool):
        """One forward over samples ``idx``: padded, or packed with ``packing``.

        Padded: a right-padded ``[len(idx), max_len]`` batch with an attention mask.
        Packed: one ``[1, sum(lens)]`` row of the concatenated samples, position ids
        restarting at 0 for each sample, no attention mask and no KV cache; transformers then derives the
        sample boundaries from the position ids (``masking_utils.find_packed_sequence_indices``:
        a new sample wherever the position does not grow by 1) and confines attention to
        each sample (block-diagonal causal mask for sdpa/eager/flex; varlen for flash).
        An empty ``idx`` is a dummy micro-step: a 1-token forward that yields no values, so
        that FSDP's collectives line up across ranks.

        Returns ``(logp, entropy or None, pos)``: values for the response tokens of those
        samples, in order, and ``pos`` their positions in ``batch["tokens"]``.
        logp_t = log softmax(z_{t-1} / temperature)[token_t], computed from the hidden states
        ``logprob_chunk_tokens`` tokens at a time (``_token_logprobs``).
        """
        if self.share_prompt and len(idx):
            return self._forward_shared(batch, idx, temperature, with_entropy)
        off = batch["offsets"]
        lens = [int(off[i + 1] - off[i]) for i in idx]
        packed = bool(self.spec.packing) or len(idx) == 0
        shape = (1, max(sum(lens), 1)) if packed else (len(idx), self._fixed_width(batch) or max(lens))
        ids = torch.zeros(shape, dtype=torch.long)
        positions = torch.zeros(shape, dtype=torch.long)
        mask = None if packed else torch.zeros(shape, dtype=torch.long)
        rows, cols, pos = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        routes = [] if self._replaying(batch) else None  # (row, col, the sample's routes)
        start = 0
        for b, (i, n) in enumerate(zip(idx, lens)):
            row, col = (0, start) if packed else (b, 0)
            if routes is not None:
                routes.append((row, col, moe_layout.decode(batch["routed_experts"][off[i]:off[i + 1]])))
            ids[row, col:col + n] = torch.as_tensor(np.array(batch["tokens"][off[i]:off[i + 1]]))  # copy: Ray arrays are read-only
            positions[row, col:col + n] = torch.arange(n)
            if mask is not None:
                mask[row, :n] = 1
            resp = response_positions(batch, i)  # the model's tokens (not a multi-turn observation)
            rows.append(np.full(len(resp), row))
            cols.append(col + resp)
            pos.append(int(off[i]) + resp)
            start += n
        if not packed:  # padding keeps increasing positions (ignored: masked out)
            positions = torch.arange(shape[1]).expand(shape)
        images = None
        if self.vlm:  # multimodal rotary positions; with packing, the text positions first
            positions, images = self._vision_inputs(batch, idx, ids, positions, packed)
        if self._moe_recording:  # the router taps count the real tokens (not padding, not a dummy's)
            self.moe.begin(mask if mask is not None else torch.full(shape, int(len(idx) > 0)))
        rows_t = torch.from_numpy(np.concatenate(rows)).to(self.device)
        cols_t = torch.from_numpy(np.concatenate(cols)).to(self.device)
        ids, positions = ids.to(self.device), positions.to(self.device)
        self._set_routes(tuple(ids.shape), routes)
        pos = np.concatenate(pos)
        logp, entropy = self.model.token_logprobs(
            ids, None if mask is None else mask.to(self.device), positions, rows_t, cols_t,
            float(temperature), int(self.spec.logprob_chunk_tokens), self._rows_mode(with_entropy, pos),
            **({} if images is None else {"images": images}))  # a critic's token_values takes no images
        return logp, entropy, pos

    def _rows_mode(self, with_entropy, pos: np.ndarray):
        """``with_entropy`` for the rows of token positions ``pos``: a batch's GKD targets
        (:class:`chatlearn.algorithms.gkd.GKDTargets`) become those rows' (``GKDRows``); any other as is."""
        return with_entropy.rows(pos, self.device) if isinstance(with_entropy, GKDTargets) else with_entropy

    def _vision_inputs(self, batch: Batch, idx: np.ndarray, ids: torch.Tensor, positions: torch.Tensor, packed: bool):
        """A vision-language model's ``(position ids, images)`` for the micro-batch ``ids`` of samples ``idx`` laid
        out as :meth:`_forward` lays them (packed: one row, one after the other; else a row each): each sample's
        ``[3, n]`` multimodal rotary positions as the model computes them for it alone
        (:func:`chatlearn.models.vision.sample_positions`), ``[3, rows, width]``; packed, with the text positions
        (restarting at 0 for each sample) as a fourth row first, from which transformers' Qwen2-VL builds the
        block-diagonal mask of the packed samples. ``images``: ``(pixel_values, image_grid_thw)`` of the samples'
        images in that order (None when none has any). The batch's ``images`` column holds each sample's image
        dict (None: text)."""
        items = list(batch["images"][i] for i in idx) if "images" in batch else [None] * len(idx)
        off = batch["offsets"]
        out = torch.zeros((3, *ids.shape), dtype=torch.long)
        where = torch.zeros(ids.shape, dtype=torch.bool)  # the prompts' image placeholders
        image_id, start = vision_lib.image_token_id(self.model), 0
        for b, (i, grid) in enumerate(zip(idx, vision_lib.sample_grids(items), strict=True)):
            n, prompt = int(off[i + 1] - off[i]), int(batch["prompt_lens"][i])
            row, col = (0, start) if packed else (b, 0)
            out[:, row, col:col + n] = vision_lib.sample_positions(self.model, ids[row, col:col + n].cpu(), grid,
                                                                   prompt)
            if grid is not None:
                where[row, col:col + prompt] = ids[row, col:col + prompt].cpu() == image_id
            start += n
        if packed:
            out = torch.cat([positions[None].cpu(), out])
        pixels, grid = vision_lib.stack_images(items)
        if pixels is None and self.sharded:  # every rank runs the vision tower's collectives in every forward
            pixels, grid = vision_lib.blank_image(self.model)
        images = None if pixels is None else (pixels.to(self.device), grid.to(self.device), where.to(self.device))
        return out.to(self.device), images

    def _forward_shared(self, batch: Batch, idx: np.ndarray, temperature: float, with_entropy: bool):
        """:meth:`_forward` with ``share_prompt``: one row of units (a prompt, then the
        continuation of every sample of ``idx`` that starts with it; see
        :mod:`chatlearn.models.trainer.shared_prompt`), each token at the position it has in its
        own sample. Same return."""
        off, plen, tokens = batch["offsets"], batch["prompt_lens"], batch["tokens"]
        pieces, positions, cols, prev, pos, layout_units = [], [], [], [], [], []
        start = 0
        routes = [] if self._replaying(batch) else None  # (row 0, col, routes): the prompt's are its first sample's
        for members in shared_prompt.group_by_prompt(batch, idx):
            p = int(plen[members[0]])
            a = int(off[members[0]])
            unit = shared_prompt.Unit(start, p, [])
            if routes is not None:
                routes.append((0, start, moe_layout.decode(batch["routed_experts"][a:a + p])))
            pieces.append(np.asarray(tokens[a:a + p]))
            positions.append(np.arange(p))
            start += p
            for i in members:
                a, b = int(off[i]), int(off[i + 1])
                n = b - a - p
                resp = response_positions(batch, i)  # sample positions (>= p) of the model's tokens
                col = start + resp - p
                cols.append(col)
                prev.append(np.where(resp > p, col - 1, unit.start + p - 1))
                pos.append(a + resp)
                if n:
                    unit.conts.append((start, n))
                    if routes is not None:
                        routes.append((0, start, moe_layout.decode(batch["routed_experts"][a + p:b])))
                    pieces.append(np.asarray(tokens[a + p:b]))
                    positions.append(np.arange(p, p + n))
                start += n
            layout_units.append(unit)
        ids = torch.from_numpy(np.concatenate(pieces).astype(np.int64))[None].to(self.device)
        position_ids = torch.from_numpy(np.concatenate(positions).astype(np.int64))[None].to(self.device)
        cols_t = torch.from_numpy(np.concatenate(cols)).to(self.device)
        self._set_routes(tuple(ids.shape), routes)
        # a 4-D mask is taken as given (transformers builds none); the layout is the real mask
        no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        if self._moe_recording:
            self.moe.begin(None)
        pos = np.concatenate(pos)
        logp, entropy = self.model.token_logprobs(
            ids, no_mask, position_ids, torch.zeros_like(cols_t), cols_t, float(temperature),
            int(self.spec.logprob_chunk_tokens), self._rows_mode(with_entropy, pos),
            prev_cols=torch.from_numpy(np.concatenate(prev)).to(self.device),
            layout=shared_prompt.build_layout(layout_units, start, self.device))
        return logp, entropy, pos

    def _replaying(self, batch: Batch) -> bool:
        """Whether this forward replays the rollout's routes: an MoE model with ``routing_replay: rollout``
        and a batch that carries ``routed_experts``."""
        return self.routing is not None and "routed_experts" in batch

    def _set_routes(self, shape: tuple, routes: list | None) -> None:
        """The routers' replay target for the micro-batch of ``input_ids`` shape ``shape`` (``routes``:
        ``(row, col, routes)`` of its samples' tokens), or their own routing (``routes`` None)."""
        if self.routing is not None:
            self.routing.set_target(None if routes is None else
                                    micro_batch_target(shape, self.routing.layout, routes, self.device))

    def compute_grads(self, batch: Batch, temperature: float = 1.0) -> dict:
        """:meth:`Trainer.compute_grads`; with routing replay also ``moe/routing_agreement``: the share of the
        recorded top-k choices of the step's tokens that the routers, in the training forward, made
        themselves (counted over every rank)."""
        if not self._replaying(batch):
            return super().compute_grads(batch, temperature)
        self.routing.reset_agreement()
        metrics = super().compute_grads(batch, temperature)
        counts = torch.tensor(self.routing.agreement(), dtype=torch.float64, device=self.device)
        dist.all_reduce(counts)
        agree, slots = counts.tolist()
        metrics["moe/routing_agreement"] = agree / slots if slots else 1.0
        self.routing.set_target(None)
        self.routing.reset_agreement(count=False)
        return metrics

    def _fixed_width(self, batch: Batch) -> int | None:
        """``seq_length`` (unpacked micro-batches padded to exactly that width) or None; a sample
        longer than it is an error naming the key."""
        width = self.spec.seq_length
        if width is None or self.spec.packing:
            return None
        return check_fixed_width(np.diff(batch["offsets"]), int(width))

    def _micro_batches(self, batch: Batch, size: int) -> tuple[list[np.ndarray], dict]:
        """This rank's micro-batches (sample indices) and the pass's stats.

        Without packing: ``size`` samples each, longest first. With packing: first-fit-decreasing
        bins of at most ``max_token_in_packing`` tokens (``size`` is ignored); see
        :mod:`chatlearn.models.trainer.packing`. Every rank must run the same number of
        micro-steps (each forward/backward is a sequence of FSDP collectives); every rank
        holds the full batch, so each computes every rank's plan (deterministic, no
        collective) and runs ``max over ranks`` micro-steps, the missing ones as dummy
        micro-steps (empty index arrays: a 1-token forward whose loss is an empty sum, 0,
        so its backward adds zero gradients). Returns ``(micro_batches, {"pad_token_frac",
        "micro_steps"})``.
        """
        self._my_samples(batch)  # validates the batch
        n = len(batch["offsets"]) - 1
        share = n // self.world
        shares = [np.arange(r * share, (r + 1) * share) for r in range(self.world)]
        if self.share_prompt:
            plans, stats = plan_shared_micro_batches(
                np.diff(batch["offsets"]), np.asarray(batch["prompt_lens"]), shared_prompt.prompt_group_ids(batch),
                shares, size, bool(self.spec.packing), int(self.spec.max_token_in_packing))
            return plans[self.rank], stats
        plans, stats = plan_micro_batches(np.diff(batch["offsets"]), shares, size,
                                          bool(self.spec.packing),
                                          int(self.spec.max_token_in_packing), self._fixed_width(batch))
        return plans[self.rank], stats

    def _all_gather_tokens(self, batch: Batch, values: torch.Tensor) -> np.ndarray:
        """values: [T, ...] (float32, or the top-k ids' int32) filled on this rank's token range -> the full
        [T, ...] from all."""
        off, n = batch["offsets"], len(batch["offsets"]) - 1
        share = n // self.world
        bounds = [(int(off[r * share]), int(off[(r + 1) * share])) for r in range(self.world)]
        width = max(hi - lo for lo, hi in bounds)
        lo, hi = bounds[self.rank]
        mine = values.new_zeros((width, *values.shape[1:]))
        mine[:hi - lo] = values[lo:hi]
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine)
        out = np.zeros((int(off[-1]), *values.shape[1:]), dtype=mine.cpu().numpy().dtype)
        for (lo, hi), part in zip(bounds, parts):
            out[lo:hi] = part[:hi - lo].cpu().numpy()
        return out

    # ------------------------------------------------------------------ log-probs
    def _logprob_pass(self, batch: Batch, micro_batches: list[np.ndarray], temperature: float,
                      with_entropy: bool):
        """This rank's micro-batches one forward after another (:meth:`_forward`), their values
        put at their token positions, then gathered from all ranks (``_all_gather_tokens``)."""
        total = int(batch["offsets"][-1])
        logp_all = torch.zeros(total, dtype=torch.float32, device=self.device)
        # [T] (entropy, agreement), or a tuple of [T, ...] (a teacher's top-k: made at the first micro-step)
        ent_all = torch.zeros_like(logp_all) if with_entropy and not isinstance(with_entropy, TeacherTopK) else None
        for mb in micro_batches:
            logp, ent, pos = self._forward(batch, mb, temperature, with_entropy)
            pos_t = torch.from_numpy(pos).to(self.device)
            logp_all[pos_t] = logp
            if with_entropy:
                ent_all = _put_rows(ent_all, ent, pos_t, total)
        self._reshard()
        logp_np = self._all_gather_tokens(batch, logp_all)
        if not with_entropy:
            return logp_np
        if isinstance(ent_all, tuple):
            return logp_np, tuple(self._all_gather_tokens(batch, e) for e in ent_all)
        return logp_np, self._all_gather_tokens(batch, ent_all)

    # ------------------------------------------------------------------ training
    def _accumulate_grads(self, batch: Batch, objective, temperature: float) -> tuple:
        """This rank's micro-batches one forward + backward after another; the gradients end in
        ``param.grad`` (sharded DTensors, already averaged over ranks). Each micro-batch
        backpropagates ``sum(c * per_token) * W``, so the averaged sum is d(loss)/d(theta).

        Gradient accumulation: FSDP2 reduce-scatters after every micro-batch's backward and
        adds the result into the sharded ``.grad`` (as verl does). Skipping the sync
        (``set_requires_gradient_sync(False)``) would save those collectives but keep a full
        unsharded gradient per rank, which defeats sharding. Every rank runs the same number
        of micro-steps (equal shares; with packing, dummy micro-steps make up the difference:
        see ``_micro_batches``), so the collectives line up.
        """
        # sums over this rank's tokens, named by objective.SUMS
        sums = torch.zeros(len(objective.SUMS), dtype=torch.float64, device=self.device)
        micro, passes = self._micro_batches(batch, self.spec.train_micro_batch_size)
        moe = self.moe if self.spec.role != "critic" else None
        if moe is not None:
            moe.reset_step()
        for mb in micro:
            self._moe_recording = moe is not None
            try:
                logp, ent, pos = self._forward(batch, mb, temperature, objective.with_entropy)
            finally:
                self._moe_recording = False
            terms, coef, weight = objective.terms(logp, ent, pos)
            loss = (terms["loss"] * coef).sum() * self.world
            aux = moe.end(len(micro)) if moe is not None else None
            if aux is not None:  # the router's losses (coeff x sum over layers), averaged over this rank's
                loss = loss + aux  # micro-steps here and over the ranks by FSDP's reduce-scatter
            loss.backward()
            sums += objective.token_sums(terms, coef, weight, ent)
        self._reshard()
        if moe is not None:
            passes = {**passes, **moe.step_metrics(self.device)}
        return sums, passes

    def _optimizer_steps(self) -> int:
        """Optimizer steps taken so far: Adam's step count (restored with the optimizer state
        on resume, so the learning-rate schedule continues where it was)."""
        for state in self.optimizer.state.values():
            if "step" in state:
                return int(state["step"])
        return 0

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _clip_and_step(self, loss: float) -> tuple[bool, float]:
        """The global norm of the gradients of all ranks (``clip_grad_norm_`` over the sharded
        gradients, a collective), the gradients clipped by it, and ``optimizer.step()`` when
        :func:`.base.step_is_finite`. ``loss`` is all-reduced and the norm is global, so every
        rank decides alike."""
        max_norm = float(self.spec.clip_grad)
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        stepped = step_is_finite(loss, float(norm))
        if stepped:
            self.optimizer.step()
        return stepped, float(norm)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Unsharded gradients on the CPU by parameter name (a collective; for tests)."""
        out = {}
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                out[name] = g.detach().to("cpu", torch.float32, copy=True)
        return out

    def zero_grad(self) -> None:
        """Drop the gradients (``param.grad = None``)."""
        for p in self.model.parameters():
            p.grad = None

    # ------------------------------------------------------------------ residency
    def _part_tensors(self, part: str) -> list[torch.Tensor]:
        if part == Part.WEIGHTS:
            return list(self.model.parameters())
        if self.optimizer is None:
            return []
        return [v for state in self.optimizer.state.values() for k, v in state.items()
                if k != "step" and torch.is_tensor(v)]

    def offload(self, parts: Iterable[str]) -> dict:
        """Free the device storage of ``weights`` (the local shards) and ``optimizer``
        (exp_avg, exp_avg_sq), keeping a host copy; ``grads`` are dropped (set to None).
        Parts already offloaded are skipped. Returns {"bytes": bytes copied to the host}."""
        parts = self._check_parts(parts)
        if Part.GRADS in parts:
            self.zero_grad()
        self._reshard()
        moved = self._stash_parts(parts)
        release_device_memory(self.device)
        return {"bytes": moved}

    def onload(self, parts: Iterable[str]) -> dict:
        """Restore offloaded parts bit for bit. Returns {"bytes": bytes copied back}."""
        parts = self._check_parts(parts)
        return {"bytes": self._unstash_parts(parts)}

    # ------------------------------------------------------------------ weights out
    def weight_specs(self) -> list[tuple[str, str, tuple, int]]:
        """``(hf_name, "float32", full shape, group)`` of every exported parameter, in the
        order of ``export_tensors`` (the same on every rank; no collective). Each parameter is
        its own group. Only parameters are exported (no buffers); a tied ``lm_head.weight`` is
        not listed: it is the input embedding's parameter, exported under
        ``model.embed_tokens.weight``. With LoRA: the merged weights under the base model's names
        (:meth:`export_tensors`). A vision-language model's frozen vision tower (``freeze_vision_tower``) is not
        listed: the rollout's copy is the same (both loaded from the same folder), and a push leaves it."""
        if self.merged is not None:
            params = dict(self.model.named_parameters())
            return [(e.name, "float32", tuple(params[e.param].shape), i) for i, e in enumerate(self.merged.entries)
                    if not self._frozen_vision(e.name)]
        pushed = [(name, p) for name, p in self.model.named_parameters() if not self._frozen_vision(name)]
        return [(name, "float32", tuple(p.shape), i) for i, (name, p) in enumerate(pushed)]

    def _frozen_vision(self, name: str) -> bool:
        """Whether ``name`` is a parameter of a vision tower that does not train (``freeze_vision_tower``)."""
        return self.vlm and bool(self.spec.freeze_vision_tower) and vision_lib.is_vision_param(name)

    @torch.no_grad()
    def export_tensors(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``(name, full float32 tensor on rank 0, None elsewhere)`` for the parameters named,
        in ``weight_specs`` order, gathered one at a time (``full_tensor``: a collective, every
        rank must iterate to the end with the same names). Each full tensor is dropped by this
        generator before the next is gathered, so a rank holds at most one beyond its shards."""
        self._require_weights()
        self._reshard()
        if self.merged is not None:  # LoRA: W + B @ A x alpha / rank per layer, the live weights untouched
            for name, full in self.merged.iterate(dict(self.model.named_parameters()), names, _full_tensor):
                yield name, (full if self.rank == 0 else None)
                del full
            return
        wanted = set(names)
        for name, p in self.model.named_parameters():
            if name not in wanted:
                continue
            full = p.full_tensor() if isinstance(p, DTensor) else p
            yield name, (full.detach().float() if self.rank == 0 else None)
            del full

    def adapter_specs(self) -> list[tuple[str, str, tuple, int]]:
        """LoRA: ``(peft name, dtype, full shape, group)`` of every trained tensor (the adapters and the
        copies of ``modules_to_save``), the names of ``peft.get_peft_model_state_dict``; [] without
        adapters. No collective."""
        return [(lora_lib.adapter_name(n), sharded.dtype_name(p.dtype), tuple(p.shape), i)
                for i, (n, p) in enumerate(lora_lib.trained_params(self.model))] if self.peft is not None else []

    @torch.no_grad()
    def export_adapter(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """LoRA: ``(peft name, full tensor on rank 0, None elsewhere)`` of every trained tensor, in
        ``adapter_specs`` order (a collective, as :meth:`export_tensors`)."""
        self._require_weights()
        self._reshard()
        for n, p in (lora_lib.trained_params(self.model) if self.peft is not None else []):
            full = _full_tensor(p).detach()
            yield lora_lib.adapter_name(n), (full if self.rank == 0 else None)
            del full

    def push_view(self):
        """What the weight push sends (``chatlearn.runtime.weight_push.stream``): this trainer's merged or
        full weights, or with LoRA and ``lora.push: adapters`` the trained tensors alone and the manifest
        the rollout merges them by (:class:`~chatlearn.models.trainer.lora.AdapterPush`)."""
        if self.merged is None or self.spec.lora.push != "adapters":
            return self

        def prepare() -> None:
            self._require_weights()
            self._reshard()

        if self._push_renames is None:  # the base folder's names the model loads otherwise (a VLM's), once
            base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
            self._push_renames = checkpoint_renames(base, HFCheckpoint(self.spec.load).names())
        return lora_lib.AdapterPush(self.merged, lambda: dict(self.model.named_parameters()), _full_tensor,
                                    prepare, self.rank, self.device, self.spec.load, self._push_renames)

    def save_hf(self, path: str) -> None:
        """Write a Hugging Face folder at ``path`` (rank 0 writes; a collective): weights,
        config, and the other files of the ``load`` folder (tokenizer, chat template). The
        critic's is a token-classification folder with one label (``save_pretrained``), which
        ``AutoModelForTokenClassification.from_pretrained`` and this trainer load as is. With LoRA
        the merged weights, in float32 (the base's bfloat16 copy plus the adapters' update, not rounded
        back to bfloat16), and ``config.json`` says float32."""
        self._require_weights()
        self._reshard()
        if self.merged is not None:  # LoRA: the merged weights under the base model's names
            state = {n: t.cpu() if t is not None else None
                     for n, t in self.export_tensors(self.merged.names())}
        else:
            state = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            self.model.save_pretrained(path, state_dict=state)
            if self.merged is not None:  # float32 merged weights, whatever the base is stored in
                _set_config_dtype(path, "float32")
            src = self.spec.load
            for name in os.listdir(src):
                file = os.path.join(src, name)
                if (os.path.isfile(file) and name not in _WRITTEN_BY_SAVE
                        and not name.endswith(_WEIGHT_SUFFIXES)):
                    shutil.copy2(file, os.path.join(path, name))
        dist.barrier()

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_state(self, with_optimizer: bool) -> dict:
        """The sharded state that checkpoints hold: ``{"model": {name: DTensor}}`` plus,
        ``with_optimizer``, ``"optimizer"`` (keyed by parameter name). The tensors are the
        live shards (no copies); tied aliases are left out (stored once, under the first
        name). For an optimizer without state, ``get_state_dict`` creates it with one
        zero-gradient step at lr 0 (the parameters do not change). With LoRA only the trained tensors
        (the base comes from ``load`` again).
        """
        options = StateDictOptions(ignore_frozen_params=self.peft is not None)
        if not with_optimizer:
            state = {sharded.MODEL_KEY: get_model_state_dict(self.model, options=options)}
        else:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
            state = {sharded.MODEL_KEY: model_sd, sharded.OPTIMIZER_KEY: optim_sd}
        for alias in sharded.tied_aliases(self.model):
            state[sharded.MODEL_KEY].pop(alias, None)
        return state

    def save_checkpoint(self, path: str) -> None:
        """Write the model and optimizer shards, this rank's RNG states and the trainer
        metadata into the folder ``path`` (see ``chatlearn.checkpoint.sharded``).

        A collective: every rank calls it with the same path, on a file system all ranks
        share. Rank 0 writes the ``.complete`` marker last, once every rank has finished;
        making the folder appear atomically (temporary name, rename) is the caller's part.
        Weights and optimizer must be onloaded.
        """
        self._require_onloaded("save_checkpoint")
        rng = sharded.capture_rng_state(self.device)  # before anything that could draw
        self._reshard()
        if self.trainable:
            self._require_finite_weights((p.to_local() if isinstance(p, DTensor) else p
                                          for p in self.model.parameters()), path)
        os.makedirs(path, exist_ok=True)
        if self.rank == 0:
            sharded.clear_complete(path)
        # An optimizer that has not stepped yet has no state: only the model is saved then
        # (creating the state here would change the first step's Adam bias correction).
        stepped = self.optimizer is not None and bool(self.optimizer.state)
        state = self._checkpoint_state(with_optimizer=stepped)
        try:
            dcp.save(state, checkpoint_id=path)
            sharded.save_rng_state(path, self.rank, rng)
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            # a full disk: the OSError (DCP's writer may have lost it), named by the driver
            refused = None if isinstance(err, KeyboardInterrupt) else sharded.refused_write(path, err)
            if refused is not None:
                raise refused from None
            raise
        if self.rank == 0:
            tensors = {name: {"shape": list(t.shape), "dtype": sharded.dtype_name(t.dtype)}
                       for name, t in state[sharded.MODEL_KEY].items()}
            sharded.write_meta(path, {
                "world_size": self.world,
                "trainable": self.trainable,
                "role": self.spec.role,
                "has_optimizer": self.optimizer is not None,
                "optimizer_stepped": stepped,
                "hf_source": (os.path.abspath(self.spec.load) if os.path.isdir(self.spec.load)
                              else self.spec.load),
                "trust_remote_code": bool(self.spec.trust_remote_code),
                "hf_config": json.loads(self.model.config.to_json_string(use_diff=False)),
                "tensors": tensors,
                "tied": sharded.tied_aliases(self.model),
                "torch_version": torch.__version__,
                "lora": (lora_lib.json_record(self.spec.lora, self.spec.load) if self.peft is not None
                         else None),
            })
        dist.barrier()
        if self.rank == 0:
            sharded.mark_complete(path)
        dist.barrier()  # on every rank, a return means the checkpoint is complete

    def load_checkpoint(self, path: str) -> None:
        """Restore a checkpoint written by ``save_checkpoint``, with any number of ranks
        (DCP reshards). The model state, the optimizer state (when trainable) and the RNG
        states are restored; pending gradients are dropped. With the world size it was saved
        with, rank r gets rank r's RNG states back; otherwise those of rank r mod N.

        A collective. Weights and optimizer must be onloaded. A missing, incomplete or
        mismatched checkpoint raises a UserError on every rank before any collective.
        """
        self._require_onloaded("load_checkpoint")
        meta = sharded.read_meta(path)
        critic = self.spec.role == "critic"
        if "role" in meta and (meta["role"] == "critic") != critic:
            raise UserError(f"checkpoint {path!r} was saved by a {meta['role']} model, which cannot resume "
                            f"as a {self.spec.role} (the critic has a value head, the policy an LM head). "
                            f"Load a checkpoint of the {'critic' if critic else 'policy trainer'}.")
        if self.optimizer is not None and not meta.get("has_optimizer"):
            raise UserError(f"checkpoint {path!r} holds no optimizer state (it was saved by a "
                            "frozen reference model), so a trainable model cannot resume from "
                            f"it. Load a checkpoint of the {'critic' if critic else 'policy trainer'}.")
        if self.trainable:
            problem = lora_lib.resume_problem(meta.get("lora"), self.spec.lora, self.spec.load)
            if problem is not None:
                raise UserError(f"checkpoint {path!r} cannot resume this run: {problem}.",
                                key="models.policy_trainer.lora")
        problem = moe_lib.expert_count_problem(path, meta.get("hf_config"), self.model, self.spec.load)
        if problem is not None:
            raise UserError(problem, key=self._config_key("load"))
        rng = sharded.load_rng_state(path, self.rank % int(meta["world_size"]))
        reader = sharded.SafeFileSystemReader(path)
        reader.read_metadata()  # DCP's metadata: a UserError now if damaged (then cached)
        self._reshard()
        self._check_checkpoint_tensors(path, meta,
                                       self._checkpoint_state(False)[sharded.MODEL_KEY])
        # Pending gradients would stop get_state_dict from creating the optimizer state
        # that the checkpoint is loaded into.
        self.zero_grad()
        with_optimizer = self.optimizer is not None and bool(meta.get("optimizer_stepped"))
        state = self._checkpoint_state(with_optimizer)
        try:
            dcp.load(state, storage_reader=reader, planner=sharded.SafeLoadPlanner())
        except UserError:
            raise
        except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 - a shard's bytes changed in place
            # (DCP's CheckpointException is a BaseException: it carries each rank's torch.load error)
            raise UserError(damaged_shards(path, err)) from None
        model_sd = state[sharded.MODEL_KEY]
        for alias, name in sharded.tied_aliases(self.model).items():
            if name in model_sd:  # (LoRA: frozen tied weights are not in the checkpoint)
                model_sd[alias] = model_sd[name]
        options = StateDictOptions(ignore_frozen_params=self.peft is not None, strict=self.peft is None)
        if with_optimizer:
            set_state_dict(self.model, self.optimizer, model_state_dict=model_sd,
                           optim_state_dict=state[sharded.OPTIMIZER_KEY], options=options)
        else:
            set_model_state_dict(self.model, model_sd, options=options)
            if self.optimizer is not None:  # saved before the first step: no state yet
                self.optimizer.state.clear()
        sharded.restore_rng_state(rng, self.device)

    @staticmethod
    def _check_checkpoint_tensors(path: str, meta: dict, model_sd: dict) -> None:
        """Same tensor names and shapes in the checkpoint as in this model, or a UserError."""
        saved = meta["tensors"] if "tensors" in meta else {}
        problems = [f"{name} is missing from the checkpoint" for name in model_sd
                    if name not in saved]
        problems += [f"{name} is in the checkpoint but not in this model" for name in saved
                     if name not in model_sd]
        problems += [f"{name} has shape {list(model_sd[name].shape)} in this model but "
                     f"{saved[name]['shape']} in the checkpoint" for name in model_sd
                     if name in saved and list(model_sd[name].shape) != saved[name]["shape"]]
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise UserError(f"checkpoint {path!r} does not fit this model: "
                            f"{'; '.join(problems[:3])}{more}. Load a checkpoint saved from "
                            f"the same model (it was saved from {meta.get('hf_source')!r}).")
