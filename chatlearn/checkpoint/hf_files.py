"""A Hugging Face model folder written from a checkpoint's tensors: what ``chatlearn merge`` writes for a
whole model (:mod:`chatlearn.checkpoint.merge`) and for LoRA adapters (:mod:`chatlearn.checkpoint.adapters`).

The tensors are checked against the model that config.json describes, built on the ``meta`` device
(:func:`plan_tensors`: a missing or unexpected key, a wrong shape or dtype is one UserError naming the
key); each is then read alone, cast and appended to its safetensors shard (:func:`write_shard`: the header
is known up front), so peak memory is about the largest tensor. :func:`write_folder` writes the shards,
the index, config.json with its dtype set and the other files of the source folder under a temporary
name, renamed when complete.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from chatlearn.checkpoint import sharded
from chatlearn.errors import UserError, disk_error, write_refusal

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# Files of the source folder that are not copied: config.json is rewritten, weights are
# what the merge produces.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json",
                    ".bin.index.json", ".h5", ".msgpack", ".gguf")
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
FROM_SAFETENSORS = {v: k for k, v in SAFETENSORS_DTYPES.items()}


@dataclass
class Entry:
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


def check_out_dir(out_dir: str) -> None:
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


def expected_tensors(config, trust_remote_code: bool = False, value_head: bool = False,
                     checkpoint_names: bool = False):
    """``({name: (shape, dtype)}, {alias: name})`` of the causal LM (or vision-language model) that ``config``
    describes (with ``value_head``: the critic, the token-classification model with one label),
    built on the ``meta`` device (no memory); tied aliases are not in the first.
    ``checkpoint_names``: the names and shapes ``save_pretrained`` writes, where transformers keeps
    some tensors otherwise in the module (a MoE layer's experts, fused in the module as
    ``mlp.experts.gate_up_proj`` / ``down_proj``, are written per expert:
    ``mlp.experts.<e>.gate_proj.weight`` ...; transformers' ``revert_weight_conversion``)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForTokenClassification

    # a vision-language model (Qwen2-VL ...: a vision_config) is transformers' image-text-to-text class
    auto = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    if value_head:  # one label: a scalar value per token
        auto, config.num_labels = AutoModelForTokenClassification, 1
    with torch.device("meta"):
        model = auto.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    aliases = sharded.tied_aliases(model)
    state = model.state_dict()
    if checkpoint_names:
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(model, state)
    expected = {name: (tuple(t.shape), t.dtype) for name, t in state.items()
                if name not in aliases}
    return expected, aliases


def dcp_found(ckpt: str) -> dict:
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


def check_trust(ckpt: str, meta: dict, src: str, trust_remote_code: bool) -> bool:
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


def plan_tensors(ckpt: str, meta: dict, src: str, out_dtype: torch.dtype, found: dict,
                 problems: list[str] | None = None, trust_remote_code: bool = False,
                 checkpoint_names: bool = False) -> list[Entry]:
    """Check the checkpoint's model tensors (``found``: ``{name: (shape, dtype) or None}``)
    against config.json; the tensors to write, in the model's order. ``problems``: ones
    already found by the reader, reported with the others. ``trust_remote_code``: the
    caller's permission to run the model folder's own code (see :func:`check_trust`).
    ``checkpoint_names``: ``found`` holds the names ``save_pretrained`` writes (see
    :func:`expected_tensors`), as a Megatron checkpoint's mapping gives them."""
    from transformers import AutoConfig

    trust = check_trust(ckpt, meta, src, trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(src, trust_remote_code=trust)
        expected, aliases = expected_tensors(config, trust, value_head=is_value_model(meta, found),
                                             checkpoint_names=checkpoint_names)
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
        elif got_dtype not in SAFETENSORS_DTYPES:
            problems.append(f"key {name!r}: dtype {sharded.dtype_name(got_dtype)} cannot be "
                            "written to safetensors")
        else:
            entries.append(Entry(name, shape, got_dtype,
                                  out_dtype if got_dtype.is_floating_point else got_dtype))
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UserError(f"checkpoint {ckpt!r} does not match the model of {config_file}: "
                        f"{'; '.join(problems[:5])}{more}. Pass --hf-config DIR with the "
                        "folder of the model this checkpoint was trained from, or use a "
                        "checkpoint of that model.")
    return entries


def _split(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Greedy split in order, as save_pretrained does: a shard is closed before the tensor
    that would overflow it; a tensor larger than ``max_bytes`` is a shard of its own."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def read_dcp_tensor(reader: sharded.SafeFileSystemReader, entry: Entry) -> torch.Tensor:
    """One model tensor, whole, from the DCP files (only its chunks are read)."""
    key = f"{sharded.MODEL_KEY}.{entry.name}"
    state = {key: torch.empty(entry.shape, dtype=entry.src_dtype)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, planner=sharded.SafeLoadPlanner(), no_dist=True)
    return state[key]


def write_shard(file: str, entries: list[Entry],
                 read: Callable[[Entry], torch.Tensor]) -> None:
    """A safetensors file written sequentially: the header (known from the metadata), then
    each tensor's bytes as soon as it is read and cast."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.out_dtype], "shape": list(e.shape),
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


def write_folder(out_dir: str, entries: list[Entry], read: Callable[[Entry], torch.Tensor], src: str,
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
            write_shard(os.path.join(tmp, name), shard, read)
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
