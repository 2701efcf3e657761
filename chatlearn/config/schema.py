"""The configuration schema: the one place where defaults live.

Key names and meanings follow ChatLearn's GRPO YAML (``runtime_args`` plus
``models.{policy,policy_trainer,ref_policy,reward}``), so an existing ChatLearn config loads
unchanged. Keys that matter only on GPUs (Megatron parallelism, CUDA allocator flags, ...)
are accepted and validated even where this build does not act on them.

A default may be an interpolation such as ``${models.policy_trainer.load}``: the value
then follows the key it names unless the user sets it.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, OmegaConf

from chatlearn.config import registry

TRAIN_BACKENDS = registry.TRAIN_BACKENDS.names  # declared in chatlearn.config.registry
ROLLOUT_BACKENDS = registry.ROLLOUT_BACKENDS.names


@dataclass
class LogArgs:
    log_dir: str = "${runtime_args.output_dir}"
    enable_tensorboard: bool = False
    tensorboard_dir: Optional[str] = None  # None: <log_dir>/tensorboard
    enable_wandb: bool = False
    wandb_dir: Optional[str] = None  # None: <log_dir>/wandb
    wandb_project: Optional[str] = None
    wandb_id: Optional[str] = None
    wandb_name: Optional[str] = None
    wandb_resume: str = "allow"
    # every N episodes, log_samples_num of the episode's prompt/response/reward rows go to
    # <output_dir>/samples.jsonl and to TensorBoard (text) and W&B (a table); 0 turns it off
    log_samples_interval: int = 10
    log_samples_num: int = 4


@dataclass
class RuntimeArgs:
    # setup
    train_backend: str = "fsdp"  # fsdp | megatron
    rollout_backend: str = "vllm"  # vllm | sglang | hf
    exp_name: str = "chatlearn"
    colocation: List[str] = field(default_factory=list)  # models sharing devices, taking turns
    concurrent_setup: bool = False  # accepted; models are set up one after another
    debug: bool = False  # show full tracebacks for user errors
    nsys: bool = False  # GPU profiling switch (accepted, not used on CPU)
    seed: int = 1234  # data order; model seeds default to it
    # The user's modules that register advantage estimators, policy losses and KL estimators of their own
    # (chatlearn.plugins): module names (my_pkg.my_rl, found from the directory chatlearn runs from and PYTHONPATH)
    # or files (path/to/my_rl.py, relative to that directory); imported in the driver before validation and in
    # every trainer process before it builds its model
    plugins: List[str] = field(default_factory=list)
    # paths
    output_dir: str = MISSING
    profiler_dir: Optional[str] = None
    data_path: str = MISSING  # comma-separated files or folders (jsonl / parquet)
    eval_data_path: Optional[str] = None
    data_checkpoint_path: Optional[str] = None
    # training
    num_episode: int = MISSING
    sample_per_episode: int = MISSING  # samples (prompts x num_inference_per_prompt) per episode
    num_training_epoch: int = 1  # passes over an episode's samples
    train_micro_batch_size: int = 8  # samples per forward/backward on one trainer rank
    train_global_batch_size: int = MISSING  # samples per optimizer step, all ranks together
    save_episode_interval: int = 0  # save a checkpoint every N episodes (0: only at the end)
    enable_resume_training: bool = True  # continue from the newest complete checkpoint in output_dir
    keep_last_checkpoints: int = 3  # 0 keeps all
    # data
    data_ratio: List[int] = field(default_factory=list)
    data_shuffle: bool = True
    prompt_key: str = "${models.policy.vllm_prompt_key}"  # data column holding the prompt (text or chat messages)
    ground_truth_key: Optional[str] = "reward_model.ground_truth"  # dotted path in a row; null: no ground truth
    ground_truth_pattern: Optional[str] = None  # regex applied to the ground truth; its first group (or match) is kept
    prompt_instruction: Optional[str] = None  # appended (after a space) to each prompt's last user message
    data_subset: Optional[str] = None  # Hub dataset ids in data_path: the subset/config (datasets' name), e.g. main
    data_split: str = "train"  # Hub dataset ids in data_path: the split to train on
    eval_data_subset: Optional[str] = "${runtime_args.data_subset}"  # as data_subset, for eval_data_path
    eval_data_split: str = "test"  # as data_split, for eval_data_path
    data_rerank: bool = True  # spread the samples of one prompt over rollout replicas
    max_replay_episode: int = 0  # also train on the samples of up to N earlier episodes (-1: all)
    # DAPO dynamic sampling: sample more prompts while fewer than the episode's prompts have groups of
    # unequal rewards; at most dynamic_sampling_max_rounds rounds of prompts_per_episode prompts each
    dynamic_sampling: bool = False
    dynamic_sampling_max_rounds: int = 10
    # asynchronous rollouts (rollout and trainer on different devices): the rollout of the next N episodes
    # runs while an episode trains; no sample trained on is more than N weight versions old (0: on-policy)
    max_staleness: int = 0
    # multi-turn: stop the run after N training episodes in a row in which the environment, or a tool,
    # failed on every call (raised, timed out or returned something unusable); 0: never stop
    max_failed_env_episodes: int = 3
    # warn (once per run) when a reward function gives every sample of N training episodes in a row the
    # same score: a reward with no signal to learn from; 0: never warn
    max_constant_reward_episodes: int = 3
    replay_episode_offset: int = 0
    consumed_samples: int = 0
    max_data_ckpt_nums: Optional[int] = None
    load_data_checkpoint_iteration: Optional[int] = None
    stream_data_loader_type: str = "fixed"
    # eval
    eval_episode_interval: int = 0  # 0: no periodic eval
    enable_eval_before_training: bool = False
    # weight sync
    bucket_size_mb_in_memory_manager: int = 1024
    coalesced_buffer_mb: int = 100  # size of one weight-push bucket, in MB
    # The rollout engine in the trainer's processes (one process per device holds a trainer rank and a
    # rollout replica; the weight push is a copy within the process). null: where it can be (policy
    # colocated with policy_trainer, one replica per trainer rank, an engine that runs in the trainer's
    # process: hf, vLLM's CPU build); true: required; false: separate processes
    fuse_rollout: Optional[bool] = None
    # Every model of the run in the driver's own process, without Ray: where all but the reward
    # workers live in one process on this machine (one trainer rank with its fused rollout replica, or
    # an evaluation's one rollout replica; no RAY_ADDRESS). The reward workers stay processes of their
    # own. null: where it can be; true: required; false: Ray always
    single_process: Optional[bool] = None
    # Without a GPU (logical devices), colocated models keep every part in memory between turns
    # (host memory is all there is: moving frees nothing); true: they move as on GPUs.
    offload_without_gpu: bool = False
    concurrent_comm: bool = True
    param_sync_comm_type: str = "broadcast"
    param_sync_max_workers: Optional[int] = None
    routed_expert_regrouping_comm_type: str = "alltoall"
    free_sync_collective_group: bool = False
    cpu_schedule_strategy: str = "SPREAD"
    validate_param_sync: bool = False
    policy_to_regroup_queue: str = "global_barrier"
    ray_connect_timeout_s: float = 30.0  # with RAY_ADDRESS: seconds to wait for the cluster to answer
    # the deadline of a stage on the workers: max(this, 5 x the longest that stage has taken); 0: none
    stage_timeout_s: float = 600.0
    # after every weight push, every rollout replica's log-probs of a fixed probe are compared with the
    # trainer's: a push that did not land stops the run (chatlearn/runtime/driver/landing.py)
    weight_push_check: bool = True
    # the largest gap allowed (nats); null: by precision (float32 0.01, float16 0.25, bfloat16 0.5)
    weight_push_check_tolerance: Optional[float] = None
    # logging
    log_args_dict: LogArgs = field(default_factory=LogArgs)


@dataclass
class FreeGpuMemory:
    offload_weights: bool = False
    offload_optimizer_states: bool = False
    free_grad_buffers: bool = False


@dataclass
class ModelBase:
    # the kind of model (chatlearn/config/kinds.py): fixed for today's names (policy: rollout, policy_trainer:
    # trainer, ref_policy: reference, critic: critic, reward: reward); a model of the user's naming sets it
    kind: str = MISSING
    num_gpu: int = 0
    num_cpu: int = 0
    gpu_per_process: Optional[int] = None
    cpu_per_process: Optional[int] = None
    trainable: bool = False
    load: Optional[str] = None  # Hugging Face model folder, or Hub model id (org/name, org/name@revision)
    hub_id: Optional[str] = None  # written by chatlearn: the Hub id load was resolved from, pinned (org/name@commit)
    trust_remote_code: bool = False
    seed: int = "${runtime_args.seed}"  # type: ignore[assignment]
    generation_batch_size: int = 1
    packing: bool = False
    max_token_in_packing: int = 32768
    sync_frequency: int = 1
    free_gpu_memory: FreeGpuMemory = field(default_factory=FreeGpuMemory)
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    # derived values in ChatLearn; accepted, and checked against the computed plan
    num_replica: Optional[int] = None
    replica_dp_size: Optional[int] = None


@dataclass
class Optimizer:
    lr: float = 2e-6
    min_lr: float = 0.0
    clip_grad: float = 1.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    # learning-rate schedule (Megatron's names; chatlearn.algorithms.lr_schedule)
    lr_decay_style: str = "constant"  # constant | linear | cosine
    lr_warmup_iters: int = 0  # optimizer steps of linear warmup; > 0 wins over lr_warmup_fraction
    lr_warmup_fraction: float = 0.0  # warmup as a share of the run's optimizer steps
    lr_warmup_init: float = 0.0  # lr at the start of the warmup
    lr_decay_iters: Optional[int] = None  # None: the run's optimizer steps (num_episode x steps per episode)
    # a step whose loss or gradient norm is not finite is skipped; this many in a row stop the run
    max_nonfinite_steps: int = 3


@dataclass
class TrainerModel(ModelBase):
    """policy_trainer and ref_policy (they share the training backend)."""

    optimizer: Optimizer = field(default_factory=Optimizer)
    train_micro_batch_size: int = "${runtime_args.train_micro_batch_size}"  # type: ignore[assignment]
    pos_clip_ratio: float = 0.2
    neg_clip_ratio: float = 0.2
    diff_clip_ratio: float = 10.0
    final_clip_ratio: float = 3.0
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    use_group_sequence_policy: bool = False  # GSPO: sequence-level importance ratio
    # vanilla (PPO's clipped surrogate, token ratio) | gspo (sequence ratio) | a plugged name (runtime_args.plugins);
    # null: gspo with use_group_sequence_policy, else vanilla
    policy_loss: Optional[str] = None
    clip_ratio_c: Optional[float] = None  # dual clip bound (> 1) for negative advantages; None: off
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
    kl_estimator: str = "k3"  # k1 | k2 | k3 | low_var_kl
    kl_in_reward: bool = False  # subtract kl_coef * KL from the reward instead of a KL loss term
    advantage_estimator: str = "grpo"  # grpo | dr_grpo | rloo | reinforce_plus_plus | gae (PPO with models.critic)
    filter_equal_groups: bool = False  # drop groups whose rewards are all equal from the loss
    bf16: Optional[bool] = None  # bf16 compute, fp32 master weights; null: on for CUDA devices with bf16, off on CPU
    logprob_chunk_tokens: int = 1024  # tokens per chunk when log-probs/entropy are computed from [tokens, vocab] logits
    # FSDP
    fsdp_size: Optional[int] = None  # defaults to num_gpu
    ulysses_sequence_parallel_size: int = 1
    meta_init: bool = False  # FSDP: build on the meta device, rank 0 reads the checkpoint and broadcasts the shards
    # FSDP: the samples of a micro-batch that start with the same prompt (a GRPO group) compute it once
    # (same log-probs and gradients). null: on where it can be (FSDP backend, a model whose attention
    # goes through transformers' AttentionInterface, plain full attention, no fixed seq_length); false: off.
    share_prompt: Optional[bool] = None
    groupgemm: bool = False  # MoE: the experts as grouped GEMMs instead of one matmul per expert
    gradient_checkpointing: bool = True
    # vision-language models: the vision tower (and its merger) keeps its weights; false: it trains with the rest
    freeze_vision_tower: bool = True
    save_hf: bool = True
    use_expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in this model's workers
    # Unpacked micro-batches are padded to exactly this many tokens (fixed shapes, as Megatron's
    # seq_length; at least the policy's longest sequence); null: to the micro-batch's longest sample.
    # Ignored with packing (a warning says so).
    seq_length: Optional[int] = None
    # Megatron
    tokenizer_type: str = "HuggingFaceTokenizer"
    tokenizer_model: Optional[str] = None
    virtual_pipeline_model_parallel_size: Optional[int] = None
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    # Mixture of experts (docs/config.md, "Mixture of experts"; chatlearn/config/moe_keys.py): read where the model
    # has experts (Qwen3-MoE, Qwen2-MoE); set on a dense model, refused
    moe_token_dispatcher_type: str = "alltoall"  # alltoall | allgather: how tokens reach other expert-parallel ranks
    moe_aux_loss_coeff: Optional[float] = None  # the router's load-balancing loss; null: config.json's router_aux_loss_coef
    moe_z_loss_coeff: float = 0.0  # the router's z-loss (mean squared log-sum-exp of its logits); 0: off
    moe_router_force_load_balancing: bool = False  # benchmarks only: tokens spread evenly over the experts, not routed
    moe_layer_recompute: bool = False  # the MoE layers recomputed in backward (activation memory for compute)
    moe_shared_expert_overlap: bool = False  # shared experts computed while tokens are dispatched (alltoall)
    save: Optional[str] = None
    save_interval: int = 10000
    log_interval: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    recompute_granularity: Optional[str] = None
    train_iters: int = 10000


@dataclass
class Lora:
    """``models.policy_trainer.lora``: low-rank adapters (peft's LoRA) instead of full fine-tuning (FSDP trainer;
    chatlearn/models/trainer/lora.py). rank 0: off."""

    rank: int = 0  # r of the adapters; 0: no adapters, every weight is trained
    alpha: float = 16.0  # the update is B @ A x alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input; only 0 is accepted (it would act in training forwards alone)
    # module-name suffixes that get adapters (q_proj, v_proj, ...), or the string all-linear (every linear layer
    # but the output head), as peft's LoraConfig.target_modules
    target_modules: Any = "all-linear"
    modules_to_save: List[str] = field(default_factory=list)  # modules trained in full (e.g. embed_tokens, lm_head)
    # what the weight push sends: adapters (A, B and the modules_to_save copies; the rollout merges them onto
    # the base weights it reads from the base folder) or merged (every weight, W + B @ A x alpha / rank)
    push: str = "adapters"


@dataclass
class PolicyTrainer(TrainerModel):
    kind: str = "trainer"
    # the algorithm (chatlearn/config/algorithms.py): grpo | ppo | one a plugin registers; null: inferred from
    # advantage_estimator (gae: ppo, else grpo). Set without advantage_estimator, it trains with its own (ppo: gae)
    algorithm: Optional[str] = None
    lora: Lora = field(default_factory=Lora)
    trainable: bool = True
    num_gpu: int = 1
    gpu_per_process: Optional[int] = 1
    generation_batch_size: int = 8
    free_gpu_memory: FreeGpuMemory = field(
        default_factory=lambda: FreeGpuMemory(True, True, True))
    # Where the PPO ratio's old log-probs come from. auto: the first optimizer step of an episode
    # trains with the weights that generated its samples, so its own forward (detached) gives them,
    # and the separate pass covers only the samples of the later steps (none with one step per
    # episode); the pass covers every sample where the math needs it first (num_training_epoch > 1,
    # max_replay_episode != 0, kl_in_reward). recompute: the pass over every sample, always.
    # rollout: no pass; the rollout engine's log-probs are the old log-probs of every step.
    old_logprobs: str = "auto"  # auto | recompute | rollout
    # correction of the rollout engine's (behaviour) vs the trainer's (proximal) probabilities:
    # auto | none | tis | mis | decoupled (auto: none while the rollouts come from the current weights)
    rollout_correction: str = "auto"
    rollout_correction_level: str = "token"  # token | sequence | geometric: where rho is formed
    rollout_is_threshold: float = 2.0  # C: tis caps rho at C; mis and decoupled mask rho > C
    rollout_is_threshold_lower: Optional[float] = None  # mis: masks rho below it; null: 1 / rollout_is_threshold
    # advantage_estimator: gae (PPO): the discount and the GAE lambda of the per-token advantages, and whether
    # they are whitened over the episode's response tokens (the returns, the critic's targets, never are)
    gamma: float = 1.0
    lam: float = 1.0
    whiten_advantages: bool = True
    # MoE: off | rollout (the experts the rollout engine chose for each response token are recorded and every
    # trainer forward of those samples, the reference's included, routes them the same; chatlearn/models/moe)
    routing_replay: str = "off"
    # algorithm: opd (on-policy distillation with a model of kind teacher): each response token's advantage is
    # distill_coef x (teacher log-prob - student log-prob of the sampled token) plus the task reward's group advantage
    distill_coef: float = 1.0
    # algorithm: gkd (generalized knowledge distillation, TRL's GKD on the student's samples): the loss is the
    # generalized JSD between the student's and the teacher's next-token distributions at gkd_temperature, beta 0:
    # forward KL(teacher || student), 1: reverse KL(student || teacher); over the teacher's distill_topk most likely
    # tokens and the rest (null: the whole vocabulary)
    gkd_beta: float = 0.5
    gkd_temperature: float = 1.0
    distill_topk: Optional[int] = None
    # algorithm: gkd: the on-policy fraction (TRL's lmbda): each episode, with this probability, drawn from
    # (runtime_args.seed, episode), trains on the student's samples, otherwise on the dataset's own responses (each
    # prompt row's last, assistant message); 1: the student's samples only
    gkd_lambda: float = 1.0


@dataclass
class RefPolicy(TrainerModel):
    kind: str = "reference"
    num_gpu: int = "${models.policy_trainer.num_gpu}"  # type: ignore[assignment]
    gpu_per_process: Optional[int] = 1
    load: Optional[str] = "${models.policy_trainer.load}"
    generation_batch_size: int = 8
    packing: bool = "${models.policy_trainer.packing}"  # type: ignore[assignment]
    max_token_in_packing: int = "${models.policy_trainer.max_token_in_packing}"  # type: ignore[assignment]
    seq_length: Optional[int] = "${models.policy_trainer.seq_length}"  # type: ignore[assignment]
    share_prompt: Optional[bool] = "${models.policy_trainer.share_prompt}"  # type: ignore[assignment]
    free_gpu_memory: FreeGpuMemory = field(default_factory=lambda: FreeGpuMemory(True, False, False))
    # MoE: routed as the policy trainer routes (seed 004's reference keeps them equal)
    expert_model_parallel_size: int = "${models.policy_trainer.expert_model_parallel_size}"  # type: ignore[assignment]
    expert_tensor_parallel_size: Optional[int] = (  # type: ignore[assignment]
        "${models.policy_trainer.expert_tensor_parallel_size}")
    moe_token_dispatcher_type: str = "${models.policy_trainer.moe_token_dispatcher_type}"  # type: ignore[assignment]
    moe_router_force_load_balancing: bool = (  # type: ignore[assignment]
        "${models.policy_trainer.moe_router_force_load_balancing}")
    groupgemm: bool = "${models.policy_trainer.groupgemm}"  # type: ignore[assignment]


def _from_policy_trainer(key: str):
    """The default of a critic key: the policy trainer's value of the same key (seed 000's role override)."""
    return f"${{models.policy_trainer.{key}}}"


@dataclass
class CriticOptimizer(Optimizer):
    """``models.critic.optimizer``: each key the policy trainer's unless set here."""

    lr: float = _from_policy_trainer("optimizer.lr")  # type: ignore[assignment]
    min_lr: float = _from_policy_trainer("optimizer.min_lr")  # type: ignore[assignment]
    clip_grad: float = _from_policy_trainer("optimizer.clip_grad")  # type: ignore[assignment]
    weight_decay: float = _from_policy_trainer("optimizer.weight_decay")  # type: ignore[assignment]
    adam_beta1: float = _from_policy_trainer("optimizer.adam_beta1")  # type: ignore[assignment]
    adam_beta2: float = _from_policy_trainer("optimizer.adam_beta2")  # type: ignore[assignment]
    adam_eps: float = _from_policy_trainer("optimizer.adam_eps")  # type: ignore[assignment]
    lr_decay_style: str = _from_policy_trainer("optimizer.lr_decay_style")  # type: ignore[assignment]
    lr_warmup_iters: int = _from_policy_trainer("optimizer.lr_warmup_iters")  # type: ignore[assignment]
    lr_warmup_fraction: float = _from_policy_trainer("optimizer.lr_warmup_fraction")  # type: ignore[assignment]
    lr_warmup_init: float = _from_policy_trainer("optimizer.lr_warmup_init")  # type: ignore[assignment]
    lr_decay_iters: Optional[int] = _from_policy_trainer("optimizer.lr_decay_iters")  # type: ignore[assignment]
    max_nonfinite_steps: int = _from_policy_trainer("optimizer.max_nonfinite_steps")  # type: ignore[assignment]


@dataclass
class CriticFreeGpuMemory(FreeGpuMemory):
    offload_weights: bool = _from_policy_trainer("free_gpu_memory.offload_weights")  # type: ignore[assignment]
    offload_optimizer_states: bool = _from_policy_trainer(  # type: ignore[assignment]
        "free_gpu_memory.offload_optimizer_states")
    free_grad_buffers: bool = _from_policy_trainer("free_gpu_memory.free_grad_buffers")  # type: ignore[assignment]


@dataclass
class Critic(TrainerModel):
    """``models.critic``: the value model of PPO (``advantage_estimator: gae``), a scalar value head on the
    backbone of ``load`` (the policy's by default), trained by the training backend. Every trainer key it
    does not set is the policy trainer's (optimizer, schedule, parallel sizes, precision, memory, devices);
    a key it sets wins."""

    kind: str = "critic"
    trainable: bool = True
    num_gpu: int = _from_policy_trainer("num_gpu")  # type: ignore[assignment]
    gpu_per_process: Optional[int] = _from_policy_trainer("gpu_per_process")  # type: ignore[assignment]
    load: Optional[str] = _from_policy_trainer("load")  # type: ignore[assignment]
    trust_remote_code: bool = _from_policy_trainer("trust_remote_code")  # type: ignore[assignment]
    generation_batch_size: int = _from_policy_trainer("generation_batch_size")  # type: ignore[assignment]
    packing: bool = _from_policy_trainer("packing")  # type: ignore[assignment]
    max_token_in_packing: int = _from_policy_trainer("max_token_in_packing")  # type: ignore[assignment]
    train_micro_batch_size: int = _from_policy_trainer("train_micro_batch_size")  # type: ignore[assignment]
    seq_length: Optional[int] = _from_policy_trainer("seq_length")  # type: ignore[assignment]
    share_prompt: Optional[bool] = _from_policy_trainer("share_prompt")  # type: ignore[assignment]
    fsdp_size: Optional[int] = None  # the critic's own num_gpu (the only FSDP size there is)
    meta_init: bool = _from_policy_trainer("meta_init")  # type: ignore[assignment]
    gradient_checkpointing: bool = _from_policy_trainer("gradient_checkpointing")  # type: ignore[assignment]
    bf16: Optional[bool] = _from_policy_trainer("bf16")  # type: ignore[assignment]
    logprob_chunk_tokens: int = _from_policy_trainer("logprob_chunk_tokens")  # type: ignore[assignment]
    use_expandable_segments: bool = _from_policy_trainer("use_expandable_segments")  # type: ignore[assignment]
    save_hf: bool = _from_policy_trainer("save_hf")  # type: ignore[assignment]
    tensor_model_parallel_size: int = _from_policy_trainer("tensor_model_parallel_size")  # type: ignore[assignment]
    pipeline_model_parallel_size: int = _from_policy_trainer("pipeline_model_parallel_size")  # type: ignore[assignment]
    sequence_parallel: bool = _from_policy_trainer("sequence_parallel")  # type: ignore[assignment]
    use_distributed_optimizer: bool = _from_policy_trainer("use_distributed_optimizer")  # type: ignore[assignment]
    recompute_granularity: Optional[str] = _from_policy_trainer("recompute_granularity")  # type: ignore[assignment]
    expert_model_parallel_size: int = _from_policy_trainer("expert_model_parallel_size")  # type: ignore[assignment]
    expert_tensor_parallel_size: Optional[int] = _from_policy_trainer(  # type: ignore[assignment]
        "expert_tensor_parallel_size")
    moe_token_dispatcher_type: str = _from_policy_trainer("moe_token_dispatcher_type")  # type: ignore[assignment]
    groupgemm: bool = _from_policy_trainer("groupgemm")  # type: ignore[assignment]
    optimizer: Optimizer = field(default_factory=CriticOptimizer)
    free_gpu_memory: FreeGpuMemory = field(default_factory=CriticFreeGpuMemory)
    # the value loss: value_loss_coef x max((V - R)^2, (clip(V, V_old +- cliprange_value) - R)^2) per token,
    # aggregated by loss_agg_mode (verl's critic: 0.5 and 0.5); cliprange_value null: no clipping
    cliprange_value: Optional[float] = 0.5
    value_loss_coef: float = 0.5
    # the first N episodes train the critic alone (the policy is not updated; no weight push)
    warmup_episodes: int = 0


@dataclass
class ToolEntry:
    """One entry of ``models.policy.multi_turn.tools`` (contract: chatlearn/env/tools.py)."""

    name: str = MISSING  # what the model calls it (in the tool-call JSON's "name")
    path: str = MISSING  # builtin:calculator | package.module:function | path/to/file.py:function
    description: Optional[str] = None  # null: the first paragraph of the function's docstring
    parameters: Optional[Dict[str, Any]] = None  # JSON schema of the arguments; null: from the signature
    kwargs: Dict[str, Any] = field(default_factory=dict)  # fixed keyword arguments of the function
    normalize: str = "none"  # none | batch (its score whitened over the episode's samples before x weight)


@dataclass
class MultiTurn:
    """``models.policy.multi_turn``: rollouts that alternate model turns and environment steps
    (chatlearn/env, docs/multiturn.md). ``environment`` null: single-turn (prompt -> response)."""

    environment: Optional[str] = None  # builtin:tools | package.module:Class | path/to/file.py:Class
    environment_kwargs: Dict[str, Any] = field(default_factory=dict)  # keyword arguments of its constructor
    tools: List[ToolEntry] = field(default_factory=list)  # the tools of builtin:tools (and its subclasses)
    tool_parser: str = "hermes"  # hermes (<tool_call> JSON) | package.module:function | path/to/file.py:function
    max_tool_calls_per_turn: int = 4  # builtin:tools: calls beyond it in one turn get an error result
    max_turns: int = 4  # model turns per trajectory
    max_turn_tokens: Optional[int] = None  # new tokens per model turn; null: max_response_tokens_length
    # the tokens of one observation at most (longer ones are shortened); every token after the prompt,
    # the model's and the observations', counts against max_response_tokens_length
    max_observation_tokens: int = 256
    observation_role: str = "user"  # the role of an observation given as a string
    step_timeout_s: float = 60.0  # seconds one reset or step may take; past it the trajectory ends
    num_workers: int = 8  # environment calls running at once (threads on the driver)
    reward_discount: float = 1.0  # the trajectory's environment reward: sum over turns t of discount^t r_t


@dataclass
class Policy(ModelBase):
    """The rollout engine (vLLM, SGLang or transformers)."""

    kind: str = "rollout"
    num_gpu: int = "${models.policy_trainer.num_gpu}"  # type: ignore[assignment]
    gpu_per_process: Optional[int] = 1
    load: Optional[str] = "${models.policy_trainer.load}"
    generation_batch_size: int = 256  # max concurrent sequences in the engine
    num_inference_per_prompt: int = 32  # responses sampled per prompt (the GRPO group)
    eval_num_inference_per_prompt: int = "${models.policy.num_inference_per_prompt}"  # type: ignore[assignment]
    max_prompt_tokens_length: int = 1024  # longer prompts are dropped from the data
    # vision-language models: the most images one prompt may hold (a row with more is refused at load; vLLM's
    # limit_mm_per_prompt)
    max_images_per_prompt: int = 4
    max_response_tokens_length: int = 2048  # max new tokens per response
    # the engine's tokens per sequence, prompt + response (vLLM max_model_len, SGLang context_length):
    # a response stops at seq_length - its prompt's length; null: max_prompt + max_response tokens
    seq_length: Optional[int] = None
    max_new_tokens: Optional[int] = None  # legacy alias of max_response_tokens_length
    max_seq_len_to_capture: int = 2348
    max_num_batched_tokens: int = 32768
    dtype: str = "auto"  # auto (bfloat16 on CUDA devices with bf16, else the checkpoint's) | float32 | bfloat16 | float16
    # reproducible sampling: per-request seeds (vLLM), batch-invariant kernels (SGLang); null: on for CPU, off on CUDA
    deterministic_inference: Optional[bool] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    eval_temperature: float = 0.6
    eval_top_p: float = 0.95
    eval_top_k: int = 20
    eval_presence_penalty: float = 0.0
    eval_frequency_penalty: float = 0.0
    eval_repetition_penalty: float = 1.0
    enable_thinking: bool = False
    logprob_mismatch_warn: float = 0.05  # warn when mean |rollout - trainer log-prob| exceeds it (0: never)
    vllm_prompt_key: str = "prompt"
    vllm_input_ids_key: str = "input_ids"
    enable_stage_resume: bool = False
    gpu_memory_utilization: float = 0.8
    # KV cache of vLLM / SGLang. fit: generation_batch_size sequences of seq_length tokens (all of an
    # episode's sequences in flight, no more; capped on CUDA by what gpu_memory_utilization leaves
    # beside the weights); utilization: whatever gpu_memory_utilization leaves (the engines' own sizing)
    kv_cache: str = "fit"  # fit | utilization
    enforce_eager: bool = False
    free_gpu_memory: FreeGpuMemory = field(default_factory=lambda: FreeGpuMemory(True, False, False))
    multi_turn: MultiTurn = field(default_factory=MultiTurn)


@dataclass
class RewardFunction:
    """One entry of ``models.reward.functions`` (contract: chatlearn/models/reward/functions.py)."""

    name: str = MISSING  # names its metrics: train/reward/<name>/<key>
    path: str = MISSING  # builtin:math | package.module:function | path/to/file.py:function
    weight: float = 1.0
    kwargs: Dict[str, Any] = field(default_factory=dict)  # fixed keyword arguments of the function


@dataclass
class Reward(ModelBase):
    kind: str = "reward"
    num_cpu: int = 2
    cpu_per_process: Optional[int] = 1
    generation_batch_size: int = 256
    correct_score: float = 1.0  # builtin:math: reward of a correct boxed answer
    incorrect_score: float = 0.0  # builtin:math: reward otherwise
    # rewards combined by weight (sum of weight x score); empty: builtin:math alone, or with a multi-turn
    # environment (models.policy.multi_turn.environment) none: the environment's reward alone
    functions: List[RewardFunction] = field(default_factory=list)
    timeout_s: float = 600.0  # seconds a reward worker may take to score its share of a batch (0: no limit)
    # DAPO overlong reward shaping: a penalty ramping from 0 to -overlong_penalty_factor over the last
    # overlong_buffer_len tokens of models.policy.max_response_tokens_length (0: off)
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    # A reward model (load: a sequence-classification model folder or Hub id; null: none) scores each prompt and
    # response on num_gpu devices of its own (or of its colocation group: name reward in runtime_args.colocation),
    # rendered with its own tokenizer and chat template; its score x model_weight is added to the functions'.
    model_weight: float = 1.0
    model_normalize: str = "none"  # none | batch (whitened over the episode's samples: zero mean, unit std)
    model_micro_batch_size: int = 16  # conversations per forward on one device
    bf16: Optional[bool] = None  # null: bf16 on CUDA devices that support it, fp32 on CPU
    free_gpu_memory: FreeGpuMemory = field(default_factory=lambda: FreeGpuMemory(True, False, False))


@dataclass
class RewardModel:
    """A reward model of the user's naming (``models.<name>: {kind: reward_model, ...}``; any number of them):
    a sequence-classification model that scores each prompt and response, rendered with its own tokenizer
    and chat template, on devices of its own or of its colocation group (name it in
    ``runtime_args.colocation`` to let it take turns); its score x ``weight`` is added to the reward.
    ``models.reward.load`` is the same with ``model_*`` keys (the reward model ``reward_model``)."""

    kind: str = "reward_model"
    load: str = MISSING  # a sequence-classification model folder, or Hub model id
    hub_id: Optional[str] = None  # written by chatlearn: the Hub id load was resolved from, pinned
    trust_remote_code: bool = False
    seed: int = "${runtime_args.seed}"  # type: ignore[assignment]
    num_gpu: int = "${models.policy_trainer.num_gpu}"  # type: ignore[assignment]
    gpu_per_process: Optional[int] = 1
    weight: float = 1.0  # its score x weight is added to the reward functions' (and the other models')
    normalize: str = "none"  # none | batch (whitened over the episode's samples: zero mean, unit std)
    micro_batch_size: int = 16  # conversations per forward on one device
    bf16: Optional[bool] = None  # null: bf16 on CUDA devices that support it, fp32 on CPU
    free_gpu_memory: FreeGpuMemory = field(default_factory=lambda: FreeGpuMemory(True, False, False))


# the judge kind's default prompt (a Jinja template; the fields: question, response, reference)
DEFAULT_JUDGE_TEMPLATE = "Question: {{ question }}\nAnswer: {{ response }}\nIs the answer right? Reply yes or no."


@dataclass
class Judge:
    """An LLM judge of the user's naming (``models.<name>: {kind: judge, ...}``; any number of them): a causal
    LM on a rollout backend that reads each sample through ``prompt_template`` (Jinja; the fields ``question``:
    the prompt's last user message, ``response``, ``reference``: the row's ground truth) and gives a verdict,
    read by ``parser`` into a score; the score x ``weight`` is added to the reward. On devices of its own or
    of its colocation group (name it in ``runtime_args.colocation`` to let it take turns)."""

    kind: str = "judge"
    # a causal LM folder, or Hub model id (required unless endpoint is set; with an endpoint, optional: a copy of
    # the served judge's folder whose tokenizer checks the prompts' length before start and names the yes/no tokens)
    load: Optional[str] = None
    hub_id: Optional[str] = None  # written by chatlearn: the Hub id load was resolved from, pinned
    trust_remote_code: bool = False
    seed: int = "${runtime_args.seed}"  # type: ignore[assignment]
    num_gpu: int = "${models.policy_trainer.num_gpu}"  # type: ignore[assignment]
    gpu_per_process: Optional[int] = 1
    backend: str = "hf"  # the rollout backend it runs on: hf (transformers) | vllm
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE  # Jinja; fields: question, response, reference
    apply_chat_template: bool = True  # the rendered text as one user message of the judge's chat template
    # how the verdict becomes a score: last_number | yes_no | boxed | yes_prob | module:function (text -> float
    # or None)
    parser: str = "yes_no"
    score_range: List[float] = field(default_factory=lambda: [0.0, 10.0])  # last_number / boxed: kept in, else unparsed
    yes_word: str = "yes"  # yes_no and yes_prob: the word that means right (its first token for yes_prob)
    no_word: str = "no"  # ... and wrong
    default_score: float = 0.0  # an unparseable verdict's score (counted: train/judge/<name>/unparsed)
    # the run stops when every verdict of this many episodes in a row is unparseable (0: never)
    max_unparsed_episodes: int = 3
    temperature: float = 0.0  # 0: greedy
    max_verdict_tokens: int = 16  # the verdict's length limit in tokens (yes_prob generates nothing)
    max_prompt_tokens_length: int = 512  # the longest rendered prompt in the judge's tokens; longer is an error
    generation_batch_size: int = 64  # prompts decoded together
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    gpu_memory_utilization: float = 0.3  # backend vllm: the share of a device its engine may take
    weight: float = 1.0  # its score x weight is added to the reward
    normalize: str = "none"  # none | batch (whitened over the episode's samples: zero mean, unit std)
    # its weights leave the devices during the other models' turns (its KV cache always does)
    free_gpu_memory: FreeGpuMemory = field(default_factory=lambda: FreeGpuMemory(True, False, False))
    # A served judge: an OpenAI-compatible HTTP endpoint (e.g. http://host:8000/v1; null: the judge is a model of
    # the run on its rollout backend). It takes no devices and no turns: backend, num_gpu, gpu_per_process, dtype,
    # gpu_memory_utilization, generation_batch_size and free_gpu_memory do not apply. apply_chat_template true:
    # the chat-completions API (the server applies its chat template), false: the completions API
    endpoint: Optional[str] = None
    served_model: Optional[str] = None  # the model name the server serves (null: the only one GET /models lists)
    api_key_env: Optional[str] = None  # the environment variable holding its API key (sent as a bearer token)
    max_concurrency: int = 8  # requests in flight at once
    request_timeout_s: float = 60.0  # one request's time limit (then it is retried)
    retry_backoff_s: float = 0.5  # the wait before the first retry, doubled at each retry ...
    retry_backoff_max_s: float = 8.0  # ... up to this
    down_timeout_s: float = 300.0  # the run stops when every request has failed for this long
    top_logprobs: int = 20  # parser yes_prob: the first reply token's most likely tokens asked for


@dataclass
class Teacher:
    """A distillation teacher of the user's naming (``models.<name>: {kind: teacher, ...}``; one per run, read by
    ``algorithm: opd``): a causal LM with the student's tokenizer and chat template, frozen, that gives the
    log-probs of the student's sampled tokens (and whether each is its own most likely token) on the training
    backend's inference path (FSDP2), on devices of its own or of its colocation group (name it in
    ``runtime_args.colocation`` to let it take turns: its weights leave the devices during the others' turns)."""

    kind: str = "teacher"
    load: str = MISSING  # a causal LM folder, or Hub model id, with the student's tokenizer
    hub_id: Optional[str] = None  # written by chatlearn: the Hub id load was resolved from, pinned
    trust_remote_code: bool = False
    seed: int = "${runtime_args.seed}"  # type: ignore[assignment]
    num_gpu: int = "${models.policy_trainer.num_gpu}"  # type: ignore[assignment]
    gpu_per_process: Optional[int] = 1
    tensor_model_parallel_size: int = 1  # the FSDP backend: 1 (data-parallel shards over num_gpu)
    pipeline_model_parallel_size: int = 1
    generation_batch_size: int = 8  # samples per forward on one rank (unpacked)
    packing: bool = False  # samples packed into rows of up to max_token_in_packing tokens
    max_token_in_packing: int = 32768
    logprob_chunk_tokens: int = 1024  # tokens per chunk of the [tokens, vocab] log-prob computation
    bf16: Optional[bool] = None  # null: bf16 on CUDA devices that support it, fp32 on CPU
    meta_init: bool = False  # FSDP: build on the meta device, rank 0 reads the checkpoint and broadcasts the shards
    use_expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in its workers
    free_gpu_memory: FreeGpuMemory = field(default_factory=lambda: FreeGpuMemory(True, False, False))


@dataclass
class Models:
    policy: Policy = field(default_factory=Policy)
    policy_trainer: PolicyTrainer = field(default_factory=PolicyTrainer)
    ref_policy: RefPolicy = field(default_factory=RefPolicy)
    critic: Critic = field(default_factory=Critic)
    reward: Reward = field(default_factory=Reward)


@dataclass
class RuntimeEnv:
    """Ray runtime environment (accepted for ChatLearn compatibility)."""

    excludes: List[str] = field(default_factory=lambda: ["*pt", "logs", "tensorboards", ".nfs*"])
    platform: str = "DLC"
    pip: List[str] = field(default_factory=list)
    working_dir: Optional[str] = None
    py_modules: List[str] = field(default_factory=list)


@dataclass
class SFT:
    """``chatlearn sft``: supervised fine-tuning of ``models.policy_trainer`` on conversations (docs/config.md,
    "Supervised fine-tuning"). Read by ``chatlearn sft`` alone; ``chatlearn run`` ignores the section."""

    # conversations: JSONL / JSON / parquet files or folders, or a Hub dataset id (comma-separated); each row
    # holds messages_key: [{role, content}, ...] with at least one assistant turn
    data_path: Optional[str] = None
    data_split: str = "train"  # the split of a Hub dataset
    # held-out conversations: the SFT loss on them every eval_interval steps (null: no eval loss)
    eval_data_path: Optional[str] = None
    eval_data_split: str = "test"
    messages_key: str = "messages"
    max_seq_len: int = 1024  # tokens of one rendered conversation
    overlong: str = "refuse"  # a longer conversation: refuse (count them, stop) | truncate | drop
    num_epochs: int = 1  # passes over the data
    max_steps: Optional[int] = None  # optimizer steps (null: num_epochs passes)
    # samples (conversations) per optimizer step; the loss is the token mean over all of their assistant
    # tokens. A step runs in micro-batches of models.policy_trainer.train_micro_batch_size samples (with
    # packing: of up to max_token_in_packing tokens) per rank, its gradients accumulated
    global_batch_size: int = 32
    shuffle: bool = True  # a new order of the data each epoch (seeded by runtime_args.seed)
    eval_interval: int = 0  # steps between evaluations of the eval loss (0: at the start and the end only)
    save_interval: int = 0  # steps between checkpoints (0: the last step only)
    # the task reward by sampling (runtime_args.eval_data_path's prompts, the rollout engine and the reward
    # functions of chatlearn eval) of the model before and after fine-tuning
    eval_reward: bool = True


@dataclass
class Config:
    runtime_args: RuntimeArgs = field(default_factory=RuntimeArgs)
    models: Models = field(default_factory=Models)
    runtime_env: RuntimeEnv = field(default_factory=RuntimeEnv)
    sft: SFT = field(default_factory=SFT)



# Keys accepted so that a ChatLearn config loads unchanged, but read by nothing in this build.
# A user who sets one to a value other than its default is warned at start (chatlearn run and
# --dry-run). tests/config/test_compat_keys.py keeps this list honest: every key in it is read
# nowhere in chatlearn/, and every other key is read somewhere.
# the sections of Models, and those of them on the training backend (a TrainerModel)
_ALL_MODELS = tuple(f.name for f in dataclasses.fields(Models))
_TRAINERS = tuple(f.name for f in dataclasses.fields(Models) if issubclass(f.default_factory, TrainerModel))
COMPAT_ONLY_KEYS: Dict[str, str] = {
    "runtime_args.concurrent_setup": "models are set up one after another",
    "runtime_args.nsys": "GPU profiling switch; no profiler is attached",
    "runtime_args.profiler_dir": "no profiler is attached",
    "runtime_args.data_checkpoint_path": "the data position is saved in the training checkpoint",
    "runtime_args.data_ratio": "the files of data_path are read as one dataset",
    "runtime_args.replay_episode_offset": "episodes are not replayed with an offset",
    "runtime_args.consumed_samples": "resume takes the data position from the checkpoint",
    "runtime_args.max_data_ckpt_nums": "the data position is part of each checkpoint (see keep_last_checkpoints)",
    "runtime_args.load_data_checkpoint_iteration": "resume uses the newest complete checkpoint",
    "runtime_args.stream_data_loader_type": "one fixed-size loader per episode",
    "runtime_args.bucket_size_mb_in_memory_manager": "Megatron memory manager; weights move in buckets of "
                                                     "coalesced_buffer_mb",
    "runtime_args.concurrent_comm": "weight sync has a single path",
    "runtime_args.param_sync_comm_type": "weight sync has a single path",
    "runtime_args.param_sync_max_workers": "weight sync has a single path",
    "runtime_args.routed_expert_regrouping_comm_type": "weight sync has a single path",
    "runtime_args.free_sync_collective_group": "weight sync has a single path",
    "runtime_args.cpu_schedule_strategy": "Ray placement is computed by the plan",
    "runtime_args.validate_param_sync": "weight sync has a single path",
    "runtime_args.policy_to_regroup_queue": "weight sync has a single path",
    "runtime_env.excludes": "the Ray runtime environment is not shipped",
    "runtime_env.platform": "the Ray runtime environment is not shipped",
    "runtime_env.pip": "the Ray runtime environment is not shipped",
    "runtime_env.working_dir": "the Ray runtime environment is not shipped",
    "runtime_env.py_modules": "the Ray runtime environment is not shipped",
    "models.policy.max_seq_len_to_capture": "CUDA graph capture length; the engine chooses it",
    "models.policy.vllm_input_ids_key": "prompts are tokenized from prompt_key",
    "models.policy.enable_stage_resume": "resume restarts the interrupted episode",
    "models.reward.generation_batch_size": "a reward worker scores its whole share of a batch in one call",
    **{f"models.{m}.{k}": why for m in _ALL_MODELS for k, why in (
        ("sync_frequency", "weight pushes follow the episode schedule"),
        ("replica_dp_size", "derived by the plan"),
    )},
    # models.policy.expert_model_parallel_size acts on the vLLM rollout (enable_expert_parallel); the hf and
    # SGLang rollouts are warned in compat_warning
    **{f"models.{m}.{k}": why for m in _ALL_MODELS if m not in _TRAINERS for k, why in (
        ("expert_model_parallel_size", "the reward workers hold every expert"),
        ("expert_tensor_parallel_size", "the rollout engine and the reward workers hold every expert"),
    ) if (m, k) != ("policy", "expert_model_parallel_size")},
    **{f"models.{m}.{k}": why for m in _TRAINERS for k, why in (
        ("diff_clip_ratio", "the loss clips with pos_clip_ratio / neg_clip_ratio (and clip_ratio_c)"),
        ("final_clip_ratio", "the loss clips with pos_clip_ratio / neg_clip_ratio (and clip_ratio_c)"),
        ("tokenizer_type", "the tokenizer is the model folder's Hugging Face tokenizer"),
        ("tokenizer_model", "the tokenizer is the model folder's Hugging Face tokenizer"),
        ("virtual_pipeline_model_parallel_size", "no interleaved pipeline schedule"),
        ("decoder_first_pipeline_num_layers", "pipeline stages split the layers evenly"),
        ("decoder_last_pipeline_num_layers", "pipeline stages split the layers evenly"),
        ("save", "checkpoints go to runtime_args.output_dir"),
        ("save_interval", "see runtime_args.save_episode_interval"),
        ("log_interval", "metrics are logged every optimizer step"),
        ("train_iters", "steps follow from num_episode, sample_per_episode and train_global_batch_size"),
    )},
}


@functools.lru_cache(maxsize=1)
def _raw_defaults() -> dict:
    return OmegaConf.to_container(OmegaConf.structured(Config), resolve=False)


def raw_defaults() -> dict:
    """The schema's defaults as plain containers, interpolations unresolved (``${...}`` strings), a
    required key as ``"???"``: built once per process (building the structured config takes a
    quarter of a second) and copied for each caller."""
    return copy.deepcopy(_raw_defaults())


def compat_warning(cfg) -> Optional[str]:
    """One warning naming the compatibility-only keys that ``cfg`` sets away from their default;
    None when there are none. A default that is an interpolation is resolved within ``cfg``."""
    defaults_tree = raw_defaults()
    values, defaults = {}, {}
    for i, key in enumerate(COMPAT_ONLY_KEYS):
        raw = defaults_tree
        for part in key.split("."):
            raw = raw[part]
        values[f"k{i}"] = OmegaConf.select(cfg, key, default=raw, throw_on_missing=False)
        defaults[f"k{i}"] = raw
    # one config holding the run's keys and, beside them, every value and default to compare, so that
    # an interpolation among them resolves within the run's config (one build, not one per key)
    probe = OmegaConf.create({"__compat_values": values, "__compat_defaults": defaults,
                              **OmegaConf.to_container(cfg, resolve=False)})
    changed = []
    for i, key in enumerate(COMPAT_ONLY_KEYS):
        value, default = probe["__compat_values"][f"k{i}"], probe["__compat_defaults"][f"k{i}"]
        if OmegaConf.is_config(value):
            value, default = OmegaConf.to_container(value, resolve=True), OmegaConf.to_container(default, resolve=True)
        if value != default:
            changed.append(f"{key}={json_value(value)} ({COMPAT_ONLY_KEYS[key]})")
    models = cfg.models
    for name in ("policy_trainer", "ref_policy"):
        t = models[name]
        same = name == "ref_policy" and (t.packing, t.seq_length) == (
            models.policy_trainer.packing, models.policy_trainer.seq_length)
        if t.packing and t.seq_length is not None and not same:
            changed.append(f"models.{name}.seq_length={t.seq_length} (ignored with packing: a packed micro-batch "
                           "holds up to max_token_in_packing tokens)")
    backend, ep = cfg.runtime_args.rollout_backend, models.policy.expert_model_parallel_size
    if backend != "vllm" and ep != 1:
        changed.append(f"models.policy.expert_model_parallel_size={ep} (acts on the vLLM rollout only: the "
                       f"{backend} rollout holds every expert on each replica)")
    if not changed:
        return None
    return (f"{'; '.join(changed)}: accepted for compatibility with ChatLearn configs, no effect in "
            "this build (docs/config.md marks every such key); remove to silence this warning.")


def json_value(value) -> str:
    return json.dumps(value)
