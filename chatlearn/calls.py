"""Waiting on the calls of workers of either kind: Ray's actors (object refs) and the workers of a run
without Ray (``concurrent.futures.Future``, chatlearn/runtime/cluster/local.py). ``get``, ``wait`` and
``put`` are Ray's three, taking both."""
from __future__ import annotations

import sys
import time
from concurrent import futures


def _is_local(ref) -> bool:
    return isinstance(ref, futures.Future)


def get(refs, timeout: float | None = None):
    """``ray.get`` of Ray's object refs, or the results of local futures (a list, or one); a failed call
    raises its error here."""
    if isinstance(refs, list) and not refs:
        return []
    if isinstance(refs, list) and _is_local(refs[0]):
        deadline = None if timeout is None else time.monotonic() + timeout
        return [r.result(None if deadline is None else max(0.0, deadline - time.monotonic())) for r in refs]
    if _is_local(refs):
        return refs.result(timeout)
    import ray

    return ray.get(refs, timeout=timeout)


def wait(refs: list, num_returns: int = 1, timeout: float | None = None) -> tuple[list, list]:
    """``ray.wait``: (ready, pending), each in the order of ``refs``."""
    if not (refs and _is_local(refs[0])):
        import ray

        return ray.wait(refs, num_returns=num_returns, timeout=timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done = [r for r in refs if r.done()]
        left = None if deadline is None else deadline - time.monotonic()
        if len(done) >= num_returns or (left is not None and left <= 0):
            break
        futures.wait([r for r in refs if not r.done()], timeout=left, return_when=futures.FIRST_COMPLETED)
    ready = done[:num_returns]
    return ready, [r for r in refs if r not in ready]


def put(value):
    """``ray.put`` while Ray runs in this process; the value itself otherwise (a call hands it over)."""
    ray = sys.modules.get("ray")
    return ray.put(value) if ray is not None and ray.is_initialized() else value
