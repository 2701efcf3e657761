"""Validation of ``models.policy_trainer.lora`` (low-rank adapters); called by
``chatlearn.config.load.validate`` after the model folders are resolved, before any process starts.

The layers the adapters go on are read from the model's module tree built on the meta device from its
``config.json`` (no weight is read), with peft's own matching rules (:func:`adapter_targets`).
"""
from __future__ import annotations

import importlib.util
import os
import re

from chatlearn.config.algorithms import declared
from chatlearn.config.kinds import KINDS
from chatlearn.config.vision_keys import VISION_TOWER_MODULES
from chatlearn.errors import ConfigError

KEY = "models.policy_trainer.lora"
ALL_LINEAR = "all-linear"
# The rollout backends that take the trained adapters: all three. The push sends the adapters alone
# (lora.push: adapters) and the rollout loads W + B @ A x alpha / rank through its ordinary weight load
# (chatlearn/models/rollout/lora_push.py), or it sends the merged weights (lora.push: merged).
ADAPTER_ROLLOUTS = ("hf", "vllm", "sglang")
PUSH_MODES = ("adapters", "merged")


def lora_on(cfg) -> bool:
    """Whether the policy trainer trains adapters (``models.policy_trainer.lora.rank`` > 0)."""
    return cfg.models.policy_trainer.lora.rank > 0


def check_lora_rollout(rollout_backend: str) -> None:
    """The one place that says which rollout engines take adapters (:data:`ADAPTER_ROLLOUTS`)."""
    if rollout_backend not in ADAPTER_ROLLOUTS:
        raise ConfigError(
            f"LoRA (models.policy_trainer.lora.rank > 0) is not supported with runtime_args.rollout_backend "
            f"{rollout_backend!r}: only {', '.join(ADAPTER_ROLLOUTS)} take the trained adapters. Set "
            "runtime_args.rollout_backend to one of them, or models.policy_trainer.lora.rank=0 (full fine-tuning).",
            key="runtime_args.rollout_backend")


def check_lora(cfg) -> None:
    """Every refusal of a LoRA config, one paragraph each naming the key and the fix."""
    lora = cfg.models.policy_trainer.lora
    if lora.rank < 0:
        raise ConfigError(f"is {lora.rank}; set a positive adapter rank (e.g. 8), or 0 for no adapters.",
                          key=f"{KEY}.rank")
    if not lora_on(cfg):
        return
    if not lora.alpha > 0:
        raise ConfigError(f"is {lora.alpha}; the adapters' scale is alpha / rank: set a positive number "
                          "(commonly rank or 2 x rank).", key=f"{KEY}.alpha")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"is {lora.dropout}; a dropout probability is at least 0 and below 1.",
                          key=f"{KEY}.dropout")
    if lora.dropout > 0:
        # peft's dropout acts in train mode only: the optimizer step's forward draws it, the old-log-prob and
        # reference passes (eval mode) do not, so the PPO ratio is not 1 at equal weights (verl leaves it 0)
        raise ConfigError(f"is {lora.dropout}; dropout on the adapters acts in the training forward only, not in "
                          "the old-log-prob and reference passes, so at equal weights the PPO ratio would not be 1 "
                          "(nor the KL 0) and the clipping would act on dropout noise. Set it to 0 (as verl does "
                          "in RL).", key=f"{KEY}.dropout")
    rt = cfg.runtime_args
    if rt.train_backend != "fsdp":
        raise ConfigError(f"LoRA (models.policy_trainer.lora.rank > 0) is implemented for the FSDP trainer only, "
                          f"not for train_backend {rt.train_backend!r}. Set runtime_args.train_backend=fsdp, or "
                          "models.policy_trainer.lora.rank=0.", key="runtime_args.train_backend")
    check_lora_rollout(rt.rollout_backend)
    _check_push(cfg)
    t = cfg.models.policy_trainer
    trained = [k for k in declared(t.algorithm, t.advantage_estimator).needs if KINDS[k].trains]  # a teacher: frozen
    if trained:
        needs = ", ".join(trained)
        raise ConfigError(f"LoRA (models.policy_trainer.lora.rank > 0) trains the policy alone, but algorithm "
                          f"{t.algorithm!r} also needs {needs} (models.critic), which adapters do not cover. Use a "
                          "group-relative algorithm (algorithm: grpo), or models.policy_trainer.lora.rank=0.",
                          key="models.policy_trainer.algorithm")
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("LoRA needs peft, which is not installed in this Python environment. Install it with "
                          "pip install -e '.[lora]' (on a machine without a GPU add -c "
                          "requirements/constraints-cpu.txt), or set models.policy_trainer.lora.rank=0.",
                          key=f"{KEY}.rank")
    targets = _targets(lora.target_modules)
    check_lora_model(cfg.models.policy_trainer.load, bool(cfg.models.policy_trainer.trust_remote_code),
                     int(lora.rank), targets, [str(m) for m in lora.modules_to_save])


def _check_push(cfg) -> None:
    """``lora.push`` is a known mode; with ``adapters`` the rollout starts from the base model the trainer
    adapts (it keeps every weight but the adapted layers' from its own ``load`` folder)."""
    push = cfg.models.policy_trainer.lora.push
    if push not in PUSH_MODES:
        raise ConfigError(f"is {push!r}; set adapters (the weight push sends the adapters alone and the rollout "
                          "merges them onto its base weights) or merged (every weight, merged by the trainer).",
                          key=f"{KEY}.push")
    base, rollout = str(cfg.models.policy_trainer.load), str(cfg.models.policy.load)
    if push == "adapters" and os.path.realpath(base) != os.path.realpath(rollout):
        raise ConfigError(f"is adapters, but models.policy.load ({rollout!r}) is not models.policy_trainer.load "
                          f"({base!r}): the rollout keeps its own weights outside the adapted layers, so it must "
                          "start from the base model the adapters train on. Load the same folder in both, or set "
                          f"{KEY}.push=merged (every weight is pushed).", key=f"{KEY}.push")


def _targets(value):
    """``target_modules`` as peft takes it: ``all-linear`` or a non-empty list of module-name suffixes."""
    if isinstance(value, str):
        if value == ALL_LINEAR:
            return value
        raise ConfigError(f"is {value!r}; give a list of module-name suffixes (e.g. [q_proj, v_proj]) or "
                          f"the string {ALL_LINEAR}.", key=f"{KEY}.target_modules")
    names = [str(v) for v in (value or [])]
    if not names:
        raise ConfigError(f"is empty; give the module-name suffixes that get adapters (e.g. [q_proj, v_proj]) "
                          f"or {ALL_LINEAR}.", key=f"{KEY}.target_modules")
    return names


def meta_model(load: str, trust_remote_code: bool):
    """The causal LM (or vision-language model: its config has a ``vision_config``) of the folder ``load`` built on
    the meta device from its config (no weight read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(load, trust_remote_code=trust_remote_code)
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config, trust_remote_code=trust_remote_code)


def adapter_targets(model, targets) -> dict[str, tuple[int, int]]:
    """``{module name: (in_features, out_features)}`` of the layers that get adapters, by peft's rules:
    a listed name matches a module whose name is it or ends with ``.<it>``; ``all-linear`` is every
    linear layer but the output head."""
    import torch

    head = model.get_output_embeddings()
    vlm = getattr(model.config, "vision_config", None) is not None
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or vlm and re.fullmatch(VISION_TOWER_MODULES, name):
            continue  # a VLM's adapters go on its language model only (chatlearn.models.trainer.lora.wrap)
        if targets == ALL_LINEAR:
            hit = module is not head
        else:
            hit = any(name == t or name.endswith("." + t) for t in targets)
        if hit:
            out[name] = (module.in_features, module.out_features)
    return out


def check_lora_model(load: str, trust_remote_code: bool, rank: int, targets, modules_to_save: list) -> None:
    """The target modules match linear layers of the model, the rank fits each of them, and every module
    of ``modules_to_save`` exists."""
    model = meta_model(load, trust_remote_code)
    found = adapter_targets(model, targets)
    if not found:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if type(m).__name__ == "Linear"})
        raise ConfigError(f"{targets} matches no linear layer of {type(model).__name__} ({load}). Its linear "
                          f"layers end with: {', '.join(linear)}. Name some of these, or use {ALL_LINEAR}.",
                          key=f"{KEY}.target_modules")
    name, dims = min(found.items(), key=lambda kv: min(kv[1]))
    if rank > min(dims):
        raise ConfigError(f"is {rank}, larger than the smallest dimension of the layer {name} (in {dims[0]}, out "
                          f"{dims[1]}): an adapter of that rank is no low-rank update. Set rank to at most "
                          f"{min(dims)}, or leave that layer out of target_modules.", key=f"{KEY}.rank")
    names = [n for n, _ in model.named_modules()]
    # peft's rule for modules_to_save: the module's name ends with it (no dot needed: norm matches input_layernorm)
    missing = [m for m in modules_to_save if not any(n.endswith(m) for n in names)]
    if missing:
        raise ConfigError(f"names {', '.join(missing)}, which no module of {type(model).__name__} ({load}) is "
                          "called (e.g. embed_tokens, lm_head). Remove it, or name a module of the model.",
                          key=f"{KEY}.modules_to_save")
    _check_tied(model, modules_to_save, load)
    head = [n for n, m in model.named_modules() if m is model.get_output_embeddings()]
    if getattr(model.config, "tie_word_embeddings", False) and head and head[0] in found:
        raise ConfigError(f"{targets} takes {head[0]}, the output head that {type(model).__name__} ({load}) ties "
                          "to its input embeddings (tie_word_embeddings): an adapter on it would untie them. Leave "
                          f"it out of target_modules ({ALL_LINEAR} leaves it out).", key=f"{KEY}.target_modules")


def _check_tied(model, modules_to_save: list, load: str) -> None:
    """A model whose output head is its input embedding (``tie_word_embeddings``) cannot train one of
    them in full: peft's trained copy would untie them in the trainer but not in the rollout engine."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    ids = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}
    tied = [m for m in modules_to_save for n, mod in model.named_modules()
            if n.endswith(m) and id(mod) in ids]
    if tied:
        raise ConfigError(f"names {tied[0]}, but {type(model).__name__} ({load}) ties its output head to its "
                          "input embeddings (tie_word_embeddings), and training one of them in full would untie "
                          "them. Remove it (the adapters train the other layers), or use a model without tied "
                          "embeddings.", key=f"{KEY}.modules_to_save")
