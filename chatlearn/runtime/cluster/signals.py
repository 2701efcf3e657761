"""SIGTERM and SIGHUP stop a run the way Ctrl-C does.

Schedulers (Slurm, Kubernetes, systemd) stop a job with SIGTERM, then SIGKILL after a grace
period. The driver turns SIGTERM into :class:`Terminated`, a ``KeyboardInterrupt``, so the same
path as Ctrl-C runs: the episode stops, workers are stopped, the lock is released, the last
complete checkpoint stays the one a rerun resumes from. The run exits with 143 (128 + SIGTERM);
Ctrl-C exits with 130. SIGHUP (the terminal the run was started from closed, an ssh session that
dropped) is handled alike and exits with 129 (128 + SIGHUP), where Python's default ended the
process at once, with no message and ``run.lock`` left behind.

``ray.init`` installs its own SIGTERM handler in the driver (it kills the local Ray processes and
calls ``sys.exit`` under running workers), so :func:`stop_on_sigterm` is called again after it.

A SIGTERM that arrives while the driver waits in ``ray.get`` runs the handler inside Ray's signal
check, and Ray replaces the exception the handler raised with a plain ``KeyboardInterrupt``. So the
handler also records which signal came, and :func:`exit_code` reads that record, not the type.
"""
from __future__ import annotations

import signal
import sys
import threading

SIGINT_EXIT = 130
SIGTERM_EXIT = 143
SIGHUP_EXIT = 129
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """The driver received SIGTERM or SIGHUP."""


_received = threading.Event()
_received_signal: list = []  # the stop signal that came first


def _raise_terminated(signum, frame):
    if signum == signal.SIGALRM:  # a redelivery (_redeliver): SIGALRM goes back to what it was
        signal.signal(signal.SIGALRM, _alarm_before.pop())
    elif not _received_signal:
        _received_signal.append(signum)
    _received.set()
    # later stop signals while stopping are ignored: the first one already unwinds the run
    for stop in STOP_SIGNALS:
        signal.signal(stop, signal.SIG_IGN)
    raise Terminated()


_alarm_before: list = []


def _redeliver(unraisable) -> None:
    """``sys.unraisablehook``: a SIGTERM that landed in a finaliser or a weakref callback (garbage
    collection runs them between any two bytecodes) raised :class:`Terminated` where Python drops
    exceptions, printing "Exception ignored". Deliver it again, to the code that was running: the
    run then stops as it would have (exit 143, no traceback) instead of going on with SIGTERM ignored.
    The redelivery is a SIGALRM 10 ms later (a signal raised now would be handled here, in the hook,
    and dropped again); should that one land in a finaliser too, it is delivered again the same way."""
    if isinstance(unraisable.exc_value, Terminated):
        _alarm_before.append(signal.signal(signal.SIGALRM, _raise_terminated))
        signal.setitimer(signal.ITIMER_REAL, 0.01)
        return
    _previous_unraisablehook(unraisable)


_previous_unraisablehook = sys.unraisablehook


def stop_on_sigterm() -> None:
    """Make SIGTERM and SIGHUP raise :class:`Terminated` in the main thread (a no-op in other threads),
    also when it lands in a finaliser (:func:`_redeliver`)."""
    if threading.current_thread() is threading.main_thread():
        for stop in STOP_SIGNALS:
            signal.signal(stop, _raise_terminated)
        sys.unraisablehook = _redeliver


def terminated() -> bool:
    """Whether this process received SIGTERM or SIGHUP (whatever exception it became on the way up)."""
    return _received.is_set()


def exit_code() -> int:
    """The exit code of a run stopped by a ``KeyboardInterrupt``: 143 after SIGTERM, 129 after SIGHUP,
    else 130."""
    if not terminated():
        return SIGINT_EXIT
    return SIGHUP_EXIT if _received_signal[:1] == [signal.SIGHUP] else SIGTERM_EXIT


def stop_message() -> str:
    """The console's last line for a run stopped by a ``KeyboardInterrupt``."""
    if not terminated():
        return "interrupted"
    if _received_signal[:1] == [signal.SIGHUP]:
        return "terminated (SIGHUP: the terminal or session that started the run closed)"
    return "terminated (SIGTERM)"
