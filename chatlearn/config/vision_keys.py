"""The checks of a run whose policy is a vision-language model (its ``config.json`` has a ``vision_config``):
what chatlearn runs it with, and what it refuses before anything starts, each with the reason and the key.

Runs: the FSDP trainer, the transformers ("hf") rollout, GRPO-family algorithms with a reference.
Refused: the Megatron trainer (its GPT model has no vision tower and chatlearn's HF <-> Megatron mapping
covers language models only), vLLM and SGLang (their adapters hand the engines token ids only), a critic (PPO: its value
model would need the images too), multi-turn environments (their observations are text appended to a prompt
whose images the loop does not carry), ``share_prompt: true`` (a shared-prompt row does not lay out image
features). Packing works (each sample's multimodal rotary positions are the model's own, with the text
positions first so that attention stays within each sample: chatlearn/models/vision.py).
"""
from __future__ import annotations

import json
import os

from chatlearn.config.ppo_keys import uses_critic
from chatlearn.errors import ConfigError


def is_vision_model(path: str | None) -> bool:
    """Whether the model folder ``path`` is a vision-language model (config.json holds a ``vision_config``)."""
    try:
        with open(os.path.join(path or "", "config.json"), encoding="utf-8") as f:
            conf = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(conf, dict) and isinstance(conf.get("vision_config"), dict)


def check_vision(cfg) -> None:
    """The refusals of the module docstring, for a policy that is a vision-language model; nothing otherwise.
    ``max_images_per_prompt`` is checked whatever the model (it is read at load)."""
    p, rt = cfg.models.policy, cfg.runtime_args
    if p.max_images_per_prompt < 1:
        raise ConfigError(f"is {p.max_images_per_prompt}; set it to 1 or more (the most images one prompt may "
                          "hold).", key="models.policy.max_images_per_prompt")
    if not is_vision_model(p.load):
        return
    why = f"the policy {p.load} is a vision-language model"
    if rt.train_backend == "megatron":
        raise ConfigError(f"{why}, and the Megatron trainer builds language models only (no vision tower, and "
                          "chatlearn's HF <-> Megatron weight mapping has no vision entries). Set "
                          "runtime_args.train_backend: fsdp.", key="runtime_args.train_backend")
    if rt.rollout_backend in ("sglang", "vllm"):
        raise ConfigError(f"{why}, and chatlearn's {rt.rollout_backend} adapter hands the engine token ids only, not "
                          "images. Set runtime_args.rollout_backend: hf.", key="runtime_args.rollout_backend")
    if uses_critic(cfg):
        raise ConfigError(f"{why}: a critic on prompts with images is not supported. Use a GRPO-family "
                          "algorithm.", key="models.critic")
    if p.multi_turn.environment is not None:
        raise ConfigError(f"{why}: multi-turn environments append text observations to prompts whose images the "
                          "loop does not carry. Remove models.policy.multi_turn.environment, or use a text model.",
                          key="models.policy.multi_turn.environment")
    if cfg.models.policy_trainer.share_prompt is True:
        raise ConfigError(f"{why}: a shared-prompt row does not lay out image features. Set it to null (off for "
                          "this model) or false.", key="models.policy_trainer.share_prompt")
