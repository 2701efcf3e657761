"""What a run leaves behind when it cannot clean up (its driver SIGKILLed, a node lost), removed at
the next start; and what it removes itself on a normal exit.

- Temporary files: vLLM's rendezvous file (``<tmp>/vllm_dist_<hex>``, a torch ``FileStore``) stays
  in the temp folder when its process is killed, and vLLM leaves it even on a clean exit. A
  worker records the ``vllm_dist_*`` files its backend created in ``<tmp>/chatlearn-owned-<pid>.json``;
  once that process is gone, the next worker or driver to start on the node removes them.
- Ray processes: a local Ray cluster started by ``chatlearn run`` outlives a SIGKILLed driver for a
  couple of minutes (its dashboard and runtime-env agents). The driver marks its environment with
  ``CHATLEARN_DRIVER_PID`` before ``ray.init``, so every Ray process it starts carries the mark; at
  the next start, processes of this user whose mark names a driver that no longer exists are
  stopped. Nothing else is touched: never a Ray cluster the user started (``ray start``), never
  a live run's processes, never another user's files or processes.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import tempfile
import time

from chatlearn.logging.console import info

DRIVER_ENV = "CHATLEARN_DRIVER_PID"
OWNED = "chatlearn-owned-"
PATTERNS = ("vllm_dist_*",)
RAY_TAGS = (b"ray::", b"/ray/", b"VLLM::")  # in the command lines of Ray's and vLLM's processes


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def temp_files(tmp: str | None = None) -> set[str]:
    tmp = tmp or tempfile.gettempdir()
    return {p for pattern in PATTERNS for p in glob.glob(os.path.join(tmp, pattern))}


def record_owned(files, tmp: str | None = None) -> str | None:
    """Record ``files`` (created by this process) as owned by it; ``None`` when there are none."""
    files = sorted(files)
    if not files:
        return None
    tmp = tmp or tempfile.gettempdir()
    path = os.path.join(tmp, f"{OWNED}{os.getpid()}.json")
    part = path + ".part"
    with open(part, "w", encoding="utf-8") as f:
        json.dump({"pid": os.getpid(), "files": files}, f)
    os.replace(part, path)
    return path


def _remove_owned(path: str, tmp: str) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        files = []
    removed = 0
    owned = temp_files(tmp)
    for name in files:
        if name in owned:  # only the kinds of files recorded here, in this temp folder
            try:
                os.remove(name)
                removed += 1
            except OSError:
                pass
    try:
        os.remove(path)
    except OSError:
        pass
    return removed


def release_owned(tmp: str | None = None) -> int:
    """Remove the files this process recorded (a normal exit). Returns how many were removed."""
    tmp = tmp or tempfile.gettempdir()
    path = os.path.join(tmp, f"{OWNED}{os.getpid()}.json")
    return _remove_owned(path, tmp) if os.path.exists(path) else 0


def remove_stale_files(tmp: str | None = None) -> int:
    """Remove the recorded files of processes that no longer exist. Returns how many were removed."""
    tmp = tmp or tempfile.gettempdir()
    removed = 0
    for path in glob.glob(os.path.join(tmp, f"{OWNED}*.json")):
        try:
            pid = int(os.path.basename(path)[len(OWNED):-len(".json")])
        except ValueError:
            continue
        if pid != os.getpid() and not alive(pid):
            removed += _remove_owned(path, tmp)
    return removed


def orphaned_processes(proc: str = "/proc") -> list[int]:
    """Processes of this user marked by a chatlearn driver that no longer exists."""
    me, uid, found = os.getpid(), os.getuid(), []
    for entry in os.listdir(proc) if os.path.isdir(proc) else []:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if os.stat(os.path.join(proc, entry)).st_uid != uid:
                continue
            with open(os.path.join(proc, entry, "cmdline"), "rb") as f:
                cmdline = f.read()
            # only Ray's and vLLM's processes: a process's environ is the one it started with,
            # so a driver started from a marked process carries that mark too
            if not any(tag in cmdline for tag in RAY_TAGS):
                continue
            with open(os.path.join(proc, entry, "environ"), "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        mark = next((v for v in env if v.startswith(DRIVER_ENV.encode() + b"=")), None)
        if mark is None:
            continue
        try:
            driver = int(mark.split(b"=", 1)[1])
        except ValueError:
            continue
        if driver != me and not alive(driver):
            found.append(int(entry))
    return found


def stop(pids: list[int], grace_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL what is still there after ``grace_s``."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in pids:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def mark_driver() -> None:
    """Mark the processes this driver starts from now on (call before ``ray.init``)."""
    os.environ[DRIVER_ENV] = str(os.getpid())


def clean_leftovers(log=info) -> None:
    """At a start: stop orphaned Ray processes of dead chatlearn drivers and remove stale temp files."""
    pids = orphaned_processes()
    if pids:
        log(f"stopping {len(pids)} process(es) left by an earlier run whose driver no longer "
            f"exists: {', '.join(map(str, pids))}")
        stop(pids)
    removed = remove_stale_files()
    if removed:
        log(f"removed {removed} temporary file(s) left by earlier runs in {tempfile.gettempdir()}")
