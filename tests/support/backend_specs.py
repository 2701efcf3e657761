"""The specs that tests build backends and losses from directly (no config, no run).

A spec has no defaults of its own (``chatlearn/models/specs.py``: the schema holds them), so a
test that builds one gives every field. :func:`trainer_spec` and :func:`rollout_spec` take the
fields a test sets and fill the others with small CPU settings (resolved: ``bf16`` off,
``rollout_correction`` none, ``dtype`` float32, deterministic inference on); a test names every
value it relies on.
"""
from __future__ import annotations

from chatlearn.models.specs import MoeSpec, RolloutSpec, TrainerSpec

# the MoE keys at the schema's defaults (moe_aux_loss_coeff null: the model's config.json)
MOE_DEFAULTS = MoeSpec(aux_loss_coeff=None, z_loss_coeff=0.0, force_load_balancing=False, layer_recompute=False,
                       groupgemm=False, token_dispatcher_type="alltoall", shared_expert_overlap=False,
                       expert_model_parallel_size=1, expert_tensor_parallel_size=None)

TRAINER_DEFAULTS = dict(
    trust_remote_code=False, seed=0, trainable=True, role="policy",
    lr=1e-3, weight_decay=0.01, clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
    min_lr=0.0, lr_decay_style="constant", lr_warmup_iters=0, lr_decay_iters=100, lr_warmup_init=0.0,
    train_micro_batch_size=2, logprob_micro_batch_size=2, train_global_batch_size=8,
    packing=False, max_token_in_packing=32768, seq_length=None, logprob_chunk_tokens=1024, share_prompt=False,
    pos_clip_ratio=0.2, neg_clip_ratio=0.2, clip_ratio_c=None, policy_loss="vanilla",
    loss_agg_mode="token-mean", max_response_tokens_length=16, kl_coef=0.0, kl_estimator="k3",
    kl_in_reward=False, entropy_coef=0.0, old_logprobs="auto", rollout_correction="none",
    rollout_correction_level="token", rollout_is_threshold=2.0, rollout_is_threshold_lower=None,
    cliprange_value=0.5, value_loss_coef=0.5,
    gradient_checkpointing=False, freeze_vision_tower=True, recompute_granularity=None, bf16=False, meta_init=False,
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, sequence_parallel=False,
    use_distributed_optimizer=False, lora=None, moe=MOE_DEFAULTS, plugins=(), plugins_dir="",
    routing_replay="off", gkd_beta=0.5, gkd_temperature=1.0)

ROLLOUT_DEFAULTS = dict(
    trust_remote_code=False, seed=1234, generation_batch_size=8, max_prompt_tokens_length=32,
    max_response_tokens_length=16, seq_length=None, max_num_batched_tokens=None, dtype="float32",
    gpu_memory_utilization=0.5, kv_cache="fit", enforce_eager=True, tensor_model_parallel_size=1,
    expert_model_parallel_size=1,
    deterministic_inference=True, cpu_threads=None, routing_replay="off", max_images_per_prompt=4, device="cpu")


def trainer_spec(load: str = "", **fields) -> TrainerSpec:
    """A :class:`TrainerSpec` of the model folder ``load`` (none for a loss alone) with ``fields``
    set, :data:`TRAINER_DEFAULTS` elsewhere."""
    return TrainerSpec(**{**TRAINER_DEFAULTS, "load": load, **fields})


def rollout_spec(load: str, **fields) -> RolloutSpec:
    """A :class:`RolloutSpec` of the model folder ``load`` with ``fields`` set, :data:`ROLLOUT_DEFAULTS`
    elsewhere."""
    return RolloutSpec(**{**ROLLOUT_DEFAULTS, "load": load, **fields})
