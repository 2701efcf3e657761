"""User-facing errors: one paragraph that names the culprit and the fix, exit code 2."""
from __future__ import annotations

import errno
import os
import re


class UserError(Exception):
    """A mistake in the user's input (config, data, paths, checkpoints).

    The CLI prints ``str(err)`` as one paragraph and exits with ``exit_code``, without a
    traceback unless ``--debug`` is given.
    """

    exit_code = 2

    def __init__(self, message: str, *, key: str | None = None):
        self.key = key
        self.message = f"{key}: {message}" if key else message  # kept when Ray wraps the error
        super().__init__(self.message)


class ConfigError(UserError):
    """A config key is unknown, has the wrong type, or an invalid value."""


# ----------------------------------------------------------------------------- writes that fail

# a write refused by the disk or the file system: full, over a quota or a size limit, read-only, not allowed
DISK_ERRNOS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
               errno.EFBIG: "the file grew past a size limit", errno.EROFS: "the file system is read-only",
               errno.EACCES: "permission is denied", errno.EPERM: "permission is denied"}
# such an error as text, when a library reports it in its own exception (safetensors: IoError(Os { code: 28, ...)
_TEXT_ERRNO = re.compile(r"\b(?:code: |\[Errno )(\d+)\b")


def disk_error(exc: BaseException | None) -> OSError | None:
    """The write refused by the disk or file system (:data:`DISK_ERRNOS`) behind ``exc``, if any: ``exc``
    itself, what it was raised from or during, the original of an error that crossed Ray (``cause``) and
    the per-rank failures of ``torch.distributed.checkpoint`` (``failures``), or an errno in a library's
    message (safetensors). None when the failure is something else."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return e
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
        if not isinstance(e, OSError):
            m = _TEXT_ERRNO.search(str(e))
            if m and int(m.group(1)) in DISK_ERRNOS:
                code = int(m.group(1))
                return OSError(code, os.strerror(code))
    return None


RESUME = "then run the same command again: it resumes from the last complete checkpoint"


def write_refusal(what: str, err: OSError, path: str | None = None, then: str = RESUME,
                  other: str = "runtime_args.output_dir") -> UserError:
    """One paragraph for a write the disk refused: ``what`` could not be written (the file, or ``path``
    when the error names none), why, and what to do (choose another ``other``; ``then``: after the fix)."""
    where = err.filename or path
    reason = DISK_ERRNOS[err.errno] if err.errno in DISK_ERRNOS else (err.strerror or str(err))
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        fix = ("Free space there (older runs, or checkpoints: a lower runtime_args.keep_last_checkpoints keeps "
               f"fewer), or choose a {other} on a disk with room")
    elif err.errno == errno.EROFS:
        fix = f"Choose a {other} on a writable file system"
    else:
        fix = f"Make the folder writable for this user (chmod, chown), or choose another {other}"
    return UserError(f"cannot write {what}{f' ({where})' if where and where not in what else ''}: {reason} "
                     f"({errno.errorcode.get(err.errno, err.errno)}: {err.strerror or err}). Nothing partial was "
                     f"kept. {fix}, {then}.")
