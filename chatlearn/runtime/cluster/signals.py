"""SIGTERM stops a run the way Ctrl-C does.

Schedulers (Slurm, Kubernetes, systemd) stop a job with SIGTERM, then SIGKILL after a grace
period. The driver turns SIGTERM into :class:`Terminated`, a ``KeyboardInterrupt``, so the same
path as Ctrl-C runs: the episode stops, workers are stopped, the lock is released, the last
complete checkpoint stays the one a rerun resumes from. The run exits with 143 (128 + SIGTERM);
Ctrl-C exits with 130.

``ray.init`` installs its own SIGTERM handler in the driver (it kills the local Ray processes and
calls ``sys.exit`` under running workers), so :func:`stop_on_sigterm` is called again after it.

A SIGTERM that arrives while the driver waits in ``ray.get`` runs the handler inside Ray's signal
check, and Ray replaces the exception the handler raised with a plain ``KeyboardInterrupt``. So the
handler also records that SIGTERM came, and :func:`exit_code` reads that record, not the type.
"""
from __future__ import annotations

import signal
import threading

SIGINT_EXIT = 130
SIGTERM_EXIT = 143


class Terminated(KeyboardInterrupt):
    """The driver received SIGTERM."""


_received = threading.Event()


def _raise_terminated(signum, frame):
    _received.set()
    # later SIGTERMs while stopping are ignored: the first one already unwinds the run
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


def stop_on_sigterm() -> None:
    """Make SIGTERM raise :class:`Terminated` in the main thread (a no-op in other threads)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


def terminated() -> bool:
    """Whether this process received SIGTERM (whatever exception it became on the way up)."""
    return _received.is_set()


def exit_code() -> int:
    """The exit code of a run stopped by a ``KeyboardInterrupt``: 143 after SIGTERM, else 130."""
    return SIGTERM_EXIT if terminated() else SIGINT_EXIT
