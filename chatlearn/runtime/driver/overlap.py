"""Asynchronous rollouts (``runtime_args.max_staleness`` = k > 0): the rollout engine generates, and
the reward workers score, the next k episodes while the trainer trains the current one.

Versions count the weight pushes: the rollout engine holds version v after v pushes (0: the initial
weights), and the trainer is at version n - 1 when it trains episode n. With k, the rollout of
episode m is launched when episode m - k begins (episodes 1..k+1 at the start), after the push of
version m - k - 1, so it is k versions behind the trainer that trains on it (fewer for the first k
episodes). Every sample carries the version that generated it (``policy_version``); ``take`` refuses
a batch older than k versions (:func:`staleness`).

The rollouts run on one worker thread, in the order they were launched, with the prompts the driver
drew for them in episode order and the seed of their episode: the same generation calls as the
on-policy run, with older weights. A push waits for the generation in flight (``drain``), so the
rollout engine never changes weights during a generate call; the next rollout is launched when the
next episode begins. A checkpoint keeps the finished rollouts of the episodes after it
(``save`` of the pipeline), so a resumed run trains on the very samples the uninterrupted one did.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from chatlearn.batch import check
from chatlearn.errors import UserError
from chatlearn.runtime.driver.sampling import Prompts, Scored

FILE = "rollouts_ahead.npz"  # arrays only: read back without pickle


@dataclass
class ReadyEpisode:
    """One episode's generated and scored samples and the weight version that generated them."""

    episode: int
    version: int
    prompts: Prompts
    batch: dict
    scored: Scored
    seconds: dict = field(default_factory=dict)  # time/generate, time/reward; start and end on the driver's clock


def staleness(versions: np.ndarray, trainer_version: int) -> np.ndarray:
    """Versions between the weights that generated each sample and the trainer's (>= 0)."""
    return trainer_version - np.asarray(versions, dtype=np.int64)


class StaleSamples(RuntimeError):
    """A batch older than ``max_staleness`` versions reached the trainer (a scheduling bug)."""


class RolloutPipeline:
    """Launches and hands out the rollouts of ``max_staleness`` episodes ahead (see the module docstring).

    ``draw(episode)`` (driver thread, launch order) returns the episode's prompts; ``produce(episode,
    prompts)`` (the rollout thread) returns ``(batch, scored, seconds)``; ``prompts_of(indices)`` gives
    the prompts of those rows of the prompt set again (a checkpoint keeps the rows, not the prompts)."""

    def __init__(self, max_staleness: int, draw: Callable, produce: Callable, prompts_of: Callable):
        self.k = max_staleness
        self.draw, self.produce, self.prompts_of = draw, produce, prompts_of
        self.version = 0  # the rollout engine's weights: pushes done
        self.pending: dict[int, Future] = {}  # episode -> its rollout, in launch order
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")

    def fill(self, episode: int, last: int) -> None:
        """Launch the rollouts of episodes ``episode .. episode + k`` (at most ``last``) not launched yet."""
        for m in range(episode, min(episode + self.k, last) + 1):
            if m not in self.pending:
                self.pending[m] = self.pool.submit(self._run, m, self.version, self.draw(m))

    def _run(self, episode: int, version: int, prompts) -> ReadyEpisode:
        start = time.perf_counter()
        batch, scored, seconds = self.produce(episode, prompts)
        n = len(batch["prompt_lens"])
        batch["policy_version"] = np.full(n, version, dtype=np.int64)
        seconds = {**seconds, "start": start, "end": time.perf_counter()}
        return ReadyEpisode(episode, version, prompts, batch, scored, seconds)

    def take(self, episode: int, trainer_version: int) -> tuple[ReadyEpisode, dict]:
        """Episode ``episode``'s rollout (waiting for it), and its ``train/staleness_*`` and overlap
        metrics; StaleSamples if any of its samples is more than ``max_staleness`` versions old."""
        waited = time.perf_counter()
        rollout = self.pending.pop(episode).result()
        waited = time.perf_counter() - waited
        lag = staleness(rollout.batch["policy_version"], trainer_version)
        if lag.size and (lag.max() > self.k or lag.min() < 0):
            versions = sorted(set(rollout.batch["policy_version"].tolist()))
            raise StaleSamples(f"episode {episode}: samples of policy versions {versions} reached the trainer at "
                               f"version {trainer_version} (runtime_args.max_staleness: {self.k})")
        timed = {k: v for k, v in rollout.seconds.items() if k.startswith("time/")}  # none after a resume
        busy = sum(timed.values())
        metrics = {"train/staleness_mean": float(lag.mean()) if lag.size else 0.0,
                   "train/staleness_max": float(lag.max()) if lag.size else 0.0,
                   "train/policy_version": float(rollout.version),
                   "time/rollout_wait": waited,
                   "time/overlapped": max(0.0, busy - waited)}
        metrics.update(timed)
        return rollout, metrics

    def drain(self) -> None:
        """Wait for every rollout in flight (before a push, a checkpoint or an error's way out)."""
        for f in list(self.pending.values()):
            f.result()

    def pushed(self, version: int | None = None) -> None:
        """The rollout engine received new weights (``version``: set, on resume)."""
        self.version = self.version + 1 if version is None else version

    def save(self, folder: str) -> None:
        """Keep the finished rollouts of the episodes after the checkpoint (waits for those in flight)."""
        self.drain()
        ahead = [self.pending[m].result() for m in sorted(self.pending)]
        arrays = {"max_staleness": np.int64(self.k), "count": np.int64(len(ahead))}
        for j, r in enumerate(ahead):
            rewards, parts, shaped = r.scored.rewards, r.scored.parts, r.scored.shaped
            arrays.update({f"{j}/episode": np.int64(r.episode), f"{j}/version": np.int64(r.version),
                           f"{j}/indices": np.asarray(r.prompts.indices, dtype=np.int64),
                           f"{j}/rewards": np.asarray(rewards), f"{j}/shaped": np.asarray(shaped),
                           f"{j}/parts": np.asarray(list(parts), dtype=str)})
            arrays.update({f"{j}/part/{i}": np.asarray(v) for i, v in enumerate(parts.values())})
            arrays.update({f"{j}/batch/{k}": np.asarray(v) for k, v in r.batch.items()})
        for name, value in arrays.items():
            if value.dtype == object:
                raise TypeError(f"rollouts ahead: {name} is not an array of numbers or strings")
        np.savez(os.path.join(folder, FILE), **arrays)

    def load(self, folder: str) -> None:
        """Restore the rollouts a checkpoint kept (none if it has no file) as finished ones."""
        self.pending = {}
        for episode, version, indices, batch, scored in kept_rollouts(folder, self.k):
            done: Future = Future()
            done.set_result(ReadyEpisode(episode, version, self.prompts_of(indices), batch, scored))
            self.pending[episode] = done

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def kept_rollouts(folder: str, max_staleness: int) -> list[tuple]:
    """The rollouts ahead that the checkpoint in ``folder`` kept (none without the file); a UserError
    when it kept some and was written with another ``max_staleness``: the data position it saved is
    past their prompts and their versions fit its bound, so another value would skip them or train
    on samples older than it allows."""
    path = os.path.join(folder, FILE)
    if not os.path.exists(path):
        return []
    with np.load(path, allow_pickle=False) as data:
        saved_k, count = int(data["max_staleness"]), int(data["count"])
        kept = []
        for j in range(count):
            names = [str(n) for n in data[f"{j}/parts"]]
            parts = {n: data[f"{j}/part/{i}"] for i, n in enumerate(names)}
            batch = {name.split("/", 2)[2]: data[name] for name in data.files if name.startswith(f"{j}/batch/")}
            check(batch)  # the columns it declares (chatlearn.batch)
            kept.append((int(data[f"{j}/episode"]), int(data[f"{j}/version"]), data[f"{j}/indices"].tolist(), batch,
                         Scored(data[f"{j}/rewards"], parts, data[f"{j}/shaped"])))
    if kept and saved_k != max_staleness:
        raise UserError(
            f"the checkpoint {folder!r} was written with runtime_args.max_staleness={saved_k} and "
            f"keeps the rollouts of episode(s) {', '.join(str(r[0]) for r in kept)}, generated ahead; "
            f"this run sets max_staleness={max_staleness}. Resume with "
            f"runtime_args.max_staleness={saved_k}, or start over (--no-resume).")
    return kept
