"""What the data of a run is, by content rather than by spelling: the fingerprint each checkpoint records
of ``runtime_args.data_path`` and a resumed run compares with its own (chatlearn.runtime.rundir.config_history).

A local entry (a file, or a folder of data files) is resolved to its absolute path, and each of its data
files is fingerprinted by its size and a SHA-256: of the whole file up to :data:`WHOLE_FILE` bytes, and
past that of its size, its first and its last :data:`EDGE` bytes. Data files can be gigabytes: hashing
the whole of one would add seconds to every start and resume, while size + both ends tells another file
from this one in practice (a rewrite, another split, other rows appended or removed all change the size
or an end); the modification time is not used, so a copy of the same file (``cp``, a sync to another
machine) is the same data. A Hub dataset entry is recorded as the validated config pins it
(``org/name@commit``): its revision is its fingerprint. Two fingerprints hold the same data when their
entries list the same files' sizes and hashes in the same order, wherever the files are and however
their paths are spelled.
"""
from __future__ import annotations

import hashlib
import os

from chatlearn.config.data_sources import DATA_SUFFIXES

WHOLE_FILE = 64 << 20  # files up to this size are hashed whole
EDGE = 8 << 20  # of a larger file: its first and last EDGE bytes (and its size)


def data_fingerprint(value: str) -> list[dict]:
    """Per entry of the comma-separated data path ``value``: ``{"path": absolute path, "files": [{"name",
    "size", "sha256"}]}`` for a local file or folder (the files of a folder by name, sorted), ``{"hub":
    entry}`` otherwise."""
    out = []
    for entry in (p.strip() for p in str(value).split(",")):
        if not entry:
            continue
        if not os.path.exists(entry):
            out.append({"hub": entry})
            continue
        path = os.path.abspath(entry)
        files = ([os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(DATA_SUFFIXES)]
                 if os.path.isdir(path) else [path])
        out.append({"path": path, "files": [
            {"name": os.path.relpath(f, path) if f != path else os.path.basename(f), "size": os.path.getsize(f),
             "sha256": file_hash(f)} for f in files]})
    return out


def file_hash(path: str) -> str:
    """SHA-256 of the file, whole up to :data:`WHOLE_FILE` bytes; past that of its size and both ends."""
    digest = hashlib.sha256()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= WHOLE_FILE:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        else:
            digest.update(f"size={size};".encode())
            digest.update(f.read(EDGE))
            f.seek(size - EDGE)
            digest.update(f.read(EDGE))
    return digest.hexdigest()


def same_data(old: list, new: list) -> bool:
    """Whether the fingerprints ``old`` and ``new`` hold the same data (paths and file names aside)."""
    def content(fingerprint):
        return [e["hub"] if "hub" in e else [(f["size"], f["sha256"]) for f in e["files"]] for e in fingerprint]

    try:
        return content(old) == content(new)
    except (KeyError, TypeError):  # a record this version does not read: not known to be the same
        return False


def describe(fingerprint: list) -> str:
    """A fingerprint as it reads in a message: each entry's path, its files' count, size and hash prefix."""
    parts = []
    for e in fingerprint:
        if "hub" in e:
            parts.append(f"Hub dataset {e['hub']}")
            continue
        files = e["files"]
        size = sum(f["size"] for f in files)
        what = f"sha256 {files[0]['sha256'][:12]}" if len(files) == 1 else f"{len(files)} files"
        parts.append(f"{e['path']} ({size} bytes, {what})")
    return ", ".join(parts)
