"""The receiving side of a LoRA adapter push (``models.policy_trainer.lora.push: adapters``), engine-neutral.

The trainer sends only what trains (``chatlearn.models.trainer.lora.AdapterPush``): A and B of every adapted
layer (``<module>.lora_A.weight`` [r, in], ``<module>.lora_B.weight`` [out, r], float32) and the trained copy of
each ``modules_to_save`` module under its own name, with a manifest: per adapted layer its base weight's name,
A's and B's names, the scale alpha / r and peft's ``fan_in_fan_out``; the names sent whole; the base model's
folder. :class:`AdapterMerge` takes the update in place of the engine:

* ``begin``: opens the engine's update, limited to the modules the push touches
  (``Rollout.begin_partial_weight_update``: vLLM's layerwise reload leaves every other layer as it is);
* ``take``: the pushed buckets; the modules sent whole are loaded at once, A and B are kept (copies: the
  bucket views are only valid during the call; they are the adapters' size);
* ``finish``: for every *group* (the module that holds an adapted layer: ``model.layers.0.self_attn`` for
  ``model.layers.0.self_attn.q_proj``), every base tensor of the group is read from the base folder's
  safetensors (memory-mapped, one group at a time; the folder's names taken to the model's by the manifest's
  ``renames``, as transformers renames them at load: a vision-language model's), the adapted ones merged in
  float32 as the trainer's merged export computes them (``W + (B @ A) x scaling``, transposed for
  ``fan_in_fan_out``), and loaded through the
  engine's own ``load_weight_bucket``; then the engine's update is closed. A group is loaded whole because
  vLLM and SGLang fuse sibling projections (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``): a fused
  parameter is complete only with all of its parts.

The rollout started from the same base folder (``lora_keys._check_push``), and the base weights never change,
so every weight outside the groups is already what a full push of the merged weights would load.
"""
from __future__ import annotations

import re

import torch

from chatlearn.models.hf_folder import HFCheckpoint

CHUNK_BYTES = 256 * 2 ** 20  # base + merged tensors handed to the engine per load_weight_bucket call
_BLOCK = re.compile(r"\.\d+(\.|$)")  # a module inside a numbered block (a decoder layer)
# one expert's tensor in a Hugging Face folder (``...mlp.experts.3.gate_proj.weight``) and the fused tensor of
# every expert that holds it in transformers 5's MoE models (``...mlp.experts.gate_up_proj`` [E, 2I, H],
# ``...mlp.experts.down_proj`` [E, H, I]): what a trainer pushes for an expert module trained in full
_PER_EXPERT = re.compile(r"^(?P<experts>.*\.experts)\.\d+\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED_OF = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def fused_expert_name(name: str) -> str | None:
    """The fused transformers 5 tensor that holds the per-expert folder tensor ``name``; None for any other name."""
    m = _PER_EXPERT.match(name)
    return f"{m['experts']}.{_FUSED_OF[m['proj']]}" if m else None


def group_of(module: str, adapted: bool) -> str:
    """The module loaded whole around ``module``: the parent of an adapted layer inside a numbered block (its
    siblings may be fused with it), else the module itself (a top-level head, embedding or norm)."""
    parent = module.rsplit(".", 1)[0] if "." in module else ""
    return parent if adapted and _BLOCK.search(parent + ".") else module


def _module(weight: str) -> str:
    return weight.rsplit(".", 1)[0]


def _in_groups(name: str, groups: list[str]) -> bool:
    return any(name == g or name.startswith(g + ".") for g in groups)


class AdapterMerge:
    """One rollout replica's side of adapter pushes (module docstring); made once from the manifest and
    reused by every push."""

    def __init__(self, manifest: dict, device: torch.device | None = None):
        self.layers = {w: (a, b, float(s), bool(t)) for w, a, b, s, t in manifest["layers"]}
        self.saved = list(manifest["saved"])
        self.full_bytes = int(manifest["full_bytes"])
        self.device = device or torch.device("cpu")
        self.base = HFCheckpoint(manifest["base"])
        groups = {group_of(_module(w), True) for w in self.layers}
        groups |= {group_of(_module(w), False) for w in self.saved}
        self.groups = sorted(groups)
        # the folder's tensor names -> the model's (the trainer's names, which the push and the rollout use): a
        # vision-language folder names its language model's weights model.layers.*, the model
        # model.language_model.layers.* (the manifest's renames; none for a text model)
        renames = manifest["renames"]
        self.as_model = {n: renames[n] if n in renames else n for n in self.base.names()}
        known = set(self.as_model.values())
        missing = [w for w in self.layers if w not in known]
        if missing:
            raise KeyError(f"LoRA adapter push: the base folder {manifest['base']!r} has no weight {missing[0]!r}")
        # per group, the base tensors loaded at finish, by their folder names (those sent whole are loaded as
        # they arrive; so are the experts of a fused expert tensor sent whole, which the folder holds one expert
        # at a time)
        saved = set(self.saved)
        self.plan = [[n for n, m in self.as_model.items()
                      if _in_groups(m, [g]) and m not in saved and fused_expert_name(m) not in saved]
                     for g in self.groups]
        self.adapters: dict[str, torch.Tensor] = {}

    def begin(self, rollout) -> None:
        self.adapters = {}
        rollout.begin_partial_weight_update(list(self.groups))

    def take(self, rollout, weights) -> None:
        """One pushed bucket of ``(name, tensor)`` views: copies of A and B are kept, the rest loaded now."""
        whole = []
        for name, t in weights:
            if name.endswith((".lora_A.weight", ".lora_B.weight")):
                self.adapters[name] = t.to(self.device, copy=True)
            else:
                whole.append((name, t))
        if whole:
            rollout.load_weight_bucket(whole)

    @torch.no_grad()
    def finish(self, rollout) -> None:
        """Merge and load every group (module docstring), then close the engine's update."""
        chunk, size = [], 0
        for names in self.plan:
            for folder_name, base in self.base.read(names):
                name = self.as_model[folder_name]
                tensor = self._merged(name, base) if name in self.layers else base
                chunk.append((name, tensor))
                size += tensor.numel() * tensor.element_size()
            if size >= CHUNK_BYTES:
                rollout.load_weight_bucket(chunk)
                chunk, size = [], 0
        if chunk:
            rollout.load_weight_bucket(chunk)
        self.adapters = {}
        rollout.finish_weight_update()

    def _merged(self, name: str, base: torch.Tensor) -> torch.Tensor:
        a_name, b_name, scaling, fan_in_fan_out = self.layers[name]
        delta = (self.adapters[b_name] @ self.adapters[a_name]) * scaling
        return base.to(self.device, torch.float32) + (delta.T if fan_in_fan_out else delta)
