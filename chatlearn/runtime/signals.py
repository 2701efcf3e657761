"""SIGTERM stops a run the way Ctrl-C does.

Schedulers (Slurm, Kubernetes, systemd) stop a job with SIGTERM, then SIGKILL after a grace
period. The driver turns SIGTERM into :class:`Terminated`, a ``KeyboardInterrupt``, so the same
path as Ctrl-C runs: the episode stops, workers are stopped, the lock is released, the last
complete checkpoint stays the one a rerun resumes from. The run exits with 143 (128 + SIGTERM);
Ctrl-C exits with 130.

``ray.init`` installs its own SIGTERM handler in the driver (it kills the local Ray processes and
calls ``sys.exit`` under running workers), so :func:`stop_on_sigterm` is called again after it.
"""
from __future__ import annotations

import signal
import threading

SIGINT_EXIT = 130
SIGTERM_EXIT = 143


class Terminated(KeyboardInterrupt):
    """The driver received SIGTERM."""

    exit_code = SIGTERM_EXIT


def _raise_terminated(signum, frame):
    # later SIGTERMs while stopping are ignored: the first one already unwinds the run
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


def stop_on_sigterm() -> None:
    """Make SIGTERM raise :class:`Terminated` in the main thread (a no-op in other threads)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


def exit_code(err: KeyboardInterrupt) -> int:
    return getattr(err, "exit_code", SIGINT_EXIT)
