"""The trainer's sharded checkpoint: folder layout, metadata, RNG states, safe reading.

A folder written by ``FSDPTrainer.save_checkpoint``::

    .metadata, __<rank>_0.distcp   torch.distributed.checkpoint (DCP) files: every rank
                                   writes its own shards. Keys: ``model.<name>`` (the model
                                   state in Hugging Face names) and ``optimizer.*`` (the
                                   optimizer state, keyed by parameter name; trainable only)
    rng/rank_<rank>.safetensors    that rank's RNG states (torch CPU and CUDA, numpy, python)
    chatlearn_checkpoint.json      trainer metadata, by rank 0: world size, the HF config and
                                   the folder the model was loaded from, the shape and dtype
                                   of every model tensor, tied names
    .complete                      written last by rank 0, once every rank has finished

DCP reshards on load: a checkpoint written by N ranks loads on M ranks. A tied weight
(``lm_head.weight`` sharing the input embedding) is stored once, under its first name.

Nothing read back from a checkpoint unpickles arbitrary objects: tensors go through
``torch.load(weights_only=True)`` (DCP's own reader), the optimizer's hyperparameters
(DCP "bytes" entries) through ``weights_only=True`` too, DCP's ``.metadata`` pickle through
an unpickler that only accepts DCP's metadata classes, RNG states are safetensors plus
JSON, and the trainer metadata is JSON.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import random
import sys

import numpy as np
import torch
from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from chatlearn.errors import DISK_ERRNOS, UserError, disk_error

FORMAT = "chatlearn-fsdp-dcp"
VERSION = 1
META_FILE = "chatlearn_checkpoint.json"
COMPLETE_MARKER = ".complete"
DCP_METADATA = ".metadata"
RNG_DIR = "rng"
MODEL_KEY = "model"  # DCP keys of the model state are "model.<name>"
OPTIMIZER_KEY = "optimizer"


def rng_file(path: str, rank: int) -> str:
    return os.path.join(path, RNG_DIR, f"rank_{rank:05d}.safetensors")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- tied names


def tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    """{alias: first name} for parameters and buffers reachable under several names (a tied
    ``lm_head.weight`` -> ``model.embed_tokens.weight``). The first name is the one
    ``named_parameters()`` reports."""
    aliases: dict[str, str] = {}
    for named in (module.named_parameters, module.named_buffers):
        first: dict[int, str] = {}
        for name, tensor in named(remove_duplicate=False):
            if id(tensor) in first:
                aliases[name] = first[id(tensor)]
            else:
                first[id(tensor)] = name
    return aliases


# --------------------------------------------------------------------------- RNG states


def capture_rng_state(device: torch.device | None = None) -> dict:
    """This process's RNG states: ``{"tensors": {...}, "info": {...}}`` (tensors and
    JSON-able scalars only). CUDA's is taken for ``device`` when it is a CUDA device."""
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    tensors = {
        "torch_cpu": torch.get_rng_state(),
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "python_state": torch.tensor(py_state, dtype=torch.int64),
    }
    if device is not None and device.type == "cuda":
        tensors["torch_cuda"] = torch.cuda.get_rng_state(device)
    info = {"python_version": py_version, "python_gauss_next": py_gauss,
            "numpy_kind": np_kind, "numpy_pos": int(np_pos),
            "numpy_has_gauss": int(np_has_gauss), "numpy_cached_gaussian": float(np_gauss)}
    return {"tensors": tensors, "info": info}


def save_rng_state(path: str, rank: int, state: dict) -> None:
    from safetensors.torch import save_file

    file = rng_file(path, rank)
    os.makedirs(os.path.dirname(file), exist_ok=True)
    save_file(state["tensors"], file, metadata={"rng": json.dumps(state["info"])})


def load_rng_state(path: str, rank: int) -> dict:
    file = rng_file(path, rank)
    if not os.path.isfile(file):
        raise UserError(f"checkpoint {path!r} has no RNG state for rank {rank} ({file} is "
                        "missing): the checkpoint is damaged. Resume from another checkpoint.")
    with safe_open(file, framework="pt") as f:
        info = json.loads(f.metadata()["rng"])
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    return {"tensors": tensors, "info": info}


def restore_rng_state(state: dict, device: torch.device | None = None) -> None:
    """Set this process's RNG states. A CUDA state is restored only on a CUDA device."""
    t, info = state["tensors"], state["info"]
    torch.set_rng_state(t["torch_cpu"])
    if "torch_cuda" in t and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(t["torch_cuda"], device)
    np.random.set_state((info["numpy_kind"], t["numpy_keys"].numpy().astype(np.uint32),
                         info["numpy_pos"], info["numpy_has_gauss"],
                         info["numpy_cached_gaussian"]))
    random.setstate((info["python_version"], tuple(int(x) for x in t["python_state"].tolist()),
                     info["python_gauss_next"]))


# --------------------------------------------------------------------------- metadata


def refused_write(path: str, err: BaseException) -> OSError | None:
    """The write the disk refused behind a failed save into ``path``, if that is what failed. A library
    may lose the errno (torch's zip writer reports a short write as ``unexpected pos``), so when
    ``err`` names none, the folder is asked again: one byte appended to its largest file (a file-size
    limit) and a 1 MiB file (a full disk, a quota, a read-only or foreign folder), both undone."""
    found = disk_error(err)
    if found is not None or not os.path.isdir(path):
        return found
    files = [os.path.join(root, n) for root, _, names in os.walk(path) for n in names]
    largest = max(files, key=lambda f: os.path.getsize(f), default=None)
    for file, data in ((largest, b"\0"), (os.path.join(path, ".write-probe"), b"\0" * 2**20)):
        if file is None:
            continue
        try:
            fd = os.open(file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as probe:
            return probe if probe.errno in DISK_ERRNOS else None
        size = os.fstat(fd).st_size
        try:
            os.write(fd, data)
        except OSError as probe:
            if probe.errno in DISK_ERRNOS:
                probe.filename = file
                return probe
        finally:
            os.ftruncate(fd, size)
            os.close(fd)
            if size == 0:
                os.unlink(file)
    return None


def write_meta(path: str, meta: dict) -> None:
    meta = {"format": FORMAT, "version": VERSION, **meta}
    with open(os.path.join(path, META_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


def clear_complete(path: str) -> None:
    """Remove the marker of an earlier checkpoint in ``path``: from here on it is incomplete."""
    try:
        os.remove(os.path.join(path, COMPLETE_MARKER))
    except FileNotFoundError:
        pass


def mark_complete(path: str) -> None:
    with open(os.path.join(path, COMPLETE_MARKER), "w", encoding="utf-8") as f:
        f.write("ok\n")
        f.flush()
        os.fsync(f.fileno())


def read_meta(path: str) -> dict:
    """The trainer metadata of the checkpoint folder ``path``, after checking that it is a
    complete checkpoint of this format; a UserError naming the path and the fix otherwise."""
    if not os.path.exists(path):
        raise UserError(f"checkpoint folder {path!r} does not exist. Pass a trainer "
                        f"checkpoint folder (the one holding {DCP_METADATA} and {META_FILE}).")
    if not os.path.isdir(path):
        raise UserError(f"checkpoint {path!r} is a file, not a folder. Pass a trainer "
                        f"checkpoint folder (the one holding {DCP_METADATA} and {META_FILE}).")
    meta_file = os.path.join(path, META_FILE)
    if not (os.path.isfile(meta_file) and os.path.isfile(os.path.join(path, DCP_METADATA))):
        raise UserError(f"{path!r} is not a chatlearn trainer checkpoint: it lacks "
                        f"{META_FILE} or the torch.distributed.checkpoint file {DCP_METADATA}. "
                        "Pass a trainer checkpoint folder (the one holding both).")
    meta = read_complete_json(path, meta_file)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise UserError(f"{meta_file!r} is not a {FORMAT} checkpoint metadata file. Pass a "
                        "trainer checkpoint folder written by chatlearn.")
    if meta.get("version", 0) > VERSION:
        raise UserError(f"checkpoint {path!r} has format version {meta['version']}, newer "
                        f"than this chatlearn reads ({VERSION}). Upgrade chatlearn.")
    return meta


def read_complete_json(path: str, meta_file: str):
    """The JSON in ``meta_file`` of the checkpoint folder ``path``, once its completion marker
    is there (shared by the FSDP and Megatron checkpoint formats); a UserError otherwise."""
    if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        raise UserError(f"checkpoint {path!r} is incomplete (no {COMPLETE_MARKER} marker): "
                        "its writing was interrupted or is still running. Use an earlier "
                        "checkpoint, or wait until the save has finished.")
    try:
        with open(meta_file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read the checkpoint metadata {meta_file!r} ({err}): the "
                        "checkpoint is damaged. Use another checkpoint.") from None


# --------------------------------------------------------------------------- safe reading

# What DCP's .metadata pickle may refer to: the classes of its metadata module, torch.Size,
# dtypes, layouts, and the path it was saved to.
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),
    ("pathlib._local", "WindowsPath"), ("pathlib._local", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if "." not in name:  # no attribute paths such as "os.system"
            if module == _METADATA_MODULE:
                obj = getattr(sys.modules.get(module), name, None)
                if isinstance(obj, type) and obj.__module__ == module:  # its own classes only
                    return obj
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def read_dcp_metadata(path: str) -> Metadata:
    """DCP's ``.metadata`` of the folder ``path``, through the restricted unpickler."""
    file = os.path.join(path, DCP_METADATA)
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as err:  # a damaged or foreign file fails in many ways
        raise UserError(f"cannot read {file!r} ({err}): the checkpoint is damaged or was not "
                        "written by torch.distributed.checkpoint. Use another checkpoint."
                        ) from None
    if not isinstance(metadata, Metadata):
        raise UserError(f"{file!r} holds a {type(metadata).__name__}, not DCP metadata: the "
                        "checkpoint is damaged. Use another checkpoint.")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the restricted metadata unpickler; the metadata is read once
    and reused, so that loading a checkpoint one tensor at a time stays cheap."""

    def __init__(self, path: str):
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata: this format never writes it
            raise FileNotFoundError("no per-rank DCP metadata in a chatlearn checkpoint")
        if self._metadata is None:
            self._metadata = read_dcp_metadata(str(self.path))
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries (the optimizer's
    hyperparameters) with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
