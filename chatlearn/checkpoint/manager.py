"""Training checkpoints that survive a crash at any moment.

Layout under ``<output_dir>/checkpoints``::

    latest                    name of the newest complete checkpoint (replaced atomically)
    episode_000020/           one checkpoint, under one step counter (the episode)
        trainer/              policy_trainer's sharded state (torch.distributed.checkpoint)
        hf/                   Hugging Face folder of the policy (when save_hf)
        state.json            episode, run id, data sampler state, ...
        config.yaml           the resolved config the checkpoint was trained with, secrets shown as ***
                              (compared with a resumed run's: chatlearn.runtime.rundir.config_history)
        manifest.json         every file above, by relative path, with its size in bytes
        COMPLETE              written last

A checkpoint is written into ``episode_N.tmp`` and renamed once complete, so a crash leaves
either the previous checkpoints untouched plus a stray ``.tmp`` folder (removed on resume and on
the next save) or the new one complete. A save that fails (a full disk) removes its ``.tmp``
folder itself; a write the disk refused, here or in a trainer worker, is one paragraph naming
the checkpoint (chatlearn.errors.write_refusal). Only the newest ``keep`` checkpoints of the current run are
kept: each checkpoint records the id of the run that wrote it (a resumed run keeps the id of
the checkpoint it resumed from), and retention never deletes a checkpoint of another run, nor
the one just saved, so ``latest`` always names a checkpoint that exists.

A checkpoint damaged after it was written (a file truncated or removed: a full disk, a copy
cut short, a storage fault) no longer matches its manifest. Resume checks the manifest before
loading and falls back, with a warning naming the damage, to the newest checkpoint that
matches; ``chatlearn merge`` and ``chatlearn eval`` refuse a damaged one in one paragraph.
Checkpoints written before manifests existed are taken as they are.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from typing import Callable

from chatlearn.config.manifest import MANIFEST, manifest_problems
from chatlearn.errors import UserError, disk_error, write_refusal

MARKER = "COMPLETE"
CONFIG = "config.yaml"  # the config a checkpoint was trained with (absent in checkpoints of older versions)
_NAME = re.compile(r"^episode_(\d+)$")


class CheckpointManager:
    def __init__(self, root: str, keep: int, run_id: str | None = None):
        self.root = root
        self.keep = keep
        self.run_id = run_id or uuid.uuid4().hex
        # resumed from a checkpoint written before checkpoints recorded their run: those count as this run's
        self._adopt_unmarked = False

    def adopt(self, state: dict) -> None:
        """Continue the run of the checkpoint whose ``state.json`` is ``state`` (on resume)."""
        if isinstance(state.get("run_id"), str):
            self.run_id = state["run_id"]
        else:
            self._adopt_unmarked = True

    def _is_ours(self, path: str) -> bool:
        try:
            with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
                state = json.load(f)
        except (OSError, ValueError):
            return False  # unreadable: never deleted by retention
        if not isinstance(state, dict):
            return False
        if "run_id" not in state:
            return self._adopt_unmarked
        return state["run_id"] == self.run_id

    @staticmethod
    def name(episode: int) -> str:
        return f"episode_{episode:06d}"

    def complete(self) -> list[tuple[int, str]]:
        """(episode, path) of every complete checkpoint, oldest first."""
        if not os.path.isdir(self.root):
            return []
        out = []
        for entry in os.listdir(self.root):
            m = _NAME.match(entry)
            path = os.path.join(self.root, entry)
            if m and os.path.isfile(os.path.join(path, MARKER)):
                out.append((int(m.group(1)), path))
        return sorted(out)

    def latest_usable(self, warn: Callable[[str], None]) -> tuple[int, str] | None:
        """The newest complete checkpoint that matches its manifest (see :meth:`latest`); each
        newer one that does not is named through ``warn``. A UserError when there are complete
        checkpoints but none matches."""
        found = self.latest()
        if found is None:
            return None
        damaged = []
        for episode, path in [found] + [c for c in reversed(self.complete()) if c[0] < found[0]]:
            problems = manifest_problems(path)
            if not problems:
                if damaged:
                    warn(f"resuming from {path} (episode {episode}), the newest checkpoint that is not damaged. "
                         "A damaged checkpoint is left in place and replaced when the run saves that episode "
                         "again.")
                return episode, path
            more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
            damaged.append(f"{path} is damaged: {'; '.join(problems[:3])}{more}")
            warn(f"checkpoint {damaged[-1]}. It no longer holds what was written (a truncated copy, a full disk or "
                 "a storage fault), so it is not loaded.")
        raise UserError(f"every checkpoint in {self.root!r} is damaged, so there is none to resume from: "
                        f"{' | '.join(damaged[:3])}{' | ...' if len(damaged) > 3 else ''}. Restore the files from "
                        "a copy, or start over with --no-resume (or --overwrite to move this run aside).")

    def latest(self) -> tuple[int, str] | None:
        """The newest complete checkpoint: the ``latest`` pointer, or the highest complete one."""
        pointer = os.path.join(self.root, "latest")
        if os.path.isfile(pointer):
            try:
                with open(pointer, encoding="utf-8") as f:
                    name = f.read().strip()
            except OSError as err:
                raise UserError(f"cannot read checkpoint pointer {pointer!r}: {err}. Fix its permissions, or start "
                                "fresh with --no-resume.")
            m = _NAME.match(name)
            if m and os.path.isfile(os.path.join(self.root, name, MARKER)):
                return int(m.group(1)), os.path.join(self.root, name)
        found = self.complete()
        return found[-1] if found else None

    def save(self, episode: int, write: Callable[[str], None], state: dict, config_text: str | None = None,
             commit: bool = True) -> str:
        """Write a checkpoint: ``write(tmp_dir)`` fills it, then config.yaml (``config_text``, the resolved
        config as YAML, secrets masked), state.json, the manifest, the marker, and (``commit``) the rename.
        With ``commit`` false the complete checkpoint waits in ``episode_N.tmp`` for :meth:`commit` (a run
        commits an episode's checkpoint once that episode's metrics row is written: a crash before that
        resumes from the checkpoint before it and runs the episode again, its row included)."""
        final = os.path.join(self.root, self.name(episode))
        tmp = final + ".tmp"
        try:
            os.makedirs(self.root, exist_ok=True)
            self.remove_leftovers()
            os.makedirs(tmp)
            write(tmp)
            self._finish(episode, tmp, state, config_text)
        except BaseException as err:
            # a save that fails leaves no partial checkpoint for a resume to trip on (nor its space taken)
            shutil.rmtree(tmp, ignore_errors=True)
            self.remove_leftovers()  # and a pointer cut short (latest.tmp)
            refused = disk_error(err)
            if refused is not None:
                raise write_refusal(f"checkpoint {final}", refused, path=tmp) from err
            raise
        return self.commit(episode) if commit else tmp

    def commit(self, episode: int) -> str:
        """Make the complete checkpoint waiting in ``episode_N.tmp`` the run's: the rename, the ``latest``
        pointer, then keep-last-N."""
        final = os.path.join(self.root, self.name(episode))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(final + ".tmp", final)
        pointer = os.path.join(self.root, "latest")
        with open(pointer + ".tmp", "w", encoding="utf-8") as f:
            f.write(self.name(episode) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer + ".tmp", pointer)
        _fsync_dir(self.root)
        if self.keep > 0:
            # this run's older checkpoints, newest first; the one just saved counts as the first kept
            older = [path for ep, path in reversed(self.complete()) if ep < episode and self._is_ours(path)]
            for path in older[self.keep - 1:]:
                shutil.rmtree(path, ignore_errors=True)
        return final

    def remove_leftovers(self) -> list[str]:
        """Remove the ``.tmp`` folders of saves that were cut short (a crash, a full disk); returns them.
        They are never loaded (only a complete, renamed checkpoint is), only in the way."""
        if not os.path.isdir(self.root):
            return []
        found = [os.path.join(self.root, e) for e in sorted(os.listdir(self.root)) if e.endswith(".tmp")]
        for path in found:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass
        return found

    def _finish(self, episode: int, tmp: str, state: dict, config_text: str | None) -> None:
        """After the models' state is in ``tmp``: config.yaml, state.json, the manifest, the marker."""
        time.sleep(_test_delay(episode))
        if config_text is not None:
            with open(os.path.join(tmp, CONFIG), "w", encoding="utf-8") as f:
                f.write(config_text)
                f.flush()
                os.fsync(f.fileno())
        with open(os.path.join(tmp, "state.json"), "w", encoding="utf-8") as f:
            json.dump({"episode": episode, "run_id": self.run_id, **state}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        write_manifest(tmp)
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            f.write("ok\n")
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)

    @staticmethod
    def read_state(path: str) -> dict:
        try:
            with open(os.path.join(path, "state.json"), encoding="utf-8") as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise UserError(f"checkpoint {path!r} has no readable state.json ({err}). Delete that folder to resume "
                            "from the one before it, or start fresh with --no-resume.")


def write_manifest(folder: str) -> None:
    """``folder/manifest.json``: every file under ``folder`` by relative path (``/``-separated)
    with its size in bytes, fsynced."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            full = os.path.join(root, name)
            files[os.path.relpath(full, folder).replace(os.sep, "/")] = os.path.getsize(full)
    with open(os.path.join(folder, MANIFEST), "w", encoding="utf-8") as f:
        json.dump({"files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def check_against_manifest(path: str, what: str) -> None:
    """A UserError in one paragraph when the checkpoint at ``path`` does not match its manifest."""
    problems = manifest_problems(path)
    if problems:
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise UserError(f"{what} {path!r} is damaged: {'; '.join(problems[:5])}{more}. It no longer holds what "
                        "was written (a truncated copy, a full disk or a storage fault). Use another checkpoint "
                        "(checkpoints/episode_N of the same run), or restore this one from a copy.")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _test_delay(episode: int) -> float:
    """A window in which to interrupt a save, for crash tests only: ``CHATLEARN_CHECKPOINT_TEST_DELAY``
    is ``seconds`` (every save) or ``seconds@episode`` (only that episode's save)."""
    value = os.environ.get("CHATLEARN_CHECKPOINT_TEST_DELAY", "")
    if not value:
        return 0.0
    seconds, _, only = value.partition("@")
    return float(seconds) if not only or int(only) == episode else 0.0
