"""Before a run starts (before any Ray process): every path it will write is a folder it can write
into, with room for a checkpoint.

:func:`check_paths` checks ``runtime_args.output_dir`` and what the run writes under it
(``checkpoints/``, ``configs/``, ``logs/``, ``plots/``, ``eval/``, the TensorBoard and W&B folders
of ``runtime_args.log_args_dict`` when they are on, and the files ``metrics.jsonl``,
``timeline.jsonl``, ``samples.jsonl``, ``config.yaml``): a folder must not be a file (nor lie under
one), a file must not be a folder, and the nearest folder that exists must take a new file (one
is created, written and removed). Then the free space of the checkpoints' file system
(:func:`shutil.disk_usage`) is compared with :func:`checkpoint_bytes`, the size of one checkpoint
estimated from the trained models' folders: less than one checkpoint is refused, less than the
checkpoints the run keeps at once (``keep_last_checkpoints`` + 1 while a new one is written) is a
warning. Nothing is created or left behind: ``--dry-run`` runs the same checks.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Callable

from omegaconf import DictConfig

from chatlearn.config.kinds import TRAINER
from chatlearn.config.plan import Plan
from chatlearn.config.writable import nearest_existing, probe
from chatlearn.errors import UserError
from chatlearn.logging.console import warn
from chatlearn.runtime.rundir.output_dir import check_not_in_checkpoint

# what a run writes under output_dir: folders, then files
FOLDERS = ("checkpoints", "configs", "logs", "plots", "eval")
FILES = ("metrics.jsonl", "timeline.jsonl", "samples.jsonl", "config.yaml")
# bytes per element of a safetensors dtype
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


def check_paths(cfg: DictConfig, plan: Plan, report: Callable[[str], None] = warn) -> None:
    """Refuse (a UserError in one paragraph) a run that cannot write where it will, or whose disk cannot
    hold one checkpoint; ``report`` the warning when it holds fewer than the run keeps at once."""
    out = cfg.runtime_args.output_dir
    for key, path, kind in planned_paths(cfg):
        _check_path(key, path, kind)
    need = checkpoint_bytes(cfg, plan)
    if need <= 0:
        return
    root = os.path.join(out, "checkpoints")
    free = shutil.disk_usage(nearest_existing(root)).free
    rt = cfg.runtime_args
    saves = sum(1 for e in range(1, rt.num_episode + 1)
                if e == rt.num_episode or rt.save_episode_interval > 0 and e % rt.save_episode_interval == 0)
    held = min(saves, rt.keep_last_checkpoints + 1) if rt.keep_last_checkpoints > 0 else saves
    if free < need:
        raise UserError(
            f"runtime_args.output_dir: the disk that holds {root!r} has {_size(free)} free, but one checkpoint of "
            f"this run needs about {_size(need)} ({_estimate(cfg, plan)}): the first save would fail. Free space "
            "on that disk, choose a runtime_args.output_dir on a disk with room, or save less (models.policy_trainer."
            "save_hf=false leaves out the Hugging Face copy).")
    if free < need * held:
        report(f"the disk that holds {root} has {_size(free)} free: room for {free // need} checkpoint(s) of about "
               f"{_size(need)}, but the run keeps {held} at once (runtime_args.keep_last_checkpoints "
               f"{rt.keep_last_checkpoints}, plus the one being written). A save may fail for lack of space: free "
               "space there, or lower runtime_args.keep_last_checkpoints.")


def planned_paths(cfg: DictConfig) -> list[tuple[str, str, str]]:
    """(key, path, "folder" or "file") of everything the run writes."""
    rt = cfg.runtime_args
    out = rt.output_dir
    paths = [("runtime_args.output_dir", out, "folder")]
    paths += [("runtime_args.output_dir", os.path.join(out, name), "folder") for name in FOLDERS]
    paths += [("runtime_args.output_dir", os.path.join(out, name), "file") for name in FILES]
    la = rt.log_args_dict
    log_dir = la.log_dir or out
    if la.enable_tensorboard:
        key = "runtime_args.log_args_dict." + ("tensorboard_dir" if la.tensorboard_dir else "log_dir")
        paths.append((key, la.tensorboard_dir or os.path.join(log_dir, "tensorboard"), "folder"))
    if la.enable_wandb:
        key = "runtime_args.log_args_dict." + ("wandb_dir" if la.wandb_dir else "log_dir")
        paths.append((key, os.path.join(la.wandb_dir or log_dir, "wandb"), "folder"))
    return paths


def check_output_folder(key: str, out: str, folders: tuple[str, ...] = ()) -> None:
    """Refuse (one paragraph) an output folder ``out`` (``key``) that lies inside a checkpoint, is a file or lies
    under one, or cannot be written; the same for each of ``folders`` under it."""
    check_not_in_checkpoint(out, key)
    for path in (out, *(os.path.join(out, f) for f in folders)):
        _check_path(key, path, "folder")


def _check_path(key: str, path: str, kind: str) -> None:
    """``path`` can be written as a ``kind``: it is (or will be created as) that, not under a file, and the
    nearest folder that exists takes a new file."""
    if kind == "folder" and os.path.lexists(path) and not os.path.isdir(path):
        raise UserError(f"{key}: {path!r} is a file, but the run writes a folder there. Move or delete that file, "
                        f"or choose another {key}.")
    if kind == "file" and os.path.isdir(path):
        raise UserError(f"{key}: {path!r} is a folder, but the run writes a file there. Move or delete that folder, "
                        f"or choose another {key}.")
    parent = path if kind == "folder" else os.path.dirname(os.path.abspath(path))
    folder = nearest_existing(parent)
    if not os.path.isdir(folder):
        raise UserError(f"{key}: {path!r} lies under {folder!r}, which is a file, not a folder: nothing can be "
                        f"created there. Move or delete that file, or choose another {key}.")
    problem = probe(folder)
    if problem:
        raise UserError(f"{key}: the run cannot write into {folder!r} (on the way to {path!r}): {problem}.")


# --------------------------------------------------------------------------- the size of a checkpoint


def checkpoint_bytes(cfg: DictConfig, plan: Plan) -> int:
    """About how many bytes one checkpoint of the run takes: for each trained model, its weights in fp32
    (bf16 Megatron: bf16 weights and an fp32 master copy), AdamW's two fp32 moments, and, when ``save_hf``,
    the Hugging Face copy; 0 when no model folder can be read."""
    return sum(b for _, b in _parts(cfg, plan))


def _parts(cfg: DictConfig, plan: Plan) -> list[tuple[str, int]]:
    megatron = cfg.runtime_args.train_backend == "megatron"
    parts = []
    for name in plan.placements:  # the models whose kind trains: their state goes into every checkpoint
        if not plan.kind(name).trains or not cfg.models[name].trainable:
            continue
        m = cfg.models[name]
        n = parameter_count(str(m.load))
        bf16 = megatron and bool(m.bf16)
        parts.append((f"models.{name}: {n / 1e6:.1f}M parameters, weights and AdamW state", n * (14 if bf16 else 12)))
        if plan.kind(name) is TRAINER and m.save_hf:  # (the checkpoint's hf/ is the policy's)
            parts.append((f"models.{name}.save_hf", n * (2 if bf16 else 4)))
    return parts


def _estimate(cfg: DictConfig, plan: Plan) -> str:
    return "; ".join(f"{what} {_size(b)}" for what, b in _parts(cfg, plan))


def parameter_count(folder: str) -> int:
    """The number of parameters in a model folder, from its safetensors headers (no tensor is read);
    ``pytorch_model*.bin`` files count as fp32. 0 when there are none."""
    if not os.path.isdir(folder):
        return 0
    count = 0
    for name in os.listdir(folder):
        file = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            count += _safetensors_count(file)
        elif name.startswith("pytorch_model") and name.endswith(".bin"):
            count += os.path.getsize(file) // 4
    return count


def _safetensors_count(file: str) -> int:
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        return sum((int(v["data_offsets"][1]) - int(v["data_offsets"][0])) // (_ITEMSIZE[v["dtype"]] if v["dtype"] in _ITEMSIZE else 1)
                   for k, v in header.items() if k != "__metadata__")
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return os.path.getsize(file) // 4  # validation names a damaged file; here: a rough size


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
