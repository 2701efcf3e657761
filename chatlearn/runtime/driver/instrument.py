"""What an episode measures, kept out of the episode's code: stage times (``time/<stage>``), the
turns on shared devices inside them (``time/transitions``, ``sched/*``), the progress label, the
share of the episode that is model compute (``time/model_compute``, ``perf/overhead_share``) and
the tokens per second of generation and training (``perf/*_tokens_per_s``).

The engine wraps each stage in ``run.stage(Stage.X, model)`` (or runs it on a worker thread with
``run.background``) and hands the episode's metrics to ``run.finish``; nothing else in the episode
is about measurement.
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from chatlearn.config.names import Stage
from chatlearn.logging.perf import throughput
from chatlearn.logging.progress import RunProgress
from chatlearn.runtime.cluster.group import Activity
from chatlearn.runtime.driver.scheduler import Scheduler

# The calls that are model compute; everything else in an episode (turns, weight push, Ray
# dispatch and transfers, the driver's own work) is overhead.
COMPUTE_METHODS = {"generate", "score", "score_one", "compute_logprobs", "train"}


def overhead(busy: float, episode: float) -> dict:
    """``time/model_compute``: seconds of the episode during which at least one model computed
    (overlapping calls counted once); ``perf/overhead_share``: the rest over the episode time."""
    return {"time/model_compute": busy,
            "perf/overhead_share": max(0.0, episode - busy) / episode if episode > 0 else 0.0}


class StageTimer:
    """Times stages (``time/<stage>``) and the turns inside them (``time/transitions``); each stage has
    a deadline (the scheduler's watchdog, ``runtime_args.stage_timeout_s``)."""

    def __init__(self, sched: Scheduler, progress: RunProgress | None = None):
        self.sched, self.progress = sched, progress
        self._totals: dict[str, float] = collections.defaultdict(float)
        self._lock = threading.Lock()
        self._mark = len(sched.timeline.events)

    @contextlib.contextmanager
    def stage(self, stage: Stage, model: str):
        """The block is stage ``stage`` of ``model``: labelled on the progress display, timed."""
        if self.progress is not None:
            self.progress.stage(stage)
        start = time.perf_counter()
        with self.sched.watchdog.watch(model, stage):
            try:
                yield
            finally:
                self._add(model, stage, time.perf_counter() - start)

    def timed(self, model: str, stage: Stage, fn, *args):
        """``fn(*args)`` timed as a stage, for stages run on a worker thread (no progress label)."""
        start = time.perf_counter()
        with self.sched.watchdog.watch(model, stage):
            try:
                return fn(*args)
            finally:
                self._add(model, stage, time.perf_counter() - start)

    def _add(self, model: str, stage: Stage, seconds: float) -> None:
        with self._lock:
            self._totals[f"time/{stage}"] += seconds
        self.sched.stage(model, stage, seconds)

    def totals(self) -> dict:
        events = [e for e in self.sched.timeline.events[self._mark:] if e["kind"] == "transition"]
        out = dict(self._totals)
        out["time/transitions"] = sum(e["seconds"] for e in events)
        out["sched/transitions"] = len(events)
        out["sched/bytes_moved"] = sum(e["bytes"] for e in events)
        return out


class EpisodeRun(StageTimer):
    """The measurements of one episode (see the module docstring); made by :meth:`Instrument.begin`."""

    def __init__(self, sched: Scheduler, progress: RunProgress, activity: Activity, epochs: int):
        super().__init__(sched, progress)
        self.activity, self.epochs = activity, epochs
        self.start = time.perf_counter()

    def background(self, pool: ThreadPoolExecutor, stage: Stage, model: str, fn, *args) -> Future:
        """Run ``fn(*args)`` on ``pool`` as stage ``stage`` of ``model``; the progress label moves on
        to the stages it overlaps."""
        self.progress.stage(stage)
        return pool.submit(self.timed, model, stage, fn, *args)

    def finish(self, metrics: dict, batch: dict, generated: int | None = None) -> dict:
        """``metrics`` with the episode's stage times, turns, throughput and overhead added
        (``generated``: the response tokens sampled, when more than the batch's)."""
        metrics.update(self.totals())
        metrics.update(throughput(batch, metrics, self.epochs, generated))
        end = time.perf_counter()
        metrics["time/episode"] = end - self.start
        metrics.update(overhead(self.activity.busy(COMPUTE_METHODS, self.start, end), end - self.start))
        return metrics


class Instrument:
    """Makes an :class:`EpisodeRun` per episode for the models of ``sched`` (their calls' busy time is
    recorded from now on)."""

    def __init__(self, sched: Scheduler, progress: RunProgress, epochs: int):
        self.sched, self.progress, self.epochs = sched, progress, epochs
        self.activity = Activity()
        for group in sched.groups.values():
            group.activity = self.activity

    def begin(self, episode: int) -> EpisodeRun:
        """Episode ``episode`` starts: the timeline, the busy-time record and the progress display
        move on to it."""
        self.sched.timeline.begin(episode)
        self.activity.clear()
        self.progress.begin(episode)
        return EpisodeRun(self.sched, self.progress, self.activity, self.epochs)

    def stage(self, stage: Stage, model: str, seconds: float) -> None:
        """A stage timed outside an episode (evaluation)."""
        self.sched.stage(model, stage, seconds)
