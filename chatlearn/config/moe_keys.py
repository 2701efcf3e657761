"""Validation of the mixture-of-experts keys (docs/config.md, "Mixture of experts"); called by
``chatlearn.config.load.validate`` after the model folders are resolved, before any process starts.

Whether a model has experts is read from its ``config.json`` (:func:`experts_of`): the number of routed
experts and how many each token goes to. A dense model with an MoE key set away from its default, or with
routing replay on, is refused: the key would act on nothing. The checks that need the backend's own rules
(Megatron's parallel sizes against the devices, grouped GEMM without CUDA) are the backends'.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from chatlearn.config.checks import choice
from chatlearn.config.schema import TrainerModel
from chatlearn.errors import ConfigError

DISPATCHERS = ("alltoall", "allgather")
REPLAY_MODES = ("off", "rollout")
# the rollout engines that record the experts they routed each token to (chatlearn/models/moe)
REPLAY_ROLLOUTS = ("hf", "vllm")
# the trainer keys that mean something only for a model with experts
MOE_KEYS = ("expert_model_parallel_size", "expert_tensor_parallel_size", "moe_token_dispatcher_type",
            "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_force_load_balancing", "moe_layer_recompute",
            "moe_shared_expert_overlap", "groupgemm")
# config.json's name for the number of routed experts, by family (Qwen2/3-MoE, Mixtral, DeepSeek)
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class Experts:
    """What ``config.json`` says of a model's experts."""

    count: int  # routed experts per MoE layer
    top_k: int  # experts each token is routed to


def config_experts(conf: dict) -> int | None:
    """The routed experts per MoE layer that a ``config.json`` dict names; None for a dense model."""
    return next((conf[k] for k in EXPERT_COUNT_KEYS if isinstance(conf.get(k), int) and conf[k] > 0), None)


def experts_of(path: str | None) -> Experts | None:
    """The experts of the model folder ``path`` (a multimodal model's ``text_config``); None for a dense
    model, or where there is no readable ``config.json`` (the folder checks name that)."""
    if not path:
        return None
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            conf = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(conf, dict):
        return None
    text = conf.get("text_config") if isinstance(conf.get("text_config"), dict) else conf
    count = config_experts(text)
    if count is None:
        return None
    top_k = text.get("num_experts_per_tok")
    return Experts(count=count, top_k=top_k if isinstance(top_k, int) and top_k > 0 else 1)


def _default(key: str):
    """The schema's default of a trainer key (the base :class:`TrainerModel`'s, not an interpolation)."""
    return next(f.default for f in fields(TrainerModel) if f.name == key)


def check_moe(cfg, trainers: tuple[str, ...]) -> None:
    """Every refusal of an MoE setting, one paragraph each naming the key and the fix. ``trainers``: the
    sections on the training backend that the run uses (policy_trainer first)."""
    train_backend = cfg.runtime_args.train_backend
    for name in trainers:
        t, prefix = cfg.models[name], f"models.{name}"
        choice(t.moe_token_dispatcher_type, DISPATCHERS, f"{prefix}.moe_token_dispatcher_type")
        if t.moe_aux_loss_coeff is not None and not t.moe_aux_loss_coeff >= 0:
            raise ConfigError(f"is {t.moe_aux_loss_coeff}; the load-balancing loss's coefficient is 0 (off) or "
                              "positive (Qwen3-MoE ships 0.001), or null for config.json's router_aux_loss_coef.",
                              key=f"{prefix}.moe_aux_loss_coeff")
        if not t.moe_z_loss_coeff >= 0:
            raise ConfigError(f"is {t.moe_z_loss_coeff}; the router z-loss's coefficient is 0 (off) or positive "
                              "(e.g. 0.001).", key=f"{prefix}.moe_z_loss_coeff")
        if t.expert_model_parallel_size < 1:
            raise ConfigError(f"is {t.expert_model_parallel_size}; set 1 (every rank holds every expert) or the "
                              "number of ranks the experts are spread over.", key=f"{prefix}.expert_model_parallel_size")
        if t.expert_tensor_parallel_size is not None and t.expert_tensor_parallel_size < 1:
            raise ConfigError(f"is {t.expert_tensor_parallel_size}; set null (the tensor-parallel size) or a "
                              "positive number.", key=f"{prefix}.expert_tensor_parallel_size")
        experts = experts_of(t.load)
        if experts is None:
            changed = [k for k in MOE_KEYS if t[k] != _default(k)]
            if changed:
                key = changed[0]
                raise ConfigError(
                    f"is {t[key]!r}, but {t.load} is a dense model (its config.json names no experts: "
                    f"{', '.join(EXPERT_COUNT_KEYS)}), so it would act on nothing. Remove the key (or set it back "
                    f"to {_default(key)!r}), or load a mixture-of-experts model such as Qwen3-MoE.",
                    key=f"{prefix}.{key}")
            continue
        ep = t.expert_model_parallel_size
        if experts.count % ep:
            fits = [d for d in range(1, experts.count + 1) if experts.count % d == 0]
            raise ConfigError(
                f"is {ep}, which does not divide the {experts.count} experts of {t.load} (config.json): each "
                f"expert-parallel rank holds an equal share of them. Use one of {', '.join(map(str, fits))}.",
                key=f"{prefix}.expert_model_parallel_size")
        if ep > 1 and train_backend != "megatron":
            raise ConfigError(
                f"is {ep}, but runtime_args.train_backend is {train_backend!r}: FSDP2 shards every parameter over "
                "all of its ranks and each rank runs every expert, so there is no expert parallelism to set. Use "
                "train_backend: megatron for expert parallelism, or set it to 1.",
                key=f"{prefix}.expert_model_parallel_size")
    _check_replay(cfg)


def _check_replay(cfg) -> None:
    """``models.policy_trainer.routing_replay``: a known mode, on a model with experts, with a rollout engine
    that records them."""
    key = "models.policy_trainer.routing_replay"
    mode = cfg.models.policy_trainer.routing_replay
    choice(mode, REPLAY_MODES, key)
    if mode == "off":
        return
    load = cfg.models.policy_trainer.load
    if experts_of(load) is None:
        raise ConfigError(
            f"is {mode!r}, but {load} is a dense model (its config.json names no experts): there is no routing "
            "to replay. Set it to off, or load a mixture-of-experts model.", key=key)
    if cfg.models.policy_trainer.moe_router_force_load_balancing:
        raise ConfigError(
            f"is {mode!r}, but models.policy_trainer.moe_router_force_load_balancing is on: forced balancing "
            "replaces the router's choices by random ones in every trainer forward, so the rollout's experts "
            "could not be replayed. Turn one of them off (forced balancing is for benchmarks).", key=key)
    backend = cfg.runtime_args.rollout_backend
    if backend not in REPLAY_ROLLOUTS:
        raise ConfigError(
            f"is {mode!r}, but the {backend!r} rollout engine does not report the experts it routed each token "
            f"to. Use runtime_args.rollout_backend {' or '.join(REPLAY_ROLLOUTS)}, or set it to off.", key=key)
