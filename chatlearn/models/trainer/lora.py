"""Low-rank adapters (peft's LoRA) on the FSDP trainer's Hugging Face model
(``models.policy_trainer.lora``, :class:`chatlearn.models.specs.LoraSpec`).

:func:`wrap` injects the adapters with ``peft.get_peft_model`` before the model is sharded; the trainer
keeps computing with the Hugging Face model itself (now holding the adapter layers), and the
``PeftModel`` around it only for ``disable_adapter()`` (the reference log-probs: the base weights are
the reference). peft freezes every base weight (``requires_grad`` False, its dtype unchanged); only
the adapters (``lora_A``, ``lora_B``) and the copies of ``modules_to_save`` train, and only they reach
the optimizer and the checkpoint.

Parameter names inside the trainer (the Hugging Face model with adapters injected)::

    model.layers.0.self_attn.q_proj.base_layer.weight   the frozen base weight of model.layers.0.self_attn.q_proj.weight
    model.layers.0.self_attn.q_proj.lora_A.default.weight   A [rank, in]
    model.layers.0.self_attn.q_proj.lora_B.default.weight   B [out, rank]
    lm_head.modules_to_save.default.weight              the trained copy of lm_head.weight
    lm_head.original_module.weight                      the frozen original (not exported)

Two views for the weight push: :class:`Merged` (the full weights under the base model's names,
``W + B @ A x alpha / rank`` computed per layer from gathered copies, the live weights untouched), and
the adapter tensors alone under peft's names (:func:`adapter_name`: those of
``peft.get_peft_model_state_dict``, as ``adapter_model.safetensors`` holds them).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

ADAPTER = "default"  # peft's adapter name
_BASE = ".base_layer."
_A, _B = f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}."
_SAVED, _ORIGINAL = f".modules_to_save.{ADAPTER}.", ".original_module."


def wrap(model: torch.nn.Module, spec, seed: int):
    """Inject the adapters of ``spec`` (a :class:`~chatlearn.models.specs.LoraSpec`) into ``model`` in
    place; returns the ``PeftModel`` around it (for ``disable_adapter``). The adapters' initial values
    (A: peft's Kaiming-uniform; B: zero, so the model computes what it did before) are drawn from a
    generator seeded with ``seed`` alone: the same on every rank and whichever way the model was built
    (the caller's generator is left as it was)."""
    from peft import LoraConfig, get_peft_model

    targets = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
    config = LoraConfig(r=int(spec.rank), lora_alpha=float(spec.alpha), lora_dropout=float(spec.dropout),
                        target_modules=targets, modules_to_save=list(spec.modules_to_save) or None,
                        bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def base_name(name: str) -> str | None:
    """The base model's name of a trainer parameter, or None for one that is not a base weight (an
    adapter's A or B, the frozen original of a module of ``modules_to_save``)."""
    if _A in name or _B in name or _ORIGINAL in name:
        return None
    return name.replace(_BASE, ".").replace(_SAVED, ".")


def adapter_name(name: str) -> str:
    """peft's name of a trained parameter (``get_peft_model_state_dict``): ``base_model.model.`` in
    front, the adapter's name left out (``q_proj.lora_A.weight``, ``lm_head.weight``)."""
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".").replace(".modules_to_save.", ".")


@dataclass(frozen=True)
class MergedEntry:
    """One exported weight: its base-model name, the trainer parameter that holds it, and for a layer
    with an adapter the A and B parameters, the scale alpha / rank and whether the layer stores its
    weight transposed (peft's ``fan_in_fan_out``, GPT-2's Conv1D)."""

    name: str
    param: str
    lora_a: str | None = None
    lora_b: str | None = None
    scaling: float = 0.0
    fan_in_fan_out: bool = False


class Merged:
    """The full weights of a model with adapters, under the base model's names."""

    def __init__(self, model: torch.nn.Module):
        modules = dict(model.named_modules())
        self.entries: list[MergedEntry] = []
        for pname, _ in model.named_parameters():
            name = base_name(pname)
            if name is None:
                continue
            entry = MergedEntry(name, pname)
            if pname.endswith(_BASE + "weight"):
                owner = pname[:-len(_BASE + "weight")]
                layer = modules[owner]
                if ADAPTER in getattr(layer, "lora_A", {}):
                    entry = MergedEntry(name, pname, f"{owner}{_A}weight", f"{owner}{_B}weight",
                                        float(layer.scaling[ADAPTER]), bool(getattr(layer, "fan_in_fan_out", False)))
            self.entries.append(entry)

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def iterate(self, params: dict, names, full: Callable[[torch.Tensor], torch.Tensor]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(base name, merged float32 tensor)`` of the names asked for, in entry order; ``full(p)``
        gives the whole tensor of a (possibly sharded) parameter: a collective for a sharded one, so every
        rank must iterate alike. ``W + (B @ A) x scaling`` (transposed for ``fan_in_fan_out``), computed
        in float32 on a copy."""
        wanted = set(names)
        for e in self.entries:
            if e.name not in wanted:
                continue
            weight = full(params[e.param]).detach().float()
            if e.lora_a is not None:
                a = full(params[e.lora_a]).detach().float()
                b = full(params[e.lora_b]).detach().float()
                delta = (b @ a) * e.scaling
                weight = weight + (delta.T if e.fan_in_fan_out else delta)
                del a, b, delta
            yield e.name, weight
            del weight


def trained_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters that train (the adapters and the copies of ``modules_to_save``), in order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def base_identity(load: str) -> dict:
    """What identifies the base model a LoRA checkpoint was trained on: its folder and a sha256 of
    ``config.json``, the safetensors index and the weight files' names and sizes (no weight is read)."""
    digest = hashlib.sha256()
    folder = os.path.abspath(load) if os.path.isdir(load) else load
    if os.path.isdir(load):
        for name in sorted(os.listdir(load)):
            path = os.path.join(load, name)
            if name in ("config.json",) or name.endswith(".index.json"):
                with open(path, "rb") as f:
                    digest.update(name.encode() + b"\0" + f.read())
            elif name.endswith((".safetensors", ".bin")):
                digest.update(f"{name}\0{os.path.getsize(path)}".encode())
    return {"folder": folder, "sha256": digest.hexdigest()}


def spec_record(spec) -> dict:
    """The adapter settings a checkpoint records (JSON)."""
    targets = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
    return {"rank": int(spec.rank), "alpha": float(spec.alpha), "target_modules": targets,
            "modules_to_save": list(spec.modules_to_save)}


def resume_problem(saved: dict | None, spec, load: str) -> str | None:
    """Why a checkpoint's LoRA record (``saved``; None: saved without adapters) cannot resume this
    trainer (``spec``: its LoraSpec or None; ``load``: its base folder), or None."""
    if saved is None and spec is None:
        return None
    if saved is None:
        return ("it holds a fully trained model, not adapters. Resume with models.policy_trainer.lora.rank=0, "
                "or start a new run (another output_dir)")
    if spec is None:
        return (f"it holds LoRA adapters (rank {saved['rank']}), not a full model. Resume with the same "
                "models.policy_trainer.lora settings, or start a new run")
    mine = spec_record(spec)
    changed = [k for k in mine if json.dumps(mine[k]) != json.dumps(saved[k])]
    if changed:
        return (f"its adapters were trained with lora.{changed[0]} {saved[changed[0]]!r}, this run sets "
                f"{mine[changed[0]]!r}. Resume with the checkpoint's settings, or start a new run")
    now = base_identity(load)
    if now["sha256"] != saved["base"]["sha256"]:
        return (f"its adapters were trained on the base model {saved['base']['folder']!r}, and "
                f"models.policy_trainer.load ({now['folder']!r}) is not the same model now (its config.json, "
                "index or weight files differ). Load the base the adapters were trained on")
    return None


def json_record(spec, load: str) -> dict:
    """The checkpoint metadata of the adapters: their settings and the base model's identity."""
    return {**spec_record(spec), "base": base_identity(load)}
