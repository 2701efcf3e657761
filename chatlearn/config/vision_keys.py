"""The checks of a run whose policy is a vision-language model (its ``config.json`` has a ``vision_config``):
what chatlearn runs it with, and what it refuses before anything starts, each with the reason and the key.

Runs: the FSDP trainer, the transformers ("hf") rollout, the vLLM rollout where torchvision is installed
(:func:`vllm_vision_problem`; chatlearn/models/rollout/vllm_vision.py), GRPO-family algorithms with a reference.
Refused: the Megatron trainer (its GPT model has no vision tower and chatlearn's HF <-> Megatron mapping
covers language models only), SGLang (its adapter hands the engine token ids only), vLLM without
torchvision (vLLM 0.32 cannot load its Qwen2-VL model class then), a critic (PPO: its value
model would need the images too), multi-turn environments (their observations are text appended to a prompt
whose images the loop does not carry), ``share_prompt: true`` (a shared-prompt row does not lay out image
features). Packing works (each sample's multimodal rotary positions are the model's own, with the text
positions first so that attention stays within each sample: chatlearn/models/vision.py).
"""
from __future__ import annotations

import importlib
import importlib.util
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


# the module vLLM 0.32's Qwen2-VL module imports ``smart_resize`` from; it imports torchvision at its top
VLLM_NEEDS = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
# a vision-language model's vision tower, as peft's exclude_modules regex (LoRA's adapters go on the language
# model only) and as a module-name test
VISION_TOWER_MODULES = r"(.*\.)?visual(\..*)?"


def vllm_vision_problem(load: str) -> str | None:
    """Why vLLM cannot run the vision-language model at ``load`` in this environment (None: it can).

    vLLM 0.32's Qwen2-VL module (``vllm/model_executor/models/qwen2_vl.py``, which Qwen2.5-VL's imports too)
    imports ``smart_resize`` from transformers' :data:`VLLM_NEEDS`, which imports ``torchvision`` at its top;
    vLLM's processor also loads transformers' ``Qwen2VLProcessor``, whose video processor needs it. Without
    torchvision vLLM cannot inspect the model class, and its engine does not start. (The tests run vLLM's
    Qwen2-VL here through a test-only import hook that stands in for both: tests/support/vllm_no_torchvision.)"""
    if importlib.util.find_spec("torchvision") is not None:
        return None
    try:
        importlib.import_module(VLLM_NEEDS)
    except ImportError:
        pass
    else:
        return None
    return (f"the policy {load} is a vision-language model, and vLLM 0.32 runs one only with torchvision "
            "installed: its Qwen2-VL module imports transformers' Qwen2-VL image processor module, which imports "
            "torchvision (so does the video half of the processor vLLM loads), so vLLM cannot load the model "
            "class. torchvision is not installed here (on a CPU-only machine the registry's builds link CUDA "
            "libraries and break transformers). Install the torchvision that matches your torch (GPU machines), "
            "or set runtime_args.rollout_backend: hf.")


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
    if rt.rollout_backend == "sglang":
        raise ConfigError(f"{why}, and chatlearn's {rt.rollout_backend} adapter hands the engine token ids only, not "
                          "images. Set runtime_args.rollout_backend: hf or vllm.", key="runtime_args.rollout_backend")
    if rt.rollout_backend == "vllm" and vllm_vision_problem(p.load):
        raise ConfigError(vllm_vision_problem(p.load), key="runtime_args.rollout_backend")
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
