"""A Hugging Face model folder read one tensor at a time (the Megatron trainer's load, the rollout's base
weights under a LoRA adapter push), without loading the whole checkpoint."""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open


class HFCheckpoint:
    """Reads single tensors of a Hugging Face model folder (safetensors or torch .bin,
    single file or sharded with an index), without loading the whole checkpoint."""

    def __init__(self, path: str):
        self.path = path
        self.files: dict[str, str] = {}
        for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            file = os.path.join(path, index)
            if os.path.isfile(file):
                with open(file, encoding="utf-8") as f:
                    self.files = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
                break
        else:
            for single in ("model.safetensors", "pytorch_model.bin"):
                if os.path.isfile(os.path.join(path, single)):
                    self.files = {"*": os.path.join(path, single)}
                    break
        if not self.files:
            raise FileNotFoundError(f"{path}: no model.safetensors or pytorch_model.bin "
                                    "(with or without an index) found")
        self._bins: dict[str, dict] = {}

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds the tensor ``name``."""
        try:
            self.get(name)
        except KeyError:
            return False
        return True

    def get(self, name: str) -> torch.Tensor:
        file = self.files[name] if name in self.files else self.files.get("*")
        if file is None:
            raise KeyError(f"{self.path}: tensor {name!r} is not in the checkpoint")
        if file.endswith(".safetensors"):
            with safe_open(file, framework="pt") as f:
                if name not in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    raise KeyError(f"{file}: tensor {name!r} is not in the checkpoint")
                return f.get_tensor(name)
        if file not in self._bins:
            self._bins[file] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        return self._bins[file][name]

    def names(self) -> list[str]:
        """Every tensor name of the checkpoint (a single unindexed file: its own keys)."""
        if "*" not in self.files:
            return list(self.files)
        file = self.files["*"]
        if file.endswith(".safetensors"):
            with safe_open(file, framework="pt") as f:
                return list(f.keys())
        if file not in self._bins:
            self._bins[file] = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        return list(self._bins[file])

    def read(self, names: list[str]) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of ``names`` in the order given; each safetensors file is opened once."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name] if name in self.files else self.files["*"], []).append(name)
        out: dict[str, torch.Tensor] = {}
        for file, group in by_file.items():
            if not file.endswith(".safetensors"):
                out.update((n, self.get(n)) for n in group)
                continue
            with safe_open(file, framework="pt") as f:
                for name in group:
                    out[name] = f.get_tensor(name)
        return [(n, out[n]) for n in names]


def checkpoint_renames(model, names) -> dict[str, str]:
    """The folder's tensor names (``names``) that transformers renames when it loads them into ``model``, each
    to the parameter name it loads as (the model's own conversion mapping, renaming rules alone: e.g. Qwen2-VL's
    ``model.layers.*`` to ``model.language_model.layers.*``, ``visual.*`` to ``model.visual.*``). Empty for a
    folder whose names are the model's: the text models; an MoE folder's per-expert tensors, which transformers
    fuses, keep their names here (``chatlearn.models.rollout.lora_push`` reads them one expert at a time)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    renamings = [c for c in get_model_conversion_mapping(model) if not isinstance(c, WeightConverter)]
    out = {}
    for name in names:
        new = rename_source_key(name, renamings, [])[0]
        if new != name:
            out[name] = new
    return out
