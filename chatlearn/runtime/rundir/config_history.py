"""The configs a run has run with, and what a resumed run may change of its checkpoint's.

In the output folder::

    config.yaml                      the resolved config of the newest start (secrets shown as ***)
    configs/
        config-<YYYYmmdd-HHMMSS>-episode_<N>.yaml   every config the run has started with: N is the
                                     episode of the checkpoint it resumed from (000000: a fresh start)
        history.jsonl                one row per start that began with a config other than the newest
                                     one above, or that accepted changes: time, file, resumed_from (the
                                     checkpoint's episode, null for a fresh start), changes ({key: [old,
                                     new]} against the checkpoint's config) and accepted (the keys among
                                     them that alter training, accepted with --accept-config-changes)
    checkpoints/episode_N/config.yaml   the config episode N was trained with (chatlearn.checkpoint.manager)

Before a run resumes, :func:`check_resume` compares its resolved config with its checkpoint's, key
by key (chatlearn.config.changes): harmless differences are printed and accepted; one that alters
training refuses the run before anything is written or started, unless ``accept`` (``chatlearn run
--accept-config-changes``). :func:`check_prompt_count` does the same for the number of prompts the
data holds, which the data sampler's saved position depends on. The data itself is compared by content:
each checkpoint records a fingerprint of ``runtime_args.data_path`` (chatlearn.config.data_fingerprint:
absolute paths, sizes and hashes), so another file behind the same relative path is refused and the same
file spelled another way is not. Once the folder is locked,
:func:`record_config` writes ``config.yaml`` and the history. A checkpoint of an older version
records no config: the run resumes with a one-line warning that changes cannot be checked.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf

from chatlearn.checkpoint.manager import CONFIG, CheckpointManager
from chatlearn.config.changes import Change, config_changes, flatten
from chatlearn.config.data_fingerprint import data_fingerprint, describe, same_data
from chatlearn.errors import UserError
from chatlearn.logging.console import info
from chatlearn.logging.jsonl import fsync_dir, open_append, write_text_atomic
from chatlearn.logging.sinks import changed_config, config_yaml, loggable_config

HISTORY_DIR = "configs"
HISTORY = "history.jsonl"
ACCEPT_FLAG = "--accept-config-changes"
DATA = "runtime_args.data_path"


@dataclass
class ResumeCheck:
    """What :func:`check_resume` found: the checkpoint the run resumes from (None: none, it starts
    fresh), its episode, the differences of the config and the keys accepted that alter training."""

    checkpoint: str | None = None
    episode: int = 0
    changes: list[Change] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
    unchecked: bool = False  # the checkpoint records no config

    def report(self) -> list[str]:
        """The differences as readable lines (nothing when there are none)."""
        if not self.changes:
            return []
        lines = [f"config changes since the checkpoint {self.checkpoint} (episode {self.episode}):"]
        for c in sorted(self.changes, key=lambda c: c.harmless):  # those that alter training first
            lines.append(f"  {c.line()}   ({'harmless' if c.harmless else 'alters training: accepted'})")
        return lines

    def warning(self) -> str | None:
        if not self.unchecked:
            return None
        return (f"checkpoint {self.checkpoint} records no config (written by an older chatlearn): changes to the "
                "config since it was saved cannot be checked")


def check_resume(cfg: DictConfig, accept: bool) -> ResumeCheck:
    """Compare ``cfg`` with the config of the checkpoint a resumed run would load (read-only; also for
    ``--dry-run``). A UserError in one paragraph when a difference alters training and not ``accept``."""
    rt = cfg.runtime_args
    if not rt.enable_resume_training:
        return ResumeCheck()
    found = CheckpointManager(os.path.join(rt.output_dir, "checkpoints"),
                              rt.keep_last_checkpoints).latest_usable(warn=lambda msg: None)
    if found is None:
        return ResumeCheck()
    episode, path = found
    old = _checkpoint_config(path)
    if old is None:
        return ResumeCheck(path, episode, unchecked=True)
    non_default = set(flatten(changed_config(cfg)))
    changes = _data_by_content(config_changes(old, loggable_config(cfg), non_default), path, rt.data_path)
    altering = [c for c in changes if not c.harmless]
    if altering and not accept:
        raise _refusal(rt.output_dir, path, episode, altering)
    return ResumeCheck(path, episode, changes, [c.key for c in altering])


def check_prompt_count(check: ResumeCheck, num_prompts: int, accept: bool) -> None:
    """The data sampler's saved position counts in the prompts of the data it was saved with: a data
    set of another size (the same path, rewritten) is refused like a change of the config, unless
    ``accept`` (then it is one more accepted change)."""
    if check.checkpoint is None:
        return
    state = CheckpointManager.read_state(check.checkpoint)
    sampler = state["sampler"] if isinstance(state, dict) and "sampler" in state else None
    if not isinstance(sampler, dict) or "size" not in sampler or int(sampler["size"]) == num_prompts:
        return  # a checkpoint that does not record the size (older versions) cannot be checked
    saved = int(sampler["size"])
    change = Change("runtime_args.data_path (number of prompts)", saved, num_prompts, harmless=False)
    if not accept:
        out = os.path.dirname(os.path.dirname(check.checkpoint))
        raise _refusal(out, check.checkpoint, check.episode, [change])
    check.changes.append(change)
    check.accepted.append(change.key)


def _data_by_content(changes: list[Change], path: str, value: str) -> list[Change]:
    """``runtime_args.data_path`` compared by what it holds (chatlearn.config.data_fingerprint) where the
    checkpoint at ``path`` records the fingerprint of its data: the same files spelled another way (a
    relative path, a copy elsewhere) are a harmless change; the same spelling naming other data (a relative
    path resolved from another directory, a file rewritten) alters training. A checkpoint of an older
    version records none: the paths are compared as written."""
    state = CheckpointManager.read_state(path)
    recorded = state.get("data") if isinstance(state, dict) else None
    if not isinstance(recorded, list):
        return changes
    now = data_fingerprint(value)
    rest = [c for c in changes if c.key != DATA]
    if same_data(recorded, now):
        return rest + [Change(c.key, c.old, c.new, harmless=True) for c in changes if c.key == DATA]
    return rest + [Change(f"{DATA} (content)", describe(recorded), describe(now), harmless=False)]


def _checkpoint_config(path: str) -> dict | None:
    """The config recorded in the checkpoint at ``path`` as plain containers; None without one."""
    file = os.path.join(path, CONFIG)
    if not os.path.isfile(file):
        return None
    try:
        loaded = OmegaConf.to_container(OmegaConf.load(file), resolve=False)
    except Exception as err:  # noqa: BLE001 (a YAML error of any kind: the file is not what was written)
        raise UserError(f"the config recorded in checkpoint {path!r} ({file}) is unreadable: {err}. Restore it from "
                        "a copy, or delete that file to resume without checking the config against it.")
    if not isinstance(loaded, dict):
        raise UserError(f"the config recorded in checkpoint {path!r} ({file}) holds no settings. Restore it from a "
                        "copy, or delete that file to resume without checking the config against it.")
    return loaded


def _refusal(out: str, path: str, episode: int, altering: list[Change]) -> UserError:
    keys = "; ".join(c.line() for c in altering)
    one = len(altering) == 1
    return UserError(
        f"the run in {out!r} resumes from checkpoint {path} (episode {episode}), which was trained with other "
        f"settings, and {'this change alters' if one else 'these changes alter'} training: {keys}. Resuming would "
        "continue that training under other rules (a learning rate, data, group or batch size the optimizer state "
        "and the data sampler's position were not saved with), so nothing was started or written. To resume with "
        f"{'it' if one else 'them'} on purpose, add {ACCEPT_FLAG} (the new config is kept beside the old one in "
        f"{os.path.join(out, HISTORY_DIR)}/); to resume as trained, run with the checkpoint's settings "
        f"({os.path.join(path, CONFIG)}); to start a new run, add --overwrite (the old run is moved to "
        f"{os.path.normpath(out)}.old-<time>) or choose another runtime_args.output_dir.")


def record_config(cfg: DictConfig, check: ResumeCheck) -> None:
    """Once the output folder is locked: write ``config.yaml`` and, when this start's config is not the
    newest kept or it accepted changes, keep it in ``configs/`` with a row of ``configs/history.jsonl``;
    name accepted changes on the console."""
    out = cfg.runtime_args.output_dir
    text = config_yaml(cfg)
    folder = os.path.join(out, HISTORY_DIR)
    rows = _history(folder)
    if not rows:
        _keep_earlier_config(out, folder, text, rows)
    newest = _read(os.path.join(folder, rows[-1]["file"])) if rows else None
    if newest != text or check.changes:
        os.makedirs(folder, exist_ok=True)
        name = rows[-1]["file"] if newest == text else _new_name(folder, check.episode)
        if newest != text:
            write_text_atomic(os.path.join(folder, name), text)
        _append(folder, {"time": time.strftime("%Y-%m-%d %H:%M:%S %z"), "file": name,
                         "resumed_from": check.episode if check.checkpoint else None,
                         "changes": {c.key: [c.old, c.new] for c in check.changes}, "accepted": check.accepted})
    write_text_atomic(os.path.join(out, "config.yaml"), text)
    if check.accepted:
        info(f"accepted config changes that alter training ({ACCEPT_FLAG}): {', '.join(check.accepted)}; recorded "
             f"in {os.path.join(folder, HISTORY)}")


def _keep_earlier_config(out: str, folder: str, text: str, rows: list) -> None:
    """A run folder of an older version has config.yaml but no history: keep that config first."""
    earlier = _read(os.path.join(out, "config.yaml"))
    if earlier is None or earlier == text:
        return
    os.makedirs(folder, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(os.path.getmtime(os.path.join(out, "config.yaml"))))
    name = f"config-{stamp}-earlier.yaml"
    write_text_atomic(os.path.join(folder, name), earlier)
    row = {"time": None, "file": name, "resumed_from": None, "changes": {}, "accepted": [],
           "note": "config.yaml of the starts before configs/ was kept"}
    _append(folder, row)
    rows.append(row)


def _new_name(folder: str, episode: int) -> str:
    base = f"config-{time.strftime('%Y%m%d-%H%M%S')}-episode_{episode:06d}"
    name, n = f"{base}.yaml", 1
    while os.path.exists(os.path.join(folder, name)):
        n += 1
        name = f"{base}-{n}.yaml"
    return name


def _history(folder: str) -> list[dict]:
    """The rows of ``configs/history.jsonl`` whose file exists ([] without one)."""
    path = os.path.join(folder, HISTORY)
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:  # a row torn by a crash
                continue
            if isinstance(row, dict) and "file" in row and isinstance(row["file"], str) and os.path.isfile(
                    os.path.join(folder, row["file"])):
                rows.append(row)
    return rows


def _append(folder: str, row: dict) -> None:
    with open_append(os.path.join(folder, HISTORY)) as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(folder)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None

