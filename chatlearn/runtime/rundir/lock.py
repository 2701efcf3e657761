"""One run per output folder: ``<output_dir>/run.lock`` for the run's lifetime.

The lock file is created with ``O_CREAT | O_EXCL`` (atomic: of two runs starting at once, exactly
one creates it) and holds, as JSON, who owns it: process id, host, start time, command line. A
second run into the same folder is refused with a message naming the first. A lock left by a run
that no longer exists on this host (its process is gone, or its process id now belongs to another
process) is stale: it is taken over with a warning. A lock from another host cannot be checked
from here and is never taken over; the message says how to remove it once that run is known to
have stopped. The lock is released (the file removed, if it is still this run's) on a normal exit,
on an error and on Ctrl-C.
"""
from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
import uuid

from chatlearn.config.secrets import redact_argument
from chatlearn.errors import UserError
from chatlearn.logging.console import warn

LOCK_NAME = "run.lock"
# an empty or unreadable lock younger than this is being written by the run that created it
_WRITE_GRACE_S = 5.0


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, from /proc), to tell a reused process id."""
    fields = _proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None


def pid_alive(pid: int, started: str | None = None) -> bool:
    """Whether process ``pid`` on this host still runs (and, when ``started`` is known, is the
    same process that wrote the lock, not a later one given the same id)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    fields = _proc_stat(pid)
    if fields is None:
        return True
    if fields[0] in ("Z", "X"):  # exited, not yet reaped by its parent
        return False
    return started is None or len(fields) <= 19 or fields[19] == started


def describe(holder: dict) -> str:
    if holder["pid"] == 0:
        return "another run that is starting right now"
    return (f"process {holder['pid']} on host {holder['host']}, started {holder['started']}"
            + (f" ({holder['command']})" if holder['command'] else ""))


class RunLock:
    """``with RunLock(output_dir):`` holds ``<output_dir>/run.lock`` (the folder is created)."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.token: str | None = None

    # ------------------------------------------------------------------ reading
    def read(self) -> tuple[dict | None, bytes | None]:
        """(owner, raw bytes) of the lock file; owner None when it is empty or not a lock
        written by chatlearn; (None, None) when there is no lock file."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None, None
        except OSError as err:
            raise UserError(f"cannot read the lock file {self.path!r}: {err}. Fix its permissions.")
        try:
            holder = json.loads(raw.decode("utf-8"))
        except ValueError:
            return None, raw
        keys = ("pid", "host", "started", "command", "token")
        if not isinstance(holder, dict) or any(k not in holder for k in keys) or not isinstance(holder["pid"], int):
            return None, raw
        if "pid_start" not in holder:
            holder["pid_start"] = None
        return holder, raw

    def live_holder(self) -> dict | None:
        """The owner of the lock when it is held by a run that is (or may be) still running."""
        holder, raw = self.read()
        if holder is None:
            if raw is None:
                return None
            return None if self._age() >= _WRITE_GRACE_S else {"pid": 0, "host": "?", "started": "just now",
                                                               "command": "", "token": "", "pid_start": None}
        if holder["host"] == socket.gethostname() and not pid_alive(holder["pid"], holder["pid_start"]):
            return None
        return holder

    def _age(self) -> float:
        try:
            return time.time() - os.stat(self.path).st_mtime
        except OSError:
            return 0.0

    def refusal(self, holder: dict) -> UserError:
        who = describe(holder)
        other_host = holder["host"] not in ("?", socket.gethostname())
        hint = (f" That host cannot be checked from here: if that run has stopped, delete {self.path!r} and run "
                "again." if other_host else "")
        return UserError(f"runtime_args.output_dir {self.output_dir!r} is in use by {who}: two runs writing "
                         f"one folder would corrupt each other's checkpoints and metrics. Wait for that run to "
                         f"finish or stop it, or choose another runtime_args.output_dir.{hint}")

    # ------------------------------------------------------------------ taking and giving back
    def acquire(self) -> None:
        try:
            os.makedirs(self.output_dir, exist_ok=True)
        except OSError as err:
            raise UserError(f"cannot create runtime_args.output_dir {self.output_dir!r}: {err}. Fix the path or "
                            "its permissions.")
        token = uuid.uuid4().hex
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "pid_start": process_start(os.getpid()),
              "command": " ".join(shlex.quote(redact_argument(a)) for a in sys.argv), "token": token}
        data = (json.dumps(me, indent=1) + "\n").encode("utf-8")
        for _ in range(100):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._handle_existing()
                continue
            except OSError as err:
                raise UserError(f"cannot create the lock file {self.path!r}: {err}. Fix the permissions of "
                                "runtime_args.output_dir.")
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            self.token = token
            return
        raise UserError(f"cannot take the lock {self.path!r}: other runs keep creating it. Make sure only one "
                        "run uses this runtime_args.output_dir.")

    def _handle_existing(self) -> None:
        """The lock exists: refuse when its run lives; take a stale one over (returns to retry)."""
        holder, raw = self.read()
        if raw is None:
            return  # removed meanwhile: try again
        if holder is None:
            if self._age() < _WRITE_GRACE_S:
                time.sleep(0.1)  # being written by the run that has just created it: read it again
                return
            reason = "is empty or damaged (left by a run that stopped while taking it)"
        elif holder["host"] != socket.gethostname() or pid_alive(holder["pid"], holder["pid_start"]):
            raise self.refusal(holder)
        else:
            reason = f"was left by {describe(holder)}, which is no longer running"
        # take the stale lock over: move it aside, and check that what was moved is what was judged stale
        aside = f"{self.path}.stale-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        with open(aside, "rb") as f:
            moved = f.read()
        if moved != raw:  # another run replaced it in the meantime: put theirs back
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            os.unlink(aside)
            return
        os.unlink(aside)
        warn(f"taking over the lock {self.path}: it {reason}", stderr=True)

    def release(self) -> None:
        if self.token is None:
            return
        token, self.token = self.token, None
        holder, _ = self.read()
        if holder is None or holder["token"] != token:
            warn(f"the lock {self.path} is no longer this run's; leaving it", stderr=True)
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
