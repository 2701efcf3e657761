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

A LoRA checkpoint (adapters only) is written as peft's adapter folder, or as the merged model, by
:mod:`chatlearn.checkpoint.adapters`, with the helpers here.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from chatlearn.checkpoint import megatron_format, sharded
from chatlearn.checkpoint.manager import check_against_manifest
from chatlearn.checkpoint.megatron_mapping import HFArch, mappings, to_hf
from chatlearn.errors import UserError, disk_error, write_refusal

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_SHARD_SIZE = "5GB"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# Files of the source folder that are not copied: config.json is rewritten, weights are
# what the merge produces.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json",
                    ".bin.index.json", ".h5", ".msgpack", ".gguf")
_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
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


@dataclass
class _Entry:
    name: str  # Hugging Face name
    shape: tuple[int, ...]
    src_dtype: torch.dtype  # as stored in the checkpoint
    out_dtype: torch.dtype  # as written

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.out_dtype.itemsize


# --------------------------------------------------------------------------- inputs


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
        from chatlearn.hub import looks_like_hub_id, snapshot

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


def _check_out_dir(out_dir: str) -> None:
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise UserError(f"output folder {out_dir!r} already exists and is not empty. Choose a "
                        "new folder, or remove that one first.")


def is_value_model(meta: dict, found: dict) -> bool:
    """Whether a checkpoint holds a critic (a value head on the backbone: ``score.weight``, as
    ``AutoModelForTokenClassification`` with one label names it) rather than a causal LM."""
    return meta.get("role") == "critic" or ("score.weight" in found and "lm_head.weight" not in found)


def value_head_config(config: dict) -> dict:
    """A causal LM's ``config.json`` (as a dict) made the critic's, in place: its architecture the
    token-classification class of the model's family, one label. Returns ``config``."""
    archs = [a.replace("ForCausalLM", "ForTokenClassification") for a in config.get("architectures") or []]
    config.update(architectures=archs, num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return config


def expected_tensors(config, trust_remote_code: bool = False, value_head: bool = False):
    """``({name: (shape, dtype)}, {alias: name})`` of the causal LM that ``config``
    describes (with ``value_head``: the critic, the token-classification model with one label),
    built on the ``meta`` device (no memory); tied aliases are not in the first."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForCausalLM
    if value_head:  # one label: a scalar value per token
        auto, config.num_labels = AutoModelForTokenClassification, 1
    with torch.device("meta"):
        model = auto.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    aliases = sharded.tied_aliases(model)
    expected = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()
                if name not in aliases}
    return expected, aliases


def _dcp_found(ckpt: str) -> dict:
    """``{name: (shape, dtype) or None (not a tensor)}`` of the model entries of a DCP
    checkpoint."""
    prefix = sharded.MODEL_KEY + "."
    return {key[len(prefix):]: ((tuple(md.size), md.properties.dtype)
                                if isinstance(md, TensorStorageMetadata) else None)
            for key, md in sharded.read_dcp_metadata(ckpt).state_dict_metadata.items()
            if key.startswith(prefix)}


def _remote_code(src: str) -> list[str]:
    """The ``auto_map`` entries of ``src``'s config.json: Python files of the folder that
    transformers would import to build the model (empty when it needs none)."""
    try:
        with open(os.path.join(src, CONFIG_NAME), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return []  # reported when the config is loaded
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    if not auto_map:
        return []
    if isinstance(auto_map, dict):
        return sorted(f"{k}: {v}" for k, v in auto_map.items())
    return [str(auto_map)]


def _check_trust(ckpt: str, meta: dict, src: str, trust_remote_code: bool) -> bool:
    """Whether the model's own code may run: only when the caller allows it (``--trust-remote-code``).
    The ``trust_remote_code`` a checkpoint records is never enough: a downloaded checkpoint
    could name any code."""
    code = _remote_code(src)
    if not code or trust_remote_code:
        return bool(code) and trust_remote_code
    recorded = (" The checkpoint was trained with trust_remote_code: true, but a checkpoint's own "
                "metadata cannot allow running code." if meta.get("trust_remote_code") is True else "")
    raise UserError(f"the model of checkpoint {ckpt!r} needs the Python code named in "
                    f"{os.path.join(src, CONFIG_NAME)!r} (auto_map: {'; '.join(code)}), and merging "
                    f"would run it.{recorded} Read that code in {src!r}; if you trust it, run the merge "
                    "again with --trust-remote-code (or pass --hf-config DIR with a folder whose model "
                    "needs no code of its own).")


def _plan(ckpt: str, meta: dict, src: str, out_dtype: torch.dtype, found: dict,
          problems: list[str] | None = None, trust_remote_code: bool = False) -> list[_Entry]:
    """Check the checkpoint's model tensors (``found``: ``{name: (shape, dtype) or None}``)
    against config.json; the tensors to write, in the model's order. ``problems``: ones
    already found by the reader, reported with the others. ``trust_remote_code``: the
    caller's permission to run the model folder's own code (see :func:`_check_trust`)."""
    from transformers import AutoConfig

    trust = _check_trust(ckpt, meta, src, trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(src, trust_remote_code=trust)
        expected, aliases = expected_tensors(config, trust, value_head=is_value_model(meta, found))
    except Exception as err:  # anything raised here comes from config.json (or its code)
        cause = " ".join(str(err).split()) or type(err).__name__
        raise UserError(f"cannot build the model described by {os.path.join(src, CONFIG_NAME)!r} "
                        f"({cause}). Pass --hf-config DIR with the folder of the model the "
                        "trainer loaded.") from None
    saved_aliases = meta.get("tied", {})
    config_file = os.path.join(src, CONFIG_NAME)
    problems = list(problems or [])
    for name, md in found.items():
        if name in saved_aliases:  # stored under its first name as well
            continue
        if name in aliases:
            problems.append(f"unexpected key {name!r}: {config_file} ties it to "
                            f"{aliases[name]!r}, but the checkpoint holds it as a tensor of "
                            "its own")
        elif name not in expected:
            problems.append(f"unexpected key {name!r} (not in the model that {config_file} "
                            "describes)")
        elif md is None:
            problems.append(f"key {name!r} is not a tensor in the checkpoint")
    entries = []
    for name, (shape, dtype) in expected.items():
        if name not in found:
            problems.append(f"missing key {name!r}: expected shape {list(shape)} from "
                            f"{config_file}, not found in the checkpoint")
            continue
        md = found[name]
        if md is None:
            continue  # reported above
        got_shape, got_dtype = md
        if got_shape != shape:
            problems.append(f"key {name!r}: expected shape {list(shape)} from {config_file}, "
                            f"found {list(got_shape)} in the checkpoint")
        elif got_dtype.is_floating_point != dtype.is_floating_point or (
                not dtype.is_floating_point and got_dtype != dtype):
            problems.append(f"key {name!r}: expected dtype {sharded.dtype_name(dtype)}, found "
                            f"{sharded.dtype_name(got_dtype)} in the checkpoint")
        elif got_dtype not in _SAFETENSORS_DTYPES:
            problems.append(f"key {name!r}: dtype {sharded.dtype_name(got_dtype)} cannot be "
                            "written to safetensors")
        else:
            entries.append(_Entry(name, shape, got_dtype,
                                  out_dtype if got_dtype.is_floating_point else got_dtype))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UserError(f"checkpoint {ckpt!r} does not match the model of {config_file}: "
                        f"{'; '.join(problems[:5])}{more}. Pass --hf-config DIR with the "
                        "folder of the model this checkpoint was trained from, or use a "
                        "checkpoint of that model.")
    return entries


def _split(entries: list[_Entry], max_bytes: int) -> list[list[_Entry]]:
    """Greedy split in order, as save_pretrained does: a shard is closed before the tensor
    that would overflow it; a tensor larger than ``max_bytes`` is a shard of its own."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


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


_FROM_SAFETENSORS = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


class _MegatronSource:
    """The model tensors of a Megatron trainer checkpoint, as Hugging Face tensors.

    ``found``: ``{hf name: (shape, dtype) or None}`` from the safetensors headers (the full
    shapes are run through the trainer's mapping on the ``meta`` device); ``problems``: what
    does not fit. ``read(entry)``: one Hugging Face tensor; the other tensors of the same
    Megatron parameter (q/k/v, gate/up) are kept until they are asked for (they come next
    in the model's order). A critic's checkpoint (``role`` critic) maps its ``output_layer`` to
    the value head ``score`` (``megatron_mapping.mappings(..., value_head=True)``)."""

    def __init__(self, ckpt: str, meta: dict, src: str):
        from safetensors import safe_open

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
        dp = world // (self.tp * self.pp)
        # Megatron's rank order (tp-cp-ep-dp-pp): rank = tp_rank + tp * (dp_rank + dp * pp_rank);
        # the ranks of data-parallel rank 0 hold one copy of every shard
        self.shards: dict[str, dict[int, tuple[str, tuple, str]]] = {}
        for pp_rank in range(self.pp):
            for tp_rank in range(self.tp):
                rank = tp_rank + self.tp * dp * pp_rank
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
                        if key.startswith("model."):
                            sl = f.get_slice(key)
                            self.shards.setdefault(key[len("model."):], {})[tp_rank] = (
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

    def _full_shape(self, m) -> tuple[tuple, torch.dtype] | None:
        shards = self.shards.get(m.megatron)
        if shards is None:
            return None  # reported as missing Hugging Face keys
        if sorted(shards) != list(range(self.tp)):
            absent = sorted(set(range(self.tp)) - set(shards))
            self.problems.append(f"Megatron parameter {m.megatron!r} has no shard for "
                                 f"tensor-parallel rank(s) {absent}")
            return None
        shapes = [shards[r][1] for r in range(self.tp)]
        dtypes = {shards[r][2] for r in range(self.tp)}
        if len(dtypes) > 1 or next(iter(dtypes)) not in _FROM_SAFETENSORS:
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
        return tuple(full), _FROM_SAFETENSORS[dtypes.pop()]

    def _describe(self, m) -> None:
        got = self._full_shape(m)
        if got is None:
            return
        shape, dtype = got
        try:
            outs = to_hf(self.arch, m, torch.empty(shape, dtype=dtype, device="meta"), self.tp)
        except RuntimeError as err:
            self.problems.append(f"Megatron parameter {m.megatron!r} of shape {list(shape)} "
                                 f"does not split into {list(m.hf)} "
                                 f"({' '.join(str(err).split())})")
            return
        for name, t in zip(m.hf, outs):
            self.found[name] = (tuple(t.shape), dtype)

    def read(self, entry: _Entry) -> torch.Tensor:
        from safetensors import safe_open

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
            for r in range(self.tp):
                file, shard_shape, _ = shards[r]
                size = shard_shape[m.split_dim]
                with safe_open(file, framework="pt") as f:
                    full.narrow(m.split_dim, start, size).copy_(f.get_tensor(f"model.{m.megatron}"))
                start += size
        outs = dict(zip(m.hf, to_hf(self.arch, m, full, self.tp)))
        del full
        tensor = outs.pop(entry.name)
        self._cache.update(outs)
        return tensor


# --------------------------------------------------------------------------- writing


def _read_tensor(reader: sharded.SafeFileSystemReader, entry: _Entry) -> torch.Tensor:
    """One model tensor, whole, from the DCP files (only its chunks are read)."""
    key = f"{sharded.MODEL_KEY}.{entry.name}"
    state = {key: torch.empty(entry.shape, dtype=entry.src_dtype)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, planner=sharded.SafeLoadPlanner(), no_dist=True)
    return state[key]


def _write_shard(file: str, entries: list[_Entry],
                 read: Callable[[_Entry], torch.Tensor]) -> None:
    """A safetensors file written sequentially: the header (known from the metadata), then
    each tensor's bytes as soon as it is read and cast."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": _SAFETENSORS_DTYPES[e.out_dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(file, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for e in entries:
            tensor = read(e).to(e.out_dtype).contiguous()
            data = tensor.reshape(-1).view(torch.uint8).numpy()
            if data.nbytes != e.nbytes:
                raise AssertionError(f"{e.name}: {data.nbytes} bytes, expected {e.nbytes}")
            f.write(memoryview(data))
            del tensor, data
        f.flush()
        os.fsync(f.fileno())


def _copy_hf_files(src: str, out: str, dtype: str, value_head: bool = False) -> list[str]:
    """config.json with its dtype set (with ``value_head``, the critic's: its architecture the
    token-classification class of the model's family, one label), and the other non-weight files of
    ``src``."""
    with open(os.path.join(src, CONFIG_NAME), encoding="utf-8") as f:
        config = json.load(f)
    if value_head:
        value_head_config(config)
    config["dtype"] = dtype
    if "torch_dtype" in config:  # the name before transformers 4.56
        config["torch_dtype"] = dtype
    with open(os.path.join(out, CONFIG_NAME), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    copied = [CONFIG_NAME]
    for name in sorted(os.listdir(src)):
        file = os.path.join(src, name)
        if (os.path.isfile(file) and name != CONFIG_NAME and not name.startswith(".")
                and not name.endswith(_WEIGHT_SUFFIXES)):
            shutil.copy2(file, os.path.join(out, name))
            copied.append(name)
    return copied


def write_folder(out_dir: str, entries: list[_Entry], read: Callable[[_Entry], torch.Tensor], src: str,
                 dtype: str, max_bytes: int, *, value_head: bool = False, what: str = "",
                 log: Callable[[str], None]) -> dict:
    """The Hugging Face folder ``out_dir`` (absolute, checked empty): ``entries`` (each read by ``read``)
    in safetensors shards of at most ``max_bytes``, config.json and the other files of ``src``. Written
    under ``out_dir.partial`` and renamed when complete; a write the disk refuses is one paragraph.
    Returns out_dir, dtype, num_tensors, total_bytes, shards (file names), copied (other files)."""
    shards = _split(entries, max_bytes)
    names = ([WEIGHTS_NAME] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total = sum(e.nbytes for e in entries)
    log(f"merging {len(entries)} tensors ({total / 1e6:.1f} MB as {dtype}) from {what} "
        f"into {len(shards)} shard(s)")

    tmp = out_dir + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        for name, shard in zip(names, shards):
            _write_shard(os.path.join(tmp, name), shard, read)
            log(f"wrote {name} ({sum(e.nbytes for e in shard) / 1e6:.1f} MB, "
                f"{len(shard)} tensors)")
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {e.name: name for name, shard in zip(names, shards)
                                    for e in shard}}
            with open(os.path.join(tmp, INDEX_NAME), "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2, sort_keys=True)
                f.write("\n")
        copied = _copy_hf_files(src, tmp, dtype, value_head=value_head)
        finish_folder(tmp, out_dir)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise_write_refusal(err, out_dir, tmp, "the merged model")
        raise
    return {"out_dir": out_dir, "dtype": dtype, "num_tensors": len(entries),
            "total_bytes": total, "shards": names, "copied": copied}


def finish_folder(tmp: str, out_dir: str) -> None:
    """The complete folder ``tmp`` renamed to ``out_dir`` (absent, or empty: checked before)."""
    if os.path.isdir(out_dir):
        os.rmdir(out_dir)
    os.replace(tmp, out_dir)


def raise_write_refusal(err: BaseException, out_dir: str, tmp: str, what: str) -> None:
    """One paragraph for a write of ``what`` the disk refused (a full disk, a read-only or foreign
    folder); returns for any other failure."""
    refused = disk_error(err)
    if refused is not None:
        raise write_refusal(f"{what} {out_dir}", refused, path=tmp,
                            then="then run the same command again", other="output folder") from err


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
    check_against_manifest(ckpt, "checkpoint")
    megatron = _checkpoint_format(ckpt) == megatron_format.FORMAT
    meta = megatron_format.read_meta(ckpt, {}) if megatron else sharded.read_meta(ckpt)
    if not megatron and isinstance(meta, dict) and meta.get("lora"):
        from chatlearn.checkpoint import adapters  # noqa: PLC0415 (it reads this module's helpers)

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
    _check_out_dir(out_dir)
    if megatron:
        source = _MegatronSource(ckpt, meta, src)
        value_head = source.value_head
        entries = _plan(ckpt, meta, src, DTYPES[dtype], source.found, source.problems,
                        trust_remote_code=trust_remote_code)
        read = source.read
    else:
        found = _dcp_found(ckpt)
        value_head = is_value_model(meta, found)
        entries = _plan(ckpt, meta, src, DTYPES[dtype], found, trust_remote_code=trust_remote_code)
        reader = sharded.SafeFileSystemReader(ckpt)
        read = lambda e: _read_tensor(reader, e)  # noqa: E731
    out = write_folder(out_dir, entries, read, src, dtype, max_bytes, value_head=value_head, what=ckpt, log=log)
    return {**out, "seconds": time.monotonic() - start}
