"""The start-up clock: consecutive phases from the process's start, the models' own times, its
metrics and console line."""
from __future__ import annotations

import time

import pytest

from chatlearn.logging import startup
from chatlearn.logging.startup import StartupClock, process_start_time


def test_phases_are_consecutive_from_the_origin(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    clock = StartupClock(origin=90.0)
    for phase, t in (("imports", 101.5), ("config", 102.0), ("ray", 104.0), ("models", 110.0), ("ray", 111.0)):
        now[0] = t
        clock.mark(phase)
    assert clock.phases == pytest.approx({"imports": 11.5, "config": 0.5, "ray": 3.0, "models": 6.0})
    clock.add_model("policy_trainer", [{"process": 4.0, "build": 1.0}, {"process": 5.0, "build": 0.5}])
    clock.add_model("policy", [{"process": 3.0, "build": None}])
    m = clock.metrics()
    assert m["perf/startup/total_s"] == pytest.approx(21.0) == pytest.approx(sum(clock.phases.values()))
    assert m["perf/startup/policy_trainer/process_s"] == 5.0 and m["perf/startup/policy_trainer/build_s"] == 1.0
    assert "perf/startup/policy/build_s" not in m and m["perf/startup/policy/process_s"] == 3.0
    line = clock.line()
    assert line.startswith("start-up to the end of the first episode 21.0s: imports 11.5s | config 0.5s")
    assert "policy_trainer: process 5.0s, build 1.0s" in line and line.index("ray") < line.index("models")


def test_the_clock_starts_with_the_process():
    assert 0 <= time.time() - process_start_time() < 24 * 3600
    clock = startup.reset()
    assert clock is startup.clock() and clock.origin == pytest.approx(process_start_time())
    assert clock.mark("imports") >= 0
