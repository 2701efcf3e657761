"""What each backend receives: one typed, frozen spec, built once from the validated config.

The schema (``chatlearn/config/schema.py``) is the only place a default lives. Each spec is built by
its ``from_config`` from the validated config, once per model (``chatlearn.runtime.cluster.cluster``), with
every field set; the spec has no defaults of its own, so a missing setting fails where the spec
is built, not in the middle of a run. Settings that depend on the device the backend lands on
(``device``, ``dtype: auto``, ``bf16: null``, ``deterministic_inference: null``) are resolved by
:func:`resolve_for_device` inside the worker process, where the device is known.

The backends keep their spec (``self.spec``) and read its fields as attributes (``spec.lr``), and
so do the loss functions of ``chatlearn.algorithms`` they hand it to. A spec is no mapping: a
setting is never looked up by a string, so a misspelt name fails where it is read (and a linter
or type checker sees it), and there is no default to fall back on. A changed copy is
``spec.replace(name=value)``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Optional

from omegaconf import OmegaConf

from chatlearn.config.kinds import kind_of, reward_model_settings
from chatlearn.config.model_shapes import model_context_length
from chatlearn.config.plan import resolve_schedule
from chatlearn.config.reward_entries import resolve_entries
from chatlearn.config.schema import Judge

DTYPES = ("float32", "bfloat16", "float16")


class _Spec:
    """What every spec has besides its fields: :meth:`replace`."""

    def replace(self, **changes):
        """A copy with the given fields changed (``dataclasses.replace``: unknown names raise)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class LoraSpec(_Spec):
    """``models.policy_trainer.lora`` with rank > 0: the adapters the FSDP trainer trains
    (``chatlearn/models/trainer/lora.py``)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: object  # "all-linear" or a tuple of module-name suffixes
    modules_to_save: tuple
    push: str  # "adapters" or "merged": what the weight push sends

    @classmethod
    def from_config(cls, lora) -> "LoraSpec | None":
        """None for rank 0 (no adapters)."""
        if lora.rank <= 0:
            return None
        targets = lora.target_modules
        return cls(rank=int(lora.rank), alpha=float(lora.alpha), dropout=float(lora.dropout),
                   target_modules=targets if isinstance(targets, str) else tuple(str(t) for t in targets),
                   modules_to_save=tuple(str(m) for m in lora.modules_to_save), push=str(lora.push))


@dataclass(frozen=True)
class MoeSpec(_Spec):
    """A trainer section's MoE keys (``chatlearn/models/trainer/moe.py`` acts on them in the FSDP trainer) (``chatlearn/config/schema.py`` ``TrainerModel``), as the trainers read them."""

    aux_loss_coeff: Optional[float]  # None: config.json's router_aux_loss_coef
    z_loss_coeff: float
    force_load_balancing: bool
    layer_recompute: bool
    groupgemm: bool
    token_dispatcher_type: str
    shared_expert_overlap: bool
    expert_model_parallel_size: int
    expert_tensor_parallel_size: Optional[int]

    @classmethod
    def from_config(cls, t) -> "MoeSpec":
        """From a trainer section ``t`` of the validated config."""
        return cls(aux_loss_coeff=None if t.moe_aux_loss_coeff is None else float(t.moe_aux_loss_coeff),
                   z_loss_coeff=float(t.moe_z_loss_coeff),
                   force_load_balancing=bool(t.moe_router_force_load_balancing),
                   layer_recompute=bool(t.moe_layer_recompute), groupgemm=bool(t.groupgemm),
                   token_dispatcher_type=str(t.moe_token_dispatcher_type),
                   shared_expert_overlap=bool(t.moe_shared_expert_overlap),
                   expert_model_parallel_size=int(t.expert_model_parallel_size),
                   expert_tensor_parallel_size=(None if t.expert_tensor_parallel_size is None
                                                else int(t.expert_tensor_parallel_size)))


# models.*.recompute_granularity as the config spells it -> as megatron-core does
RECOMPUTE = {None: None, "full": "full", "sel": "selective", "selective": "selective"}


def resolve_policy_loss(t) -> str:
    """The policy loss ``models.policy_trainer`` (``t``) trains with: ``policy_loss``, or with it null ``gspo``
    where ``use_group_sequence_policy`` is set (GSPO's switch before the policy losses had names) and ``vanilla``
    elsewhere."""
    if t.policy_loss is not None:
        return t.policy_loss
    return "gspo" if t.use_group_sequence_policy else "vanilla"


@dataclass(frozen=True)
class TrainerSpec(_Spec):
    """``policy_trainer`` / ``ref_policy`` on the FSDP2 or Megatron backend."""

    load: str
    trust_remote_code: bool
    seed: int
    trainable: bool
    # policy (the policy trainer: an LM head, the PPO/GRPO loss) | reference (frozen, log-probs) |
    # critic (a scalar value head on the backbone, the clipped value loss of chatlearn.algorithms.value_loss)
    role: str
    # optimizer (read when trainable)
    lr: float
    weight_decay: float
    clip_grad: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    # learning-rate schedule, its iters resolved to optimizer steps of the run
    min_lr: float
    lr_decay_style: str
    lr_warmup_iters: int
    lr_decay_iters: int
    lr_warmup_init: float
    # batches
    train_micro_batch_size: int
    logprob_micro_batch_size: int
    train_global_batch_size: int
    packing: bool
    max_token_in_packing: int
    seq_length: Optional[int]  # fixed width of unpacked micro-batches (Megatron's seq_length); None: the longest sample
    logprob_chunk_tokens: int  # tokens per chunk of the [tokens, vocab] log-prob/entropy computation
    share_prompt: Optional[bool]  # FSDP: samples sharing a prompt compute it once; None: where the model allows
    # loss
    pos_clip_ratio: float
    neg_clip_ratio: float
    clip_ratio_c: Optional[float]
    # the policy loss's name in chatlearn.config.registry.POLICY_LOSSES (resolved: use_group_sequence_policy is gspo)
    policy_loss: str
    loss_agg_mode: str
    max_response_tokens_length: int
    kl_coef: float
    kl_estimator: str
    kl_in_reward: bool
    entropy_coef: float
    old_logprobs: str  # auto | recompute | rollout
    rollout_correction: str  # resolved by the plan: none | tis | mis | decoupled
    rollout_correction_level: str
    rollout_is_threshold: float
    rollout_is_threshold_lower: Optional[float]
    # critic (role critic): the value loss value_loss_coef x max((V - R)^2, (clip(V, V_old +- cliprange_value) - R)^2)
    cliprange_value: Optional[float]  # None: no clipping
    value_loss_coef: float
    # memory and precision
    gradient_checkpointing: bool
    freeze_vision_tower: bool  # a vision-language model's vision tower keeps its weights (chatlearn/models/vision.py)
    # Megatron's activation recomputation: full | selective; None: full where gradient_checkpointing, else none
    recompute_granularity: Optional[str]
    bf16: Optional[bool]  # None: bf16 on CUDA devices that support it, fp32 elsewhere
    meta_init: bool
    # Megatron parallelism (the FSDP backend shards data-parallel only)
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    sequence_parallel: bool
    use_distributed_optimizer: bool
    lora: Optional[LoraSpec]  # policy_trainer's adapters (models.policy_trainer.lora); None: full fine-tuning
    moe: MoeSpec  # the section's MoE keys (read where the model has experts)
    # runtime_args.plugins and the directory they are found from (the driver's): the worker imports them before it
    # builds the backend, so that a plugged policy loss or KL estimator is registered where the loss runs
    plugins: tuple
    plugins_dir: str
    # models.policy_trainer.routing_replay (off | rollout): every forward of an MoE model routes the tokens to
    # the experts the rollout recorded (the batch's routed_experts; chatlearn/models/moe), the reference's too
    routing_replay: str
    # algorithm: gkd (models.policy_trainer.gkd_beta / gkd_temperature): the generalized JSD's beta and temperature
    gkd_beta: float
    gkd_temperature: float
    device: Optional[str] = None  # set in the worker: "cuda" | "cpu"

    @classmethod
    def from_config(cls, cfg, name: str, plan) -> "TrainerSpec":
        """The spec of ``policy_trainer`` or ``ref_policy`` from the validated config: the model's own
        keys, the policy trainer's optimizer and loss options (the reference model shares the
        backend), and the learning-rate schedule's iters resolved against the run's optimizer steps
        (``plan``: the run's :class:`~chatlearn.config.plan.Plan`, from ``load_run``)."""
        if kind_of(cfg, name).role == "teacher":
            return cls.teacher_from_config(cfg, name, plan)
        t, rt, pt = cfg.models[name], cfg.runtime_args, cfg.models.policy_trainer
        critic = name == "critic"
        opt = t.optimizer if critic else pt.optimizer  # the critic's own (each key inherits the policy's)
        # the critic trains every episode; the policy none of the critic's warm-up ones
        warmup, decay = resolve_schedule(opt.lr_warmup_iters, opt.lr_warmup_fraction, opt.lr_decay_iters,
                                         plan.total_steps if critic else plan.policy_steps)
        return cls(
            load=t.load, trust_remote_code=t.trust_remote_code, seed=t.seed, trainable=t.trainable,
            role=kind_of(cfg, name).role, cliprange_value=cfg.models.critic.cliprange_value,
            value_loss_coef=cfg.models.critic.value_loss_coef,
            lr=opt.lr, weight_decay=opt.weight_decay, clip_grad=opt.clip_grad, adam_beta1=opt.adam_beta1,
            adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps, min_lr=opt.min_lr,
            lr_decay_style=opt.lr_decay_style, lr_warmup_iters=warmup, lr_decay_iters=decay,
            lr_warmup_init=opt.lr_warmup_init, train_micro_batch_size=t.train_micro_batch_size,
            logprob_micro_batch_size=t.generation_batch_size, train_global_batch_size=rt.train_global_batch_size,
            packing=t.packing, max_token_in_packing=t.max_token_in_packing, seq_length=t.seq_length,
            logprob_chunk_tokens=t.logprob_chunk_tokens,
            share_prompt=False if rt.train_backend == "megatron" else t.share_prompt, pos_clip_ratio=t.pos_clip_ratio,
            neg_clip_ratio=t.neg_clip_ratio, clip_ratio_c=pt.clip_ratio_c,
            policy_loss=resolve_policy_loss(pt), loss_agg_mode=pt.loss_agg_mode,
            max_response_tokens_length=cfg.models.policy.max_response_tokens_length, kl_coef=t.kl_coef,
            kl_estimator=pt.kl_estimator, kl_in_reward=pt.kl_in_reward, entropy_coef=t.entropy_coef,
            old_logprobs=pt.old_logprobs, rollout_correction=plan.rollout_correction,
            rollout_correction_level=pt.rollout_correction_level, rollout_is_threshold=pt.rollout_is_threshold,
            rollout_is_threshold_lower=pt.rollout_is_threshold_lower,
            gradient_checkpointing=t.gradient_checkpointing, bf16=t.bf16, meta_init=t.meta_init,
            freeze_vision_tower=t.freeze_vision_tower, recompute_granularity=RECOMPUTE[t.recompute_granularity],
            tensor_model_parallel_size=t.tensor_model_parallel_size,
            pipeline_model_parallel_size=t.pipeline_model_parallel_size, sequence_parallel=t.sequence_parallel,
            use_distributed_optimizer=t.use_distributed_optimizer,
            lora=LoraSpec.from_config(pt.lora) if name == "policy_trainer" else None, moe=MoeSpec.from_config(t),
            plugins=tuple(rt.plugins), plugins_dir=os.getcwd(), routing_replay=pt.routing_replay,
            gkd_beta=pt.gkd_beta, gkd_temperature=pt.gkd_temperature)

    @classmethod
    def teacher_from_config(cls, cfg, name: str, plan) -> "TrainerSpec":
        """The spec of teacher ``name`` (``models.<name>``, kind teacher): its own model, devices, batches and
        precision; frozen (no optimizer, no adapters, no routing replay: its experts route the student's tokens
        its own way); the loss fields, which it never reads, the policy trainer's."""
        t = cfg.models[name]
        return cls.from_config(cfg, "policy_trainer", plan).replace(
            load=t.load, trust_remote_code=t.trust_remote_code, seed=t.seed, trainable=False, role="teacher",
            logprob_micro_batch_size=t.generation_batch_size, packing=t.packing,
            max_token_in_packing=t.max_token_in_packing, seq_length=None, logprob_chunk_tokens=t.logprob_chunk_tokens,
            share_prompt=None, gradient_checkpointing=False, bf16=t.bf16, meta_init=t.meta_init,
            recompute_granularity=None, tensor_model_parallel_size=t.tensor_model_parallel_size,
            pipeline_model_parallel_size=t.pipeline_model_parallel_size, lora=None, routing_replay="off")


@dataclass(frozen=True)
class RolloutSpec(_Spec):
    """``policy`` on the vLLM, SGLang or transformers backend."""

    load: str
    trust_remote_code: bool
    seed: int
    generation_batch_size: int  # max concurrent sequences (vLLM max_num_seqs; hf: sequences per call)
    max_prompt_tokens_length: int
    max_response_tokens_length: int
    seq_length: Optional[int]  # the engine's tokens per sequence, prompt + response; None: their two maxima summed
    max_num_batched_tokens: int
    dtype: str  # "auto" until resolved in the worker, then one of DTYPES
    gpu_memory_utilization: float
    kv_cache: str  # "fit" | "utilization"
    enforce_eager: bool
    tensor_model_parallel_size: int
    # vLLM: > 1 shards whole experts over the engine's ranks (enable_expert_parallel; equal to
    # tensor_model_parallel_size, checked by the plan); hf / SGLang: not read (warned at start)
    expert_model_parallel_size: int
    deterministic_inference: Optional[bool]  # None until resolved: on for CPU, off on CUDA
    cpu_threads: Optional[int]  # torch threads of a CPU engine (None: leave as is)
    # models.policy_trainer.routing_replay: rollout makes the engine record each token's routed experts (the
    # batch's routed_experts column) for the trainers to replay
    routing_replay: str
    # models.policy.max_images_per_prompt: vLLM's limit_mm_per_prompt for a vision-language model (hf: not read)
    max_images_per_prompt: int
    device: Optional[str] = None  # set in the worker: "cuda" | "cpu"

    @classmethod
    def from_config(cls, cfg) -> "RolloutSpec":
        """The spec of ``policy`` (the rollout engine) from the validated config; ``dtype: auto`` and
        ``deterministic_inference: null`` are resolved in the worker, where the device is known."""
        p = cfg.models.policy
        return cls(
            load=p.load, trust_remote_code=p.trust_remote_code, seed=p.seed,
            generation_batch_size=p.generation_batch_size, max_prompt_tokens_length=p.max_prompt_tokens_length,
            max_response_tokens_length=p.max_response_tokens_length, seq_length=p.seq_length,
            max_num_batched_tokens=p.max_num_batched_tokens,
            dtype=p.dtype, gpu_memory_utilization=p.gpu_memory_utilization, kv_cache=p.kv_cache,
            enforce_eager=p.enforce_eager,
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            expert_model_parallel_size=p.expert_model_parallel_size,
            deterministic_inference=p.deterministic_inference, cpu_threads=None,
            routing_replay=cfg.models.policy_trainer.routing_replay,
            max_images_per_prompt=p.max_images_per_prompt)


@dataclass(frozen=True)
class RewardSpec(_Spec):
    """``reward``: the reward functions as explicit entries (name, path, weight, kwargs; when
    ``models.reward.functions`` is empty, the built-in math reward alone, or none with a multi-turn
    environment), the directory relative paths start
    from, and the time limit of one function call."""

    functions: tuple  # of dicts: name, path, weight, kwargs
    base_dir: str
    timeout_s: float  # 0: no limit

    @classmethod
    def from_config(cls, cfg) -> "RewardSpec":
        """Relative paths start from the driver's working directory."""
        entries = resolve_entries(OmegaConf.to_container(cfg.models.reward, resolve=True),
                                  with_environment=cfg.models.policy.multi_turn.environment is not None)
        return cls(functions=tuple(entries), base_dir=os.getcwd(), timeout_s=float(cfg.models.reward.timeout_s))


@dataclass(frozen=True)
class RewardModelSpec(_Spec):
    """A reward model (``models.reward.load``, or a model of kind reward_model): a sequence-classification
    model that scores each conversation (the prompt's messages and the response), rendered with its own
    tokenizer and chat template, on its ``num_gpu`` devices (FSDP2, inference only)."""

    load: str
    trust_remote_code: bool
    seed: int
    micro_batch_size: int  # conversations per forward on one rank
    max_length: int  # the longest conversation in the reward model's tokens (its context); longer is an error
    bf16: Optional[bool]  # None: bf16 on CUDA devices that support it, fp32 elsewhere
    device: Optional[str] = None  # set in the worker: "cuda" | "cpu"

    @classmethod
    def from_config(cls, cfg, name: str) -> "RewardModelSpec":
        """The spec of reward model ``name`` (chatlearn.config.kinds.reward_model_settings)."""
        r = reward_model_settings(cfg, name)
        limit = model_context_length(r.load) or 1 << 30
        return cls(load=r.load, trust_remote_code=r.trust_remote_code, seed=r.seed,
                   micro_batch_size=r.micro_batch_size, max_length=limit, bf16=r.bf16)


def checkpoint_dtype(model_dir: str) -> str:
    """The dtype a model folder's ``config.json`` declares (``torch_dtype`` or ``dtype``), as
    one of :data:`DTYPES`; float32 when it declares none."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        conf = json.load(f)
    found = str(conf["torch_dtype"] if "torch_dtype" in conf else conf["dtype"] if "dtype" in conf
                else "float32").replace("torch.", "")
    return found if found in DTYPES else "float32"


def _cuda_bf16() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def resolve_for_device(spec, device: str):
    """``spec`` with its device-dependent settings fixed for ``device`` ("cuda" | "cpu").

    * ``device``: set.
    * rollout ``dtype: auto``: bfloat16 on a CUDA device that supports it; elsewhere the dtype
      the checkpoint declares (float32 when it declares none; a bfloat16 checkpoint on a GPU
      without bf16 runs in float16).
    * trainer ``bf16: null``: on for a CUDA device that supports bf16, off otherwise.
    * rollout ``deterministic_inference: null``: on for CPU (it costs nothing there and keeps
      runs reproducible), off on CUDA (per-request seeds and batch-invariant kernels cost
      throughput; set it to true for reproducible samples).
    """
    changes: dict = {"device": device}
    cuda = device == "cuda"
    if isinstance(spec, RolloutSpec):
        if spec.dtype == "auto":
            dtype = "bfloat16" if cuda and _cuda_bf16() else checkpoint_dtype(spec.load)
            if cuda and dtype == "bfloat16" and not _cuda_bf16():
                dtype = "float16"
            changes["dtype"] = dtype
        if spec.deterministic_inference is None:
            changes["deterministic_inference"] = not cuda
    elif isinstance(spec, (TrainerSpec, RewardModelSpec)):
        if spec.bf16 is None:
            changes["bf16"] = bool(cuda and _cuda_bf16())
    return dataclasses.replace(spec, **changes)


@dataclass(frozen=True)
class JudgeSpec(_Spec):
    """An LLM judge (a model of kind judge): a causal LM on a rollout backend (``backend``: hf | vllm) that
    reads prompts the driver rendered from its ``prompt_template`` and replies with a verdict (generated with
    ``temperature``, at most ``max_verdict_tokens``), and with ``want_probs`` the probability of ``yes_word``'s
    first token against ``no_word``'s at the reply's first position."""

    name: str  # its section: models.<name>
    load: str
    trust_remote_code: bool
    seed: int
    backend: str
    apply_chat_template: bool
    temperature: float
    max_verdict_tokens: int
    max_prompt_tokens_length: int
    generation_batch_size: int
    dtype: str
    gpu_memory_utilization: float
    yes_word: str
    no_word: str
    want_probs: bool  # parser yes_prob: the probability is read (and nothing is generated)

    @classmethod
    def from_config(cls, cfg, name: str) -> "JudgeSpec":
        j = cfg.models[name]
        return cls(name=name, load=j.load, trust_remote_code=bool(j.trust_remote_code), seed=int(j.seed),
                   backend=j.backend, apply_chat_template=bool(j.apply_chat_template),
                   temperature=float(j.temperature), max_verdict_tokens=int(j.max_verdict_tokens),
                   max_prompt_tokens_length=int(j.max_prompt_tokens_length),
                   generation_batch_size=int(j.generation_batch_size), dtype=j.dtype,
                   gpu_memory_utilization=float(j.gpu_memory_utilization), yes_word=j.yes_word,
                   no_word=j.no_word, want_probs=j.parser == "yes_prob")

    @classmethod
    def for_folder(cls, load: str, parser: str = "yes_no", max_verdict_tokens: int = 16,
                   batch_size: int = 64) -> "JudgeSpec":
        """A judge of the folder ``load`` with the schema's defaults (tools and tests)."""
        d = Judge()
        return cls(name="judge", load=load, trust_remote_code=False, seed=0, backend=d.backend,
                   apply_chat_template=d.apply_chat_template, temperature=d.temperature,
                   max_verdict_tokens=max_verdict_tokens, max_prompt_tokens_length=d.max_prompt_tokens_length,
                   generation_batch_size=batch_size, dtype=d.dtype,
                   gpu_memory_utilization=d.gpu_memory_utilization, yes_word=d.yes_word, no_word=d.no_word,
                   want_probs=parser == "yes_prob")

    def rollout_spec(self) -> RolloutSpec:
        """The spec of the rollout engine the judge runs on (its device settings unresolved)."""
        return RolloutSpec(load=self.load, trust_remote_code=self.trust_remote_code, seed=self.seed,
                           generation_batch_size=self.generation_batch_size,
                           max_prompt_tokens_length=self.max_prompt_tokens_length,
                           max_response_tokens_length=max(1, self.max_verdict_tokens), seq_length=None,
                           max_num_batched_tokens=max(8192, self.max_prompt_tokens_length + self.max_verdict_tokens),
                           dtype=self.dtype, gpu_memory_utilization=self.gpu_memory_utilization, kv_cache="fit",
                           enforce_eager=True,
                           tensor_model_parallel_size=1, expert_model_parallel_size=1,
                           deterministic_inference=None, cpu_threads=None, routing_replay="off",
                           max_images_per_prompt=1)  # a judge reads text: not read
