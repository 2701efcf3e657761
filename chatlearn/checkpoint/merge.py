"""Offline merge: a sharded trainer checkpoint -> a Hugging Face model folder.

``merge_checkpoint(ckpt_dir, out_dir)`` reads the model entries (``model.*``) of a
checkpoint written by ``FSDPTrainer.save_checkpoint`` (any number of ranks) and writes what
``save_pretrained`` would: safetensors shards split by size (``model.safetensors``, or
``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``), config.json
with its ``dtype`` set, and the other files of the Hugging Face folder the trainer loaded
(generation config, tokenizer, chat template).

It streams: the shard headers are computed from the checkpoint metadata up front, then each
tensor is read alone from the DCP files (``dcp.load`` of one key, which reads only that
tensor's chunks), cast, and appended to its shard. Peak memory is about the largest tensor
(plus one rank's chunk of it), whatever the model size. The optimizer state is never read.

Every tensor is checked against the model that config.json describes (built on the
``meta`` device, so no memory is allocated): a missing key, an unexpected key, a wrong shape
or a non-float tensor where a float one belongs is a UserError naming the key. Tied weights
(``lm_head.weight`` with ``tie_word_embeddings``) are not written, as ``save_pretrained``
does not write them.

A Megatron trainer checkpoint (``MegatronTrainer.save_checkpoint``: one safetensors file per
rank) is merged the same way: for each Megatron parameter the tensor-parallel shards are read
one at a time from the ranks of data-parallel rank 0 (each pipeline stage holds its layers
under their global names) into the full Megatron layout, which the trainer's own mapping
(``chatlearn.checkpoint.megatron_mapping.to_hf``) turns into the Hugging Face tensors: fused
QKV split per query group, fused gate/up split, vocabulary padding cut. Peak memory is about
one full parameter. The shapes are checked up front from the safetensors headers. A Megatron
critic's checkpoint (``role`` critic in its metadata) gives the token-classification folder, its
value head ``output_layer`` written as ``score.weight`` / ``score.bias``.

The folder is written by :mod:`chatlearn.checkpoint.hf_files` (the checks against config.json, the
shards, the other files). A LoRA checkpoint (adapters only) is written as peft's adapter folder, or as
the merged model, by :mod:`chatlearn.checkpoint.adapters`.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import Callable

import torch
from safetensors import safe_open

from chatlearn.checkpoint import adapters, megatron_format, sharded
from chatlearn.checkpoint.hf_files import (CONFIG_NAME, DTYPES, FROM_SAFETENSORS, Entry, check_out_dir, dcp_found,
                                           is_value_model, plan_tensors, read_dcp_tensor, write_folder)
from chatlearn.checkpoint.manager import check_against_manifest
from chatlearn.checkpoint.megatron_mapping import HFArch, mappings, to_hf
from chatlearn.errors import UserError
from chatlearn.hub import looks_like_hub_id, snapshot

DEFAULT_MAX_SHARD_SIZE = "5GB"
_EXPERT_PARAM = ".mlp.experts.local_experts."  # a routed expert's parameter (by global id) in a Megatron checkpoint
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5 * 10**9 bytes, ``"500MiB"`` -> 500 * 2**20, ``"1000"`` -> 1000 (as
    ``save_pretrained``'s ``max_shard_size``: KB/MB/GB are powers of 10)."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise UserError(f"max shard size {text!r} is not a size. Write it as a number of "
                            "bytes or with a unit, e.g. 5GB, 500MB or 2GiB.")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])
    if value <= 0:
        raise UserError(f"max shard size {text!r} must be positive, e.g. 5GB.")
    return value


# --------------------------------------------------------------------------- inputs


def check_merge_out(out_dir: str, ckpt_dir: str) -> None:
    """Refuse, in one paragraph before anything is read or written, an ``out_dir`` that cannot be a new model
    folder: a file, under a file, inside the checkpoint read, already holding files, or in a folder this user
    cannot write."""
    out = os.path.abspath(out_dir)
    near = out
    while not os.path.lexists(near) and os.path.dirname(near) != near:
        near = os.path.dirname(near)
    problem = None
    if near == out and os.path.lexists(out) and not os.path.isdir(out):
        problem = "it is a file. Name a new folder"
    elif not os.path.isdir(near):
        problem = f"it lies under {near!r}, which is a file, not a folder: nothing can be created there. Name " \
                  "a folder elsewhere, or move that file"
    elif _inside(out, ckpt_dir):
        problem = f"it lies inside the checkpoint {os.path.abspath(ckpt_dir)!r} being merged, whose files it would " \
                  "mix with. Name a folder outside the checkpoint"
    elif not os.access(near, os.W_OK | os.X_OK):
        problem = f"{near!r} is not writable for this user. Name a folder you can write, or change its permissions"
    if problem is not None:
        raise UserError(f"chatlearn merge cannot write its output folder {out_dir!r}: {problem}.")
    check_out_dir(out)


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def find_checkpoint(path: str) -> str:
    """``path`` itself, or its ``trainer/`` subfolder when ``path`` is a run's checkpoint
    folder that keeps the trainer state there."""
    inner = os.path.join(path, "trainer")
    if (not os.path.isfile(os.path.join(path, sharded.META_FILE))
            and os.path.isfile(os.path.join(inner, sharded.META_FILE))):
        return inner
    return path


def _source_folder(ckpt: str, meta: dict, hf_config: str | None) -> str:
    """The Hugging Face folder to take config.json and the tokenizer from."""
    if hf_config is not None:
        if looks_like_hub_id(hf_config):  # the base model named by its Hub id: its snapshot in the HF cache
            hf_config = snapshot(hf_config, key="--hf-config", local_hint="a local model folder").path
        if not os.path.isfile(os.path.join(hf_config, CONFIG_NAME)):
            raise UserError(f"--hf-config {hf_config!r} is not a Hugging Face model folder "
                            f"(no {CONFIG_NAME} in it). Pass the folder of the model the "
                            "trainer loaded (config.json, tokenizer files).")
        return hf_config
    src = meta.get("hf_source")
    if not src or not os.path.isfile(os.path.join(src, CONFIG_NAME)):
        raise UserError(f"the model folder that checkpoint {ckpt!r} was trained from, {src!r}, "
                        f"is gone or has no {CONFIG_NAME}. Pass --hf-config DIR with a copy of "
                        "that folder (config.json, tokenizer files).")
    return src


# --------------------------------------------------------------------------- Megatron


def _checkpoint_format(path: str) -> str | None:
    """The ``format`` recorded in ``path``'s metadata file (None when unreadable: the
    format's own reader then says what is wrong)."""
    try:
        with open(os.path.join(path, sharded.META_FILE), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta.get("format") if isinstance(meta, dict) else None


class _MegatronSource:
    """The model tensors of a Megatron trainer checkpoint, as Hugging Face tensors.

    ``found``: ``{hf name: (shape, dtype) or None}`` from the safetensors headers (the full
    shapes are run through the trainer's mapping on the ``meta`` device); ``problems``: what
    does not fit. ``read(entry)``: one Hugging Face tensor; the other tensors of the same
    Megatron parameter (q/k/v, gate/up) are kept until they are asked for (they come next
    in the model's order). A critic's checkpoint (``role`` critic) maps its ``output_layer`` to
    the value head ``score`` (``megatron_mapping.mappings(..., value_head=True)``)."""

    def __init__(self, ckpt: str, meta: dict, src: str):
        self.ckpt = ckpt
        self.problems: list[str] = []
        self.found: dict = {}
        self._cache: dict[str, torch.Tensor] = {}
        try:
            self.arch = HFArch.from_folder(src)
        except (NotImplementedError, KeyError, OSError, ValueError) as err:
            raise UserError(f"cannot map checkpoint {ckpt!r} to the model of "
                            f"{os.path.join(src, CONFIG_NAME)!r} ({err}). Pass --hf-config DIR "
                            "with the folder of the model the trainer loaded.") from None
        try:
            self.tp = int(meta["tensor_model_parallel_size"])
            self.pp = int(meta["pipeline_model_parallel_size"])
            world = int(meta["world_size"])
            if min(self.tp, self.pp, world) < 1 or world % (self.tp * self.pp):
                raise ValueError(f"world_size {world} is not a multiple of tp x pp")
        except (KeyError, TypeError, ValueError) as err:
            raise UserError(f"the metadata of checkpoint {ckpt!r} has no valid parallel layout "
                            f"({err}): the checkpoint is damaged. Use another checkpoint.") from None
        saved_experts = meta.get("num_experts")
        if saved_experts is not None and saved_experts != self.arch.num_experts:
            raise UserError(f"checkpoint {ckpt!r} holds a model with {saved_experts} experts per MoE layer, and "
                            f"{os.path.join(src, CONFIG_NAME)!r} describes {self.arch.num_experts}. Pass --hf-config "
                            "DIR with the folder of the model the trainer loaded.")
        self.etp = int(meta.get("expert_tensor_parallel_size") or self.tp)
        coords = self._rank_coords(ckpt, meta, world)
        # the ranks of data-parallel rank 0 hold one copy of every shard of the attention and the dense
        # MLPs (by tensor-parallel rank); those of expert-data-parallel rank 0 one copy of every routed
        # expert's (by expert-tensor-parallel rank; each expert-parallel rank its own experts, by global id)
        self.shards: dict[str, dict[int, tuple[str, tuple, str]]] = {}
        for rank, c in enumerate(coords):
            if c["dp"] != 0 and c.get("edp", c["dp"]) != 0:
                continue
            file = megatron_format.rank_file(ckpt, rank)
            if not os.path.isfile(file):
                raise UserError(f"checkpoint {ckpt!r} has no shard for rank {rank} ({file} "
                                "is missing): the checkpoint is damaged. Use another "
                                "checkpoint.")
            from chatlearn.config.load import safetensors_problem  # noqa: PLC0415

            problem = safetensors_problem(file)
            if problem:
                raise UserError(f"checkpoint {ckpt!r}: the shard of rank {rank}, {file}, {problem}. The "
                                "checkpoint is damaged. Use another checkpoint, or restore it from a copy.")
            with safe_open(file, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    if not key.startswith("model."):
                        continue
                    expert = _EXPERT_PARAM in key
                    if (c.get("edp", c["dp"]) if expert else c["dp"]) != 0:
                        continue
                    sl = f.get_slice(key)
                    self.shards.setdefault(key[len("model."):], {})[c.get("etp", c["tp"]) if expert else c["tp"]] = (
                        file, tuple(sl.get_shape()), sl.get_dtype())
        self.value_head = meta.get("role") == "critic"
        self.mappings = {}
        for m in mappings(self.arch, value_head=self.value_head):
            for name in m.hf:
                self.mappings[name] = m
        known = {m.megatron for m in self.mappings.values()}
        if self.arch.tied_embeddings and not self.value_head:
            known.add("output_layer.weight")  # the last stage's copy of the embeddings
        for name in self.shards:
            if name not in known:
                self.problems.append(f"unexpected Megatron parameter {name!r} (not in the "
                                     f"model that {os.path.join(src, CONFIG_NAME)} describes)")
        done = set()
        for m in self.mappings.values():
            if m.megatron in done:
                continue
            done.add(m.megatron)
            self._describe(m)

    @staticmethod
    def _rank_coords(ckpt: str, meta: dict, world: int) -> list[dict]:
        """Each rank's ``tp``, ``pp``, ``dp`` (and for a MoE model ``ep``, ``etp``, ``edp``): as the
        checkpoint recorded them (``ranks``), else Megatron's default order without experts
        (tp-dp-pp: rank = tp_rank + tp * (dp_rank + dp * pp_rank))."""
        ranks = meta.get("ranks")
        if ranks is not None:
            if (not isinstance(ranks, list) or len(ranks) != world
                    or not all(isinstance(c, dict) and {"tp", "pp", "dp"} <= set(c) for c in ranks)):
                raise UserError(f"the metadata of checkpoint {ckpt!r} lists its ranks wrongly: the checkpoint is "
                                "damaged. Use another checkpoint.")
            return ranks
        tp, pp = int(meta["tensor_model_parallel_size"]), int(meta["pipeline_model_parallel_size"])
        dp = world // (tp * pp)
        return [{"tp": r % tp, "dp": (r // tp) % dp, "pp": r // (tp * dp)} for r in range(world)]

    def _split(self, m) -> int:
        """How many ranks split ``m``: a routed expert's expert-tensor-parallel ones, else the tensor-parallel."""
        return self.etp if m.expert is not None else self.tp

    def _full_shape(self, m) -> tuple[tuple, torch.dtype] | None:
        shards = self.shards.get(m.megatron)
        if shards is None:
            return None  # reported as missing Hugging Face keys
        n = self._split(m)
        if sorted(shards) != list(range(n)):
            absent = sorted(set(range(n)) - set(shards))
            self.problems.append(f"Megatron parameter {m.megatron!r} has no shard for "
                                 f"{'expert-' if m.expert is not None else ''}tensor-parallel rank(s) {absent}")
            return None
        shapes = [shards[r][1] for r in range(n)]
        dtypes = {shards[r][2] for r in range(n)}
        if len(dtypes) > 1 or next(iter(dtypes)) not in FROM_SAFETENSORS:
            self.problems.append(f"Megatron parameter {m.megatron!r} has dtype(s) "
                                 f"{sorted(dtypes)} in the checkpoint")
            return None
        dim = m.split_dim
        rest = [s[:dim] + s[dim + 1:] if dim is not None and len(s) > dim else s for s in shapes]
        if any(r != rest[0] for r in rest) or (dim is not None and len(shapes[0]) <= dim):
            self.problems.append(f"Megatron parameter {m.megatron!r}: its tensor-parallel "
                                 f"shards have shapes {[list(s) for s in shapes]}, which do not "
                                 "concatenate")
            return None
        full = list(shapes[0])
        if dim is not None:
            full[dim] = sum(s[dim] for s in shapes)
        return tuple(full), FROM_SAFETENSORS[dtypes.pop()]

    def _describe(self, m) -> None:
        got = self._full_shape(m)
        if got is None:
            return
        shape, dtype = got
        try:
            outs = to_hf(self.arch, m, torch.empty(shape, dtype=dtype, device="meta"), self._split(m))
        except RuntimeError as err:
            self.problems.append(f"Megatron parameter {m.megatron!r} of shape {list(shape)} "
                                 f"does not split into {list(m.hf)} "
                                 f"({' '.join(str(err).split())})")
            return
        for name, t in zip(m.hf, outs):
            self.found[name] = (tuple(t.shape), dtype)

    def read(self, entry: Entry) -> torch.Tensor:
        if entry.name in self._cache:
            return self._cache.pop(entry.name)
        m = self.mappings[entry.name]
        shape, dtype = self._full_shape(m)
        shards = self.shards[m.megatron]
        if m.split_dim is None:
            with safe_open(shards[0][0], framework="pt") as f:
                full = f.get_tensor(f"model.{m.megatron}")
        else:  # one shard at a time into the full tensor
            full = torch.empty(shape, dtype=dtype)
            start = 0
            for r in range(self._split(m)):
                file, shard_shape, _ = shards[r]
                size = shard_shape[m.split_dim]
                with safe_open(file, framework="pt") as f:
                    full.narrow(m.split_dim, start, size).copy_(f.get_tensor(f"model.{m.megatron}"))
                start += size
        outs = dict(zip(m.hf, to_hf(self.arch, m, full, self._split(m))))
        del full
        tensor = outs.pop(entry.name)
        self._cache.update(outs)
        return tensor


def merge_checkpoint(ckpt_dir: str, out_dir: str, *, hf_config: str | None = None,
                     dtype: str | None = None, max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
                     trust_remote_code: bool = False, base: str | None = None, merged: bool = False,
                     log: Callable[[str], None] | None = None) -> dict:
    """Write the Hugging Face folder ``out_dir`` from the trainer checkpoint ``ckpt_dir``.

    ``hf_config``: the folder to take config.json and the tokenizer files from (default: the
    one the trainer loaded, recorded in the checkpoint). ``dtype``: float32 (the default), bfloat16 or
    float16 (floating tensors are cast to it). ``max_shard_size``: bytes per safetensors
    file, as ``save_pretrained``'s. ``trust_remote_code``: allow running the Python code a
    model folder names in its config.json (``auto_map``); the value recorded in the
    checkpoint is never used for that. ``out_dir`` must not exist or be empty; it is written
    under a temporary name and renamed when complete.

    A checkpoint of a LoRA run (``models.policy_trainer.lora``: adapters only) gives peft's adapter
    folder, or with ``merged`` the merged model (in the base model's dtype unless ``dtype`` names one);
    ``base``: its base model folder when it is no longer where the checkpoint records it
    (:mod:`chatlearn.checkpoint.adapters`).

    Returns a summary: out_dir, dtype, num_tensors, total_bytes, shards (file names),
    copied (other files), seconds. Bad input raises a UserError.
    """
    start = time.monotonic()
    log = log or (lambda msg: None)
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} is not supported. Choose one of {', '.join(DTYPES)}.")
    if sys.byteorder != "little":
        raise RuntimeError("safetensors files are little-endian; this machine is not")
    max_bytes = parse_size(max_shard_size)
    ckpt = find_checkpoint(ckpt_dir)
    check_merge_out(out_dir, ckpt_dir)
    check_against_manifest(ckpt, "checkpoint")
    megatron = _checkpoint_format(ckpt) == megatron_format.FORMAT
    meta = megatron_format.read_meta(ckpt, {}) if megatron else sharded.read_meta(ckpt)
    if not megatron and isinstance(meta, dict) and meta.get("lora"):
        if hf_config is not None:
            raise UserError(f"--hf-config does not apply to checkpoint {ckpt!r}: it holds LoRA adapters, whose "
                            "config, tokenizer and weights come from their base model. Pass --base DIR to name "
                            "the base model folder instead.")
        out = adapters.merge_lora_checkpoint(ckpt, meta, os.path.abspath(out_dir), base=base, merged=merged,
                                             dtype=dtype, max_bytes=max_bytes, trust_remote_code=trust_remote_code,
                                             log=log)
        return {**out, "seconds": time.monotonic() - start}
    if base is not None:
        raise UserError(f"--base names the base model of LoRA adapters, and checkpoint {ckpt!r} holds a whole "
                        "model, not adapters. Leave --base out (--hf-config DIR names the folder to take "
                        "config.json and the tokenizer from).")
    dtype = dtype or "float32"
    src = _source_folder(ckpt, meta, hf_config)
    out_dir = os.path.abspath(out_dir)
    check_out_dir(out_dir)
    if megatron:
        source = _MegatronSource(ckpt, meta, src)
        value_head = source.value_head
        entries = plan_tensors(ckpt, meta, src, DTYPES[dtype], source.found, source.problems,
                               trust_remote_code=trust_remote_code, checkpoint_names=True)
        read = source.read
    else:
        found = dcp_found(ckpt)
        value_head = is_value_model(meta, found)
        entries = plan_tensors(ckpt, meta, src, DTYPES[dtype], found, trust_remote_code=trust_remote_code)
        reader = sharded.SafeFileSystemReader(ckpt)
        read = lambda e: read_dcp_tensor(reader, e)  # noqa: E731
    out = write_folder(out_dir, entries, read, src, dtype, max_bytes, value_head=value_head, what=ckpt, log=log)
    return {**out, "seconds": time.monotonic() - start}
