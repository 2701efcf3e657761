"""A run's output folder holds one run, never a mix of two.

A run that starts fresh (``--no-resume``, ``runtime_args.enable_resume_training: false``) into a
folder that already holds a run (checkpoints, ``metrics.jsonl`` or ``timeline.jsonl``) is refused,
unless ``--overwrite`` is given: then the old run is moved aside, whole, to the sibling folder
``<output_dir>.old-<YYYYmmdd-HHMMSS>`` (nothing is deleted), and the new run starts in an empty
folder. A resumed run continues the run in the folder (see ``Engine.resume``,
:mod:`chatlearn.runtime.driver.engine`), after :func:`reconcile_logs` has dropped what the
interrupted run logged past its checkpoint, and only when its config alters nothing its checkpoint
was trained with, or the change is accepted on purpose (``--accept-config-changes``; the configs a
run ran with are kept in ``configs/``: :mod:`chatlearn.runtime.rundir.config_history`).
"""
from __future__ import annotations

import os
import re
import time

from omegaconf import DictConfig

from chatlearn.checkpoint.manager import CheckpointManager
from chatlearn.errors import UserError
from chatlearn.logging import jsonl
from chatlearn.logging.console import info
from chatlearn.runtime.rundir.lock import RunLock

# what a run leaves in its output folder (a folder with only config.yaml holds no results)
RUN_ENTRIES = ("checkpoints", "metrics.jsonl", "timeline.jsonl")


def previous_run(output_dir: str) -> list[str]:
    """The entries of ``output_dir`` that show a run was there (empty ones do not count)."""
    found = []
    for name in RUN_ENTRIES:
        path = os.path.join(output_dir, name)
        try:
            if os.path.isdir(path) and os.listdir(path) or os.path.isfile(path) and os.path.getsize(path) > 0:
                found.append(name + ("/" if os.path.isdir(path) else ""))
        except OSError:
            found.append(name)
    return found


def refusal(output_dir: str, found: list[str]) -> UserError:
    return UserError(
        f"runtime_args.output_dir {output_dir!r} already holds a run ({', '.join(found)}), and this run starts "
        "fresh (--no-resume, or runtime_args.enable_resume_training=false): the two runs' checkpoints and "
        "metrics would mix. To continue that run, run without --no-resume; to start over, add --overwrite "
        f"(the old run is moved to {output_dir}.old-<time>, nothing is deleted) or choose another "
        "runtime_args.output_dir.")


def check_start(cfg: DictConfig, overwrite: bool, check_lock: bool = True) -> None:
    """Read-only checks before anything is loaded (also for ``--dry-run``): another run using
    the folder (when ``check_lock``), a fresh start into a folder that holds a run without
    ``overwrite``."""
    out = cfg.runtime_args.output_dir
    check_not_in_checkpoint(out, "runtime_args.output_dir")
    lock = RunLock(out)
    holder = lock.live_holder() if check_lock else None
    if holder is not None:
        raise lock.refusal(holder)
    if not cfg.runtime_args.enable_resume_training and not overwrite:
        found = previous_run(out)
        if found:
            raise refusal(out, found)


def checkpoint_around(path: str) -> str | None:
    """The checkpoint folder ``path`` is (or lies inside): a folder with ``COMPLETE`` or ``manifest.json``
    beside ``state.json`` or ``chatlearn_checkpoint.json``, an ``episode_N`` folder of a ``checkpoints/``, or a
    run's ``checkpoints/`` itself (holding ``latest`` or ``episode_N`` folders); None when there is none."""
    folder = os.path.realpath(path)
    while True:
        name = os.path.basename(folder)
        entries = set(os.listdir(folder)) if os.path.isdir(folder) else set()
        marks = entries & {"COMPLETE", "manifest.json"} and entries & {"state.json", "chatlearn_checkpoint.json"}
        if marks or re.fullmatch(r"episode_\d+(\.tmp)?", name) and os.path.basename(os.path.dirname(folder)) == \
                "checkpoints":
            return folder
        if name == "checkpoints" and ("latest" in entries or any(e.startswith("episode_") for e in entries)):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def check_not_in_checkpoint(path: str, key: str) -> None:
    """Refuse an output folder that is, or lies inside, a checkpoint or a run's ``checkpoints/``: what the run
    writes there would mix with the checkpoint's files, and keep-last-N or a resume would read or delete them."""
    found = checkpoint_around(path)
    if found is not None:
        what = "a run's checkpoints/ folder" if os.path.basename(found) == "checkpoints" else "the checkpoint"
        raise UserError(f"{key} {path!r} lies inside {what} {found!r}: the run's files would be written among "
                        "the checkpoint's and damage it (a resume or keep_last_checkpoints reads and deletes what "
                        f"is there). Choose a {key} outside it, e.g. a sibling of the run's folder.")


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _inputs(cfg: DictConfig) -> list[tuple[str, str]]:
    """(key, path) of every input the run reads from disk."""
    rt, out = cfg.runtime_args, []
    for key in ("data_path", "eval_data_path"):
        if rt[key]:
            out.extend((f"runtime_args.{key}", p) for p in str(rt[key]).split(",") if p)
    for name in cfg.models:
        model = cfg.models[name]
        if "load" in model and model.load:
            out.append((f"models.{name}.load", str(model.load)))
    return out


def move_aside(cfg: DictConfig, lock: RunLock) -> str:
    """Move the run in ``output_dir`` to a new sibling ``<output_dir>.old-<time>`` and start an
    empty folder, keeping the lock held throughout; returns the new name of the old run."""
    out = cfg.runtime_args.output_dir
    if _inside(os.getcwd(), out):
        raise UserError(f"--overwrite would move runtime_args.output_dir {out!r} aside, but it holds the current "
                        "directory. Run from elsewhere, or choose another runtime_args.output_dir.")
    for key, path in _inputs(cfg):
        if os.path.exists(path) and _inside(path, out):
            raise UserError(f"--overwrite would move runtime_args.output_dir {out!r} aside, but {key} ({path!r}) "
                            "is inside it. Move that input out first, or choose another runtime_args.output_dir.")
    base = os.path.normpath(out) + ".old-" + time.strftime("%Y%m%d-%H%M%S")
    dest, n = base, 1
    while os.path.lexists(dest):
        n += 1
        dest = f"{base}-{n}"
    try:
        os.rename(out, dest)
    except OSError as err:
        raise UserError(f"--overwrite cannot move runtime_args.output_dir {out!r} to {dest!r}: {err}. Move or "
                        "delete the old run yourself, or choose another runtime_args.output_dir.")
    # the lock moved with the folder: take it again in the new, empty folder, then drop the old copy
    old_lock = RunLock(dest)
    old_lock.token, lock.token = lock.token, None
    try:
        lock.acquire()
    finally:
        old_lock.release()
    return dest


def reconcile_logs(cfg: DictConfig) -> None:
    """Before a resumed run opens its append-only logs: drop the rows that a crashed run wrote
    past the checkpoint it resumes from (metrics, timeline and samples; all of them when there is none: the run
    starts over),
    and any row torn by the crash, so that no episode appears twice and no new row is glued to a
    torn one. Each file is rewritten atomically (see chatlearn.logging.jsonl). The ``.tmp`` folders of
    checkpoint saves cut short are removed first."""
    rt = cfg.runtime_args
    ckpt = CheckpointManager(os.path.join(rt.output_dir, "checkpoints"), rt.keep_last_checkpoints)
    for path in ckpt.remove_leftovers():  # saves cut short (a crash, a full disk): never loaded, only in the way
        if os.path.basename(path).startswith("episode_"):
            info(f"removed {path}, a checkpoint whose save was cut short (resume loads only complete ones)")
    # the checkpoint resume will load: a damaged newest one is passed over (and named then)
    found = ckpt.latest_usable(warn=lambda msg: None)
    last = found[0] if found is not None else -1
    for name in ("metrics.jsonl", "timeline.jsonl", "samples.jsonl"):
        jsonl.truncate_after(os.path.join(rt.output_dir, name), last)
