"""Whether a path can be written: the nearest part of it that exists, and a probe that creates, writes and removes
a small file in a folder. Read by the run's preflight (``chatlearn.runtime.rundir.preflight``) and by the
container's output-volume check (``chatlearn.config.container``)."""
from __future__ import annotations

import errno
import os

PROBE = ".chatlearn-write-probe"


def nearest_existing(path: str) -> str:
    """``path`` (made absolute), or its nearest ancestor that exists: a file when the path lies under one."""
    path = os.path.abspath(path)
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def probe(folder: str) -> str | None:
    """Create, write and remove a small file in ``folder``; what went wrong and the fix, or None."""
    name = os.path.join(folder, f"{PROBE}-{os.getpid()}")
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as err:
        return why(err)
    try:
        os.write(fd, b"chatlearn\n")
    except OSError as err:
        return why(err)
    finally:
        os.close(fd)
        try:
            os.unlink(name)
        except OSError:
            pass
    return None


def why(err: OSError) -> str:
    """What an ``OSError`` of a write means, and the fix."""
    if err.errno in (errno.EACCES, errno.EPERM):
        return (f"permission denied ({err.strerror}). Make it writable for this user (chmod, chown), or choose a "
                "folder you can write")
    if err.errno == errno.EROFS:
        return "the file system is read-only. Choose a folder on a writable disk"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full ({err.strerror}). Free space there, or choose a folder on a disk with room"
    return f"{err.strerror or err}. Fix that, or choose another folder"
