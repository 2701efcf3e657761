"""LoRA adapters: a LoRA run's checkpoint as peft's adapter folder, and adapters put onto their base model.

A checkpoint of a LoRA run (``models.policy_trainer.lora``, the FSDP trainer) holds only the trained
tensors, under the trainer's names (the Hugging Face model with peft's layers injected)::

    model.layers.0.self_attn.q_proj.lora_A.default.weight   A [rank, in]
    model.layers.0.self_attn.q_proj.lora_B.default.weight   B [out, rank]
    model.norm.modules_to_save.default.weight               the trained copy of model.norm.weight

and its metadata records the adapters' settings and the base model's identity (its folder and
:func:`base_identity`). ``chatlearn merge`` turns it into

- peft's adapter folder (:func:`write_adapter`): ``adapter_config.json`` (peft's own ``LoraConfig``,
  ``base_model_name_or_path`` the base folder) and ``adapter_model.safetensors`` under peft's names
  (:func:`peft_name`: those of ``get_peft_model_state_dict``), which ``PeftModel.from_pretrained(base, folder)``
  loads; beside them ``chatlearn_adapter.json``, the base's identity, which ``chatlearn eval`` checks;
- or (``--merged``) the merged model (:func:`write_merged`): every base tensor with ``W + B @ A x scale``
  where the base layer has an adapter (transposed for a ``Conv1D`` layer, as peft's ``fan_in_fan_out``),
  the trained copy where a module was trained in full, in the base's dtype, with its config.json and
  tokenizer files: a Hugging Face folder ``AutoModelForCausalLM.from_pretrained`` loads.

An adapter folder (peft's, or one written here) is merged onto its base the same way
(:func:`merge_adapter_folder`, what ``chatlearn eval`` does with one). The base is read one tensor at a
time from its safetensors files, and checked first: a base that is gone, or that is not the model the
adapters were trained on (its identity differs from the recorded one), is refused in one paragraph
naming the folder and ``--base``.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from safetensors import safe_open

from chatlearn.checkpoint import sharded
from chatlearn.checkpoint.hf_files import (CONFIG_NAME, DTYPES, FROM_SAFETENSORS, INDEX_NAME, Entry, check_out_dir,
                                           check_trust, dcp_found, finish_folder, plan_tensors, raise_write_refusal,
                                           read_dcp_tensor, write_folder, write_shard)
from chatlearn.errors import UserError
from chatlearn.hub import looks_like_hub_id, snapshot

ADAPTER = "default"  # peft's adapter name
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"
BASE_RECORD = "chatlearn_adapter.json"  # the base model's identity, beside peft's files
PEFT_PREFIX = "base_model.model."
_A, _B = f".lora_A.{ADAPTER}.", f".lora_B.{ADAPTER}."
_SAVED = f".modules_to_save.{ADAPTER}."
_BASE_FLAG = "Pass --base DIR with the base model the adapters were trained on (a copy of that folder will do)"


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


def peft_name(name: str) -> str:
    """peft's name of a trained parameter (``get_peft_model_state_dict``): ``base_model.model.`` in
    front, the adapter's name left out (``q_proj.lora_A.weight``, ``lm_head.weight``)."""
    return PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".").replace(".modules_to_save.", ".")


@dataclass
class LoraWeights:
    """Adapters to put onto a base model. ``pairs``: base weight name -> the keys of its A and B;
    ``replaced``: base tensor name -> the key of its trained copy (``modules_to_save``); ``found``:
    key -> (shape, dtype) of every tensor; ``read(key)`` one tensor; ``scaling`` alpha / rank."""

    pairs: dict[str, tuple[str, str]]
    replaced: dict[str, str]
    found: dict[str, tuple[tuple, torch.dtype]]
    read: Callable[[str], torch.Tensor]
    scaling: float
    problems: list[str] = field(default_factory=list)


def _checkpoint_weights(ckpt: str, meta: dict) -> LoraWeights:
    """The adapters of a LoRA checkpoint (its DCP model entries, under the trainer's names)."""
    found = dcp_found(ckpt)
    pairs, replaced, problems = {}, {}, []
    for name, md in found.items():
        if md is None:
            problems.append(f"key {name!r} is not a tensor in the checkpoint")
        elif _A in name:
            owner, rest = name.split(_A, 1)
            pairs[f"{owner}.{rest}"] = (name, f"{owner}{_B}{rest}")
        elif _SAVED in name:
            replaced[name.replace(_SAVED, ".")] = name
        elif _B not in name:
            problems.append(f"key {name!r} is neither an adapter nor a module trained in full")
    problems += [f"key {b!r} (the B of {a!r}) is missing" for a, b in pairs.values() if b not in found]
    reader = sharded.SafeFileSystemReader(ckpt)
    lora = meta["lora"]
    return LoraWeights(pairs, replaced, {k: v for k, v in found.items() if v is not None},
                       lambda key: read_dcp_tensor(reader, Entry(key, *found[key], found[key][1])),
                       float(lora["alpha"]) / int(lora["rank"]), problems)


def read_adapter_config(path: str) -> dict:
    """``adapter_config.json`` of the adapter folder ``path``, or a UserError naming it."""
    file = os.path.join(path, ADAPTER_CONFIG)
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        raise UserError(f"{file} cannot be read as peft's adapter config ({err}). Point at an adapter folder "
                        "written by peft's save_pretrained or chatlearn merge.") from None
    unsupported = [f"peft_type {config.get('peft_type')!r}" if config.get("peft_type") != "LORA" else "",
                   "rank_pattern" if config.get("rank_pattern") else "",
                   "alpha_pattern" if config.get("alpha_pattern") else "",
                   "use_dora" if config.get("use_dora") else "",
                   f"bias {config.get('bias')!r}" if config.get("bias", "none") != "none" else ""]
    unsupported = [u for u in unsupported if u]
    if unsupported or not isinstance(config.get("r"), int) or config["r"] < 1:
        what = ", ".join(unsupported) or f"r {config.get('r')!r}"
        raise UserError(f"{file}: the adapters use {what}, which chatlearn cannot merge (plain LoRA only: "
                        "peft_type LORA, one rank and alpha for every layer, no DoRA, bias none). Merge them "
                        "with peft's merge_and_unload and evaluate the merged folder.")
    return config


def _folder_weights(path: str, config: dict) -> LoraWeights:
    """The adapters of peft's folder ``path`` (``adapter_model.safetensors`` or ``.bin``, peft's names)."""
    file = os.path.join(path, ADAPTER_WEIGHTS)
    if os.path.isfile(file):
        with safe_open(file, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (adapters are small)
    elif os.path.isfile(os.path.join(path, ADAPTER_BIN)):
        tensors = torch.load(os.path.join(path, ADAPTER_BIN), map_location="cpu", weights_only=True)
    else:
        raise UserError(f"the adapter folder {path!r} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS} (or "
                        f"{ADAPTER_BIN}): its weights are missing. Copy the whole adapter folder.")
    pairs, replaced, problems = {}, {}, []
    for key in tensors:
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        if ".lora_A." in name:
            owner, rest = name.split(".lora_A.", 1)
            pairs[f"{owner}.{rest}"] = (key, key.replace(".lora_A.", ".lora_B.", 1))
        elif ".lora_" in name:
            if ".lora_B." not in name:
                problems.append(f"{ADAPTER_WEIGHTS} holds {key!r}, which is not a LoRA A or B")
        else:
            replaced[name] = key
    problems += [f"key {b!r} (the B of {a!r}) is missing" for a, b in pairs.values() if b not in tensors]
    scale = math.sqrt(config["r"]) if config.get("use_rslora") else config["r"]
    return LoraWeights(pairs, replaced, {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()},
                       tensors.__getitem__, float(config.get("lora_alpha", 8)) / scale, problems)


def find_base(base: str, record: dict | None, what: str) -> str:
    """The base model folder ``base``, checked: a Hugging Face folder (a Hub id: its snapshot in the cache),
    and, when ``record`` (the identity recorded when the adapters were trained) is given, that same model.
    A UserError naming the folder and ``--base`` otherwise. ``what``: the adapters, for the message."""
    if not os.path.isdir(base) and looks_like_hub_id(base):
        base = snapshot(base, key="--base", local_hint="a local model folder").path
    if not os.path.isfile(os.path.join(base, CONFIG_NAME)):
        raise UserError(f"{what} were trained on the base model {base!r}, which is not a Hugging Face model folder "
                        f"now (moved, deleted, or no {CONFIG_NAME} in it), and adapters are only a difference to "
                        f"that model. {_BASE_FLAG}.")
    if record and base_identity(base)["sha256"] != record.get("sha256"):
        raise UserError(f"{what} were trained on the base model {record.get('folder')!r}, and {base!r} is not that "
                        "model now: its config.json, safetensors index or weight files differ from those recorded "
                        "when the adapters were trained, and adapters put onto another model give one nobody "
                        f"trained. {_BASE_FLAG}, or restore that folder.")
    return os.path.abspath(base)


def _base_tensors(base: str) -> dict[str, tuple[tuple, torch.dtype, str]]:
    """``{name: (shape, dtype, file)}`` of the base model's safetensors files (headers only)."""
    index = os.path.join(base, INDEX_NAME)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(base) if n.endswith(".safetensors"))
    if not files:
        raise UserError(f"the base model {base!r} holds no safetensors weights (chatlearn reads the base one tensor "
                        "at a time from safetensors files). Save it once with save_pretrained(folder) and pass that "
                        "folder as --base.")
    out = {}
    for name in files:
        file = os.path.join(base, name)
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                sl = f.get_slice(key)
                out[key] = (tuple(sl.get_shape()), FROM_SAFETENSORS.get(sl.get_dtype(), torch.float32), file)
    return out


def _base_layout(base: str, trust: bool) -> tuple[set[str], dict[str, str]]:
    """The weights of the base's ``Conv1D`` layers (GPT-2's: stored [in, out], peft's ``fan_in_fan_out``),
    and its tied aliases (``{alias: name}``), from its model built on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    try:
        config = AutoConfig.from_pretrained(base, trust_remote_code=trust)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust)
    except Exception as err:  # anything raised here comes from config.json (or its code)
        cause = " ".join(str(err).split()) or type(err).__name__
        raise UserError(f"cannot build the model described by {os.path.join(base, CONFIG_NAME)!r} ({cause}). "
                        f"{_BASE_FLAG}.") from None
    return ({f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Conv1D)},
            sharded.tied_aliases(model))


def _lora_problems(lora: LoraWeights, base_found: dict, conv1d: set[str]) -> list[str]:
    """Adapters that do not fit the base: a layer or module it lacks, shapes that do not multiply."""
    problems = list(lora.problems)
    for name, (ka, kb) in lora.pairs.items():
        if name not in base_found:
            problems.append(f"the adapter {ka!r} belongs to {name!r}, which the base model does not have")
            continue
        if kb not in lora.found:
            continue
        (r, n_in), (n_out, r_b) = lora.found[ka][0], lora.found[kb][0]
        shape = (n_in, n_out) if name in conv1d else (n_out, n_in)
        if r != r_b or tuple(base_found[name][0]) != shape:
            problems.append(f"{name!r} has shape {list(base_found[name][0])} in the base, its adapters A "
                            f"{list(lora.found[ka][0])} and B {list(lora.found[kb][0])}")
    for name, key in lora.replaced.items():
        if name not in base_found:
            problems.append(f"the trained module tensor {key!r} replaces {name!r}, which the base model does not have")
        elif tuple(base_found[name][0]) != tuple(lora.found[key][0]):
            problems.append(f"{key!r} has shape {list(lora.found[key][0])}, {name!r} {list(base_found[name][0])} "
                            "in the base")
    return problems


def write_merged(what: str, source: str, lora: LoraWeights, base: str, out_dir: str, *, dtype: str | None,
                 max_bytes: int, trust_remote_code: bool, log: Callable[[str], None], meta: dict | None = None) -> dict:
    """The merged model of ``lora`` on ``base`` (checked by :func:`find_base`) as the Hugging Face folder
    ``out_dir`` (absolute, checked empty): the base's tensors with ``W + B @ A x scaling`` computed in float32
    (transposed for a ``Conv1D`` layer), the trained copies in place of theirs, cast to ``dtype`` (default:
    the dtype of the base's weights); config.json and the tokenizer files from ``base``. ``what``: the
    adapters, ``source``: their checkpoint or folder, for the messages."""
    base_found = _base_tensors(base)
    if dtype is None:  # the base's dtype: that of most of its floating tensors
        floats = Counter(d for _, d, _ in base_found.values() if d.is_floating_point)
        dtype = next((n for n, d in DTYPES.items() if floats and d == floats.most_common(1)[0][0]), "float32")
    meta = meta or {}
    trust = check_trust(source, meta, base, trust_remote_code)
    conv1d, tied = _base_layout(base, trust)
    problems = _lora_problems(lora, base_found, conv1d)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UserError(f"{what} do not fit the base model {base!r}: {'; '.join(problems[:5])}{more}. "
                        f"{_BASE_FLAG}.")
    found = {n: (shape, d) for n, (shape, d, _) in base_found.items() if n not in tied}
    entries = plan_tensors(source, {**meta, "tied": tied}, base, DTYPES[dtype], found,
                           trust_remote_code=trust_remote_code)

    def read(entry: Entry) -> torch.Tensor:
        if entry.name in lora.replaced:
            return lora.read(lora.replaced[entry.name])
        with safe_open(base_found[entry.name][2], framework="pt") as f:
            weight = f.get_tensor(entry.name)
        if entry.name not in lora.pairs:
            return weight
        ka, kb = lora.pairs[entry.name]
        delta = (lora.read(kb).float() @ lora.read(ka).float()) * lora.scaling
        return weight.float() + (delta.T if entry.name in conv1d else delta)

    return write_folder(out_dir, entries, read, base, dtype, max_bytes, what=source, log=log)


def write_adapter(ckpt: str, meta: dict, lora: LoraWeights, base: str, out_dir: str, *, dtype: str | None,
                  log: Callable[[str], None]) -> dict:
    """peft's adapter folder ``out_dir`` (absolute, checked empty) of the LoRA checkpoint ``ckpt``:
    ``adapter_config.json`` (peft's ``LoraConfig`` of the recorded settings, ``base_model_name_or_path``
    ``base``; ``all-linear`` written as the layers it took, as peft writes it), ``adapter_model.safetensors``
    (peft's names; as trained, or cast to ``dtype``) and :data:`BASE_RECORD` (the base's identity)."""
    try:
        from peft import LoraConfig
    except ImportError:
        raise UserError(f"checkpoint {ckpt!r} holds LoRA adapters, and writing peft's adapter folder needs peft: "
                        "pip install -e '.[lora]' (or pass --merged for the merged Hugging Face model, which does "
                        "not).") from None
    record = meta["lora"]
    targets = record["target_modules"]
    if isinstance(targets, str) and targets.lower() == "all-linear":
        targets = sorted(name.rsplit(".", 1)[0] for name in lora.pairs)
    config = LoraConfig(r=int(record["rank"]), lora_alpha=float(record["alpha"]),
                        lora_dropout=float(record.get("dropout", 0.0)), target_modules=targets,
                        modules_to_save=list(record["modules_to_save"]) or None, bias="none",
                        task_type="CAUSAL_LM", base_model_name_or_path=base, inference_mode=True)
    keys = sorted(k for pair in lora.pairs.values() for k in pair) + sorted(lora.replaced.values())
    entries = [Entry(peft_name(k), lora.found[k][0], lora.found[k][1],
                     DTYPES[dtype] if dtype else lora.found[k][1]) for k in keys]
    by_name = dict(zip((e.name for e in entries), keys))
    tmp = out_dir + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        config.save_pretrained(tmp)
        write_shard(os.path.join(tmp, ADAPTER_WEIGHTS), entries, lambda e: lora.read(by_name[e.name]))
        with open(os.path.join(tmp, BASE_RECORD), "w", encoding="utf-8") as f:
            json.dump({"base": record["base"], "checkpoint": ckpt}, f, indent=1)
            f.write("\n")
        finish_folder(tmp, out_dir)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise_write_refusal(err, out_dir, tmp, "the adapter folder")
        raise
    total = sum(e.nbytes for e in entries)
    log(f"wrote {ADAPTER_WEIGHTS} ({total / 1e6:.1f} MB, {len(entries)} tensors) and {ADAPTER_CONFIG}")
    return {"out_dir": out_dir, "dtype": dtype or (sharded.dtype_name(entries[0].out_dtype) if entries else "float32"),
            "num_tensors": len(entries), "total_bytes": total, "shards": [ADAPTER_WEIGHTS],
            "copied": [ADAPTER_CONFIG, BASE_RECORD], "adapter": True}


def merge_lora_checkpoint(ckpt: str, meta: dict, out_dir: str, *, base: str | None, merged: bool,
                          dtype: str | None, max_bytes: int, trust_remote_code: bool,
                          log: Callable[[str], None]) -> dict:
    """``chatlearn merge`` of a LoRA checkpoint: peft's adapter folder, or with ``merged`` the merged model.
    ``base`` (``--base``): the base model's folder, when it is not where the checkpoint records it."""
    what = f"the LoRA adapters of checkpoint {ckpt!r}"
    record = meta["lora"].get("base") or {}
    named = base or record.get("folder")
    if not named:
        raise UserError(f"{what} record no base model. {_BASE_FLAG}.")
    base = find_base(named, record, what)
    check_out_dir(out_dir)
    lora = _checkpoint_weights(ckpt, meta)
    if merged:
        return write_merged(what, ckpt, lora, base, out_dir, dtype=dtype, max_bytes=max_bytes,
                            trust_remote_code=trust_remote_code, log=log, meta=meta)
    if lora.problems:
        raise UserError(f"{what} are damaged: {'; '.join(lora.problems[:5])}. Use another checkpoint.")
    return write_adapter(ckpt, meta, lora, base, out_dir, dtype=dtype, log=log)


def merge_adapter_folder(path: str, out_dir: str, *, base: str | None = None, dtype: str | None = None,
                         max_bytes: int = 5 * 10 ** 9, trust_remote_code: bool = False,
                         log: Callable[[str], None] | None = None) -> dict:
    """The adapter folder ``path`` (peft's ``adapter_config.json`` and weights) merged onto its base model
    (``base``, else the config's ``base_model_name_or_path``; checked against :data:`BASE_RECORD` when the
    folder has one) into the Hugging Face folder ``out_dir``."""
    config = read_adapter_config(path)
    what = f"the LoRA adapters in {path!r}"
    record = None
    if os.path.isfile(os.path.join(path, BASE_RECORD)):
        with open(os.path.join(path, BASE_RECORD), encoding="utf-8") as f:
            record = json.load(f).get("base")
    named = base or config.get("base_model_name_or_path")
    if not named:
        raise UserError(f"{os.path.join(path, ADAPTER_CONFIG)} names no base model (base_model_name_or_path), and "
                        f"adapters are only a difference to one. {_BASE_FLAG}.")
    base = find_base(named, record, what)
    out_dir = os.path.abspath(out_dir)
    check_out_dir(out_dir)
    return write_merged(what, path, _folder_weights(path, config), base, out_dir, dtype=dtype, max_bytes=max_bytes,
                        trust_remote_code=trust_remote_code, log=log or (lambda msg: None))
