"""Where a run's start-up goes: consecutive wall-clock phases from the start of the driver's process
to the end of the first episode, and what each model's processes spent starting.

The driver marks the end of each phase (:meth:`StartupClock.mark`); a phase lasts from the previous
mark (the first from the process's start, as the OS records it). The phases of ``chatlearn run``:

- ``imports``: the interpreter and chatlearn's own imports, up to the command line parsed
- ``config``: the config loaded and validated
- ``data``: the output folder checked, the tokenizer and the prompts loaded
- ``ray``: Ray started (or joined) and the devices reserved
- ``models``: every model built, one after another (their processes start together at the beginning)
- ``resume``: a resumed run's checkpoint loaded
- ``eval_before``: the evaluation before training (``runtime_args.enable_eval_before_training``)
- ``first_episode``: the first episode of this process (its stages are in ``time/*``)

Each model's processes report their own times (:meth:`Worker.startup_times
<chatlearn.runtime.cluster.worker.Worker.startup_times>`): ``process`` is the interpreter and the
imports of the process (from its start to ready for ``setup``; ``ray_worker`` its part before the
actor existed: Ray's worker starting and connecting), ``build`` the backend built (weights
loaded, engine set up); the longest of a model's processes counts. Both are ``perf/startup/*``
metrics of the first episode's row (docs/metrics.md) and one console line.
"""
from __future__ import annotations

import os
import time

PHASES = ("imports", "config", "data", "ray", "models", "resume", "eval_before", "first_episode")


def process_start_time(pid: int | None = None) -> float:
    """The process's start on the wall clock (seconds since the epoch), as the OS records it."""
    try:
        import psutil

        return psutil.Process(pid or os.getpid()).create_time()
    except Exception:  # noqa: BLE001 - no psutil or no /proc: the clock starts at the first mark
        return time.time()


class StartupClock:
    """Consecutive phases on the wall clock, from ``origin`` (default: this process's start)."""

    def __init__(self, origin: float | None = None):
        self.origin = process_start_time() if origin is None else origin
        self._last = self.origin
        self.phases: dict[str, float] = {}
        self.models: dict[str, dict[str, float]] = {}

    def mark(self, phase: str) -> float:
        """End ``phase`` now (it began at the previous mark); its seconds. A phase marked twice adds up."""
        now = time.time()
        seconds = max(0.0, now - self._last)
        self._last = now
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        return seconds

    def add_model(self, name: str, times: list[dict]) -> None:
        """A model's processes' own :meth:`Worker.startup_times`: the longest ``process``, ``ray_worker``
        and ``build``."""
        out: dict[str, float] = {}
        for key in ("process", "ray_worker", "build"):
            values = [t[key] for t in times if t.get(key) is not None]
            if values:
                out[key] = max(values)
        self.models[name] = out

    def since_start(self) -> float:
        return max(0.0, time.time() - self.origin)

    def metrics(self) -> dict[str, float]:
        """``perf/startup/<phase>_s``, ``perf/startup/total_s`` (process start to the last mark) and
        ``perf/startup/<model>/<process|ray_worker|build>_s``."""
        out = {f"perf/startup/{p}_s": round(s, 4) for p, s in self.phases.items()}
        out["perf/startup/total_s"] = round(max(0.0, self._last - self.origin), 4)
        for name, times in self.models.items():
            for key, s in times.items():
                out[f"perf/startup/{name}/{key}_s"] = round(s, 4)
        return out

    def line(self) -> str:
        """One console line: ``start-up 21.3s: imports 1.4s | ... | models 12.0s (policy_trainer 11.8s: ...)``."""
        parts = []
        for phase in PHASES:
            if phase not in self.phases:
                continue
            text = f"{phase.replace('_', ' ')} {self.phases[phase]:.1f}s"
            if phase == "models" and self.models:
                text += " (" + ", ".join(
                    f"{n}: process {t['process']:.1f}s, build {t['build']:.1f}s" if "process" in t and "build" in t
                    else n for n, t in self.models.items()) + ")"
            parts.append(text)
        return f"start-up to the end of the first episode {max(0.0, self._last - self.origin):.1f}s: " + " | ".join(parts)


# the driver's clock: created when chatlearn.cli starts (or by the first use in a program of its own)
_CLOCK: StartupClock | None = None


def clock() -> StartupClock:
    global _CLOCK
    if _CLOCK is None:
        _CLOCK = StartupClock()
    return _CLOCK


def reset(origin: float | None = None) -> StartupClock:
    """A new clock (a second run in the same process, tests)."""
    global _CLOCK
    _CLOCK = StartupClock(origin)
    return _CLOCK
