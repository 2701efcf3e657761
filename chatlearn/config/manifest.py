"""A checkpoint's ``manifest.json``: every file of the checkpoint folder by relative path with its
size in bytes (written by :func:`chatlearn.checkpoint.manager.write_manifest`). Reading it back is
here, in the config layer, since validation checks a model folder that is a run's checkpoint
(``checkpoints/episode_N/hf``) against it before anything starts.
"""
from __future__ import annotations

import json
import os

MANIFEST = "manifest.json"


def _manifest_root(path: str) -> tuple[str, str] | None:
    """(checkpoint folder holding manifest.json, ``path`` relative to it) for ``path`` being a
    checkpoint folder or a folder inside one (``trainer/``, ``hf/``); None without a manifest."""
    path = os.path.abspath(path)
    for folder in (path, os.path.dirname(path)):
        if os.path.isfile(os.path.join(folder, MANIFEST)):
            return folder, os.path.relpath(path, folder).replace(os.sep, "/")
    return None


def manifest_problems(path: str) -> list[str]:
    """What does not match the manifest of the checkpoint holding ``path`` (only files under
    ``path`` when it is a folder inside the checkpoint): a missing file, or a size other than
    the one recorded. [] when all match, or when there is no manifest (an older checkpoint)."""
    found = _manifest_root(path)
    if found is None:
        return []
    root, inner = found
    try:
        with open(os.path.join(root, MANIFEST), encoding="utf-8") as f:
            files = json.load(f)["files"]
        files = {str(k): int(v) for k, v in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return [f"its {MANIFEST} is unreadable ({err})"]
    prefix = "" if inner == "." else inner + "/"
    problems = []
    for rel, size in files.items():
        if not rel.startswith(prefix):
            continue
        full = os.path.join(root, *rel.split("/"))
        try:
            got = os.path.getsize(full)
        except OSError:
            problems.append(f"{rel} is missing")
            continue
        if got != size:
            problems.append(f"{rel} is {got} bytes, {size} when written" + (" (truncated)" if got < size else ""))
    return problems
