"""Low-rank adapters (peft's LoRA) on the FSDP trainer's Hugging Face model
(``models.policy_trainer.lora``, :class:`chatlearn.models.specs.LoraSpec`).

:func:`wrap` injects the adapters with ``peft.get_peft_model`` before the model is sharded; the trainer
keeps computing with the Hugging Face model itself (now holding the adapter layers), and the
``PeftModel`` around it only for ``disable_adapter()`` (the reference log-probs: the base weights are
the reference). peft freezes every base weight (``requires_grad`` False, its dtype unchanged: bfloat16
with ``bf16`` on CUDA, :func:`chatlearn.models.trainer.fsdp.param_dtype`); only the adapters (``lora_A``,
``lora_B``) and the copies of ``modules_to_save`` train, in float32, and only they reach the optimizer and
the checkpoint.

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

import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

# the base model's identity and peft's names: what the checkpoint layer's merge reads back too
from chatlearn.checkpoint.adapters import base_identity
from chatlearn.checkpoint.adapters import peft_name as adapter_name  # noqa: F401  (re-exported: lora_lib.adapter_name)
from chatlearn.config.vision_keys import VISION_TOWER_MODULES
from chatlearn.models import vision as vision_lib

ADAPTER = "default"  # peft's adapter name
_BASE = ".base_layer."
_A, _B = f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}."
_SAVED, _ORIGINAL = f".modules_to_save.{ADAPTER}.", ".original_module."


def wrap(model: torch.nn.Module, spec, seed: int):
    """Inject the adapters of ``spec`` (a :class:`~chatlearn.models.specs.LoraSpec`) into ``model`` in
    place; returns the ``PeftModel`` around it (for ``disable_adapter``). The adapters' initial values
    (A: peft's Kaiming-uniform; B: zero, so the model computes what it did before) are drawn from a
    generator seeded with ``seed`` alone: the same on every rank and whichever way the model was built
    (the caller's generator is left as it was).

    Every trained parameter is float32 (:func:`float32_trained`) whatever the base is stored in (bfloat16
    with ``bf16`` on CUDA): the adapters are the only master weights Adam updates."""
    from peft import LoraConfig, get_peft_model

    targets = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
    # a vision-language model's adapters go on its language model only (peft's all-linear would take the
    # vision tower's layers too): the tower keeps its weights, as freeze_vision_tower keeps them without LoRA
    exclude = VISION_TOWER_MODULES if vision_lib.is_vlm(model) else None
    config = LoraConfig(r=int(spec.rank), lora_alpha=float(spec.alpha), lora_dropout=float(spec.dropout),
                        target_modules=targets, modules_to_save=list(spec.modules_to_save) or None,
                        bias="none", task_type="CAUSAL_LM", exclude_modules=exclude)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config)
    float32_trained(model)
    return peft_model


@torch.no_grad()
def float32_trained(model: torch.nn.Module) -> None:
    """Make every trained parameter of ``model`` float32 in place (frozen ones keep their dtype).
    peft's ``autocast_adapter_dtype`` upcasts A and B of a bfloat16 model itself, not the copies of
    ``modules_to_save`` (peft 0.21: ``cast_adapter_dtype`` walks the tuner layers only; those copies are
    ``deepcopy`` of the bfloat16 module)."""
    for _, p in trained_params(model):
        if p.dtype != torch.float32:
            p.data = p.data.to(torch.float32)


def base_name(name: str) -> str | None:
    """The base model's name of a trainer parameter, or None for one that is not a base weight (an
    adapter's A or B, the frozen original of a module of ``modules_to_save``)."""
    if _A in name or _B in name or _ORIGINAL in name:
        return None
    return name.replace(_BASE, ".").replace(_SAVED, ".")


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
    """The checkpoint metadata of the adapters: their settings (and the dropout, which ``chatlearn merge``
    writes into peft's adapter config) and the base model's identity."""
    return {**spec_record(spec), "dropout": float(spec.dropout), "base": base_identity(load)}


def adapter_push_name(entry: MergedEntry, which: str) -> str:
    """The name an adapter push sends A (``which`` "A") or B of ``entry`` under: the base weight's module,
    then ``lora_A.weight`` / ``lora_B.weight`` (``model.layers.0.self_attn.q_proj.lora_A.weight``)."""
    return f"{entry.name.rsplit('.', 1)[0]}.lora_{which}.weight"


class AdapterPush:
    """What the weight push reads from a LoRA trainer with ``lora.push: adapters``
    (``chatlearn.runtime.weight_push.stream``): the same two methods as the trainer's full view, over the
    trained tensors alone (A and B of every adapted layer, under :func:`adapter_push_name`; the trained copy
    of each ``modules_to_save`` module under the base model's name), float32; and :attr:`manifest`, what the
    receiving side needs to rebuild the merged weights (``chatlearn.models.rollout.lora_push``), with
    ``renames``: the base folder's tensor names that the trainer's model names otherwise
    (:func:`chatlearn.models.hf_folder.checkpoint_renames`: a vision-language model's).

    ``params()``: the trainer's parameters by name; ``full(p)``: the whole tensor of one (a collective for a
    sharded one); ``prepare()``: run before an export (weights onloaded, resharded)."""

    def __init__(self, merged: Merged, params: Callable[[], dict], full: Callable, prepare: Callable[[], None],
                 rank: int, device, base: str, renames: dict | None = None):
        self.merged, self.params, self.full, self.prepare = merged, params, full, prepare
        self.rank, self.device = rank, device
        shapes = {n: tuple(p.shape) for n, p in params().items()}
        self.sources: dict[str, str] = {}  # pushed name -> trainer parameter
        layers, saved = [], []
        for e in merged.entries:
            if e.lora_a is not None:
                a, b = adapter_push_name(e, "A"), adapter_push_name(e, "B")
                self.sources[a], self.sources[b] = e.lora_a, e.lora_b
                layers.append([e.name, a, b, e.scaling, e.fan_in_fan_out])
            elif _SAVED in e.param:
                self.sources[e.name] = e.param
                saved.append(e.name)
        self.specs = [(n, "float32", shapes[p], i) for i, (n, p) in enumerate(self.sources.items())]
        full_bytes = sum(4 * math.prod(shapes[e.param]) for e in merged.entries)
        self.manifest = {"base": os.path.abspath(base) if os.path.isdir(base) else base, "layers": layers,
                         "saved": saved, "full_bytes": full_bytes, "renames": dict(renames or {})}

    def weight_specs(self) -> list[tuple[str, str, tuple, int]]:
        return list(self.specs)

    @torch.no_grad()
    def export_tensors(self, names) -> Iterator[tuple[str, torch.Tensor | None]]:
        """``(pushed name, full float32 tensor on rank 0, None elsewhere)`` of the names asked for, in
        :meth:`weight_specs` order (a collective, as the trainer's ``export_tensors``)."""
        self.prepare()
        params, wanted = self.params(), set(names)
        for name, pname in self.sources.items():
            if name not in wanted:
                continue
            full = self.full(params[pname]).detach().float()
            yield name, (full if self.rank == 0 else None)
            del full
