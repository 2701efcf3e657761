"""The watchdog's arithmetic, from ``runtime_args.stage_timeout_s`` (the floor; 0: no watchdog).

A stage's deadline is the floor or ``STAGE_FACTOR`` times the longest that stage of that model has
taken so far in the run, whichever is longer (a model's first build: ``BUILD_FACTOR`` times the
floor). Past its deadline, a stage whose workers all answer their heartbeats may run on to
``CAP_FACTOR`` times its deadline; a worker silent for :func:`silent_after` seconds stops the run at
once. The trainers' process groups time a collective out after :func:`collective_timeout_s`.
Shared by the driver's watchdog (``chatlearn.runtime.cluster.watchdog``) and the backends' specs.
"""
from __future__ import annotations

STAGE_FACTOR = 5.0
BUILD_FACTOR = 2.0
CAP_FACTOR = 4.0


def deadline_s(floor: float, longest: float | None, build: bool = False) -> float:
    """Seconds a stage may take before its workers' heartbeats are read."""
    if build:
        return BUILD_FACTOR * floor
    return max(floor, STAGE_FACTOR * longest) if longest is not None else floor


def silent_after(floor: float) -> float:
    """Seconds without a heartbeat after which a worker of an overdue stage counts as stopped."""
    return min(60.0, max(10.0, floor / 4))


def collective_timeout_s(floor: float) -> float | None:
    """The torch.distributed timeout of the trainers' process groups; None: torch's default."""
    return CAP_FACTOR * floor if floor > 0 else None
