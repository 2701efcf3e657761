"""The append-only JSON-lines files of a run (``metrics.jsonl``, ``timeline.jsonl``): crash-safe
opening for append and crash-safe truncation on resume.

* A line cut short by a crash or a power loss (a *torn* line: no final newline) is never
  continued: :func:`open_append` drops it before the first new row, so the next row starts on
  a line of its own.
* On resume, :func:`truncate_after` keeps the rows of the episodes up to the checkpoint's and
  drops the rest (the resumed run writes them again) and any line that is not a JSON object. It
  writes the kept rows to a temporary file, fsyncs it and renames it over the original, so a
  crash in the middle leaves either the old file or the new one, never a mix.
"""
from __future__ import annotations

import json
import os

from chatlearn.errors import UserError, disk_error, write_refusal
from chatlearn.logging.console import warn


def fsync_dir(path: str) -> None:
    """Make a rename or a new file in ``path`` durable (best effort: not every file system can)."""
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a temporary file next to it, fsynced and
    renamed over it; a crash leaves the previous file (or none) and no partial one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def drop_torn_tail(path: str) -> int:
    """Cut a last line that has no final newline (a row torn by a crash) off ``path``; returns
    the number of bytes dropped (0: the file ends with a newline, is empty, or does not exist)."""
    try:
        f = open(path, "r+b")
    except FileNotFoundError:
        return 0
    with f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        # find the last newline, reading backwards in blocks
        end = size
        keep = 0
        while end > 0:
            start = max(0, end - 65536)
            f.seek(start)
            block = f.read(end - start)
            at = block.rfind(b"\n")
            if at >= 0:
                keep = start + at + 1
                break
            end = start
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    warn(f"{path}: dropped a last line cut short by an earlier crash ({size - keep} bytes)", stderr=True)
    return size - keep


def open_append(path: str):
    """``path`` opened for appending rows (text, UTF-8), a torn last line dropped first."""
    drop_torn_tail(path)
    return open(path, "a", encoding="utf-8")


class RowFile:
    """``path`` for appending rows, each :meth:`write` whole or not at all: the rows are encoded first and
    appended in one unbuffered write, fsynced when ``fsync``; a write that fails (a full disk) is cut
    back to the size before it, so no torn row is left, and a write the disk refused is a
    :class:`~chatlearn.errors.UserError` naming the file. Nothing is buffered, so closing cannot fail
    on the rows of a failed write. A torn last line left by a crash is dropped on opening."""

    def __init__(self, path: str, fsync: bool = True):
        self.path, self.fsync = path, fsync
        try:
            drop_torn_tail(path)
            self._fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as err:
            raise _refusal(path, err) from err

    def write(self, text: str) -> None:
        data = memoryview(text.encode("utf-8"))
        self.check_there()
        size = os.fstat(self._fd).st_size
        try:
            while data:
                data = data[os.write(self._fd, data):]
            if self.fsync:
                os.fsync(self._fd)
        except OSError as err:
            try:
                os.ftruncate(self._fd, size)
            except OSError:
                pass
            raise _refusal(self.path, err) from err

    def check_there(self) -> None:
        """A UserError when the file open here is no longer ``path`` (it, or its folder, was deleted or moved during
        the run): every row written from now on would be lost."""
        try:
            same = os.path.samestat(os.fstat(self._fd), os.stat(self.path))
        except FileNotFoundError:
            same = False
        if not same:
            raise UserError(f"{self.path} is gone: it, or the folder holding it (runtime_args.output_dir), was deleted "
                            "or moved while the run was writing it, so every row from now on would be lost. The run "
                            "stops here. Restore the folder and run the same command again to resume from its last "
                            "checkpoint, or start a new run; keep the output folder in place while a run writes it.")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _refusal(path: str, err: OSError) -> Exception:
    """A write the disk refused as one paragraph naming ``path``; any other error as it is."""
    if disk_error(err) is None:
        return err
    return write_refusal(path, err, then="then run the same command again: it resumes from the last complete "
                         "checkpoint and writes the rows again")


def _episode(line: str) -> int | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict) or not isinstance(row.get("episode"), int) or isinstance(row["episode"], bool):
        return None
    return row["episode"]


def truncate_after(path: str, episode: int) -> int:
    """Keep the rows of ``path`` whose ``episode`` is at most ``episode``; drop later rows and
    lines that are not JSON objects with an integer episode (torn or damaged). Atomic: a new file
    is written, fsynced and renamed over ``path``. Returns the number of lines dropped (the file
    is not rewritten when that is 0)."""
    try:
        with open(path, encoding="utf-8", errors="replace", newline="\n") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return 0
    keep, damaged = [], 0
    for line in lines:
        if not line.strip():  # blank: dropped without a word
            continue
        ep = _episode(line) if line.endswith("\n") else None
        if ep is None:
            damaged += 1
        elif ep <= episode:
            keep.append(line)
    dropped = len(lines) - len(keep)
    if dropped == 0:
        return 0
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    if damaged:
        warn(f"{path}: dropped {damaged} line(s) that are not complete JSON rows (cut short by a crash)",
             stderr=True)
    return dropped
