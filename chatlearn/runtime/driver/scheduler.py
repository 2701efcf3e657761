"""Residency: which parts of which model are on each device group, and the turns between them.

Models in one device group take turns. ``ensure(model, parts)`` offloads the parts of the other
models of that group that are resident (those their ``free_gpu_memory`` flags allow to move) and
onloads the parts ``model`` needs that are not resident. Nothing moves when nothing has to: a
model that is already resident stays so. Every move and every stage call is recorded in the
timeline (``<output_dir>/timeline.jsonl``) with its model, parts, bytes and seconds.

The invariant, checked after every move: on one device group, parts of two models are never
resident at the same time, except the trainer's weights next to the rollout engine's weights
during a weight push (never optimizer state, gradients or KV cache alongside). Parts that the
config pins (``free_gpu_memory`` flags off) are exempt, and the run says so when it starts.
"""
from __future__ import annotations

import json
import threading
import time
from typing import Callable, Iterable

from chatlearn.calls import get
from chatlearn.config.kinds import ROLLOUT, TRAINER
from chatlearn.config.names import Part
from chatlearn.config.plan import Plan
from chatlearn.logging.console import info, warn
from chatlearn.logging.gpu_memory import summarize
from chatlearn.logging.jsonl import RowFile
from chatlearn.runtime.cluster.group import WorkerGroup
from chatlearn.runtime.cluster.watchdog import Watchdog


def movable_parts(parts: Iterable[Part], free_gpu_memory) -> set[Part]:
    """Of a model's ``parts`` (its kind's), those the config allows to leave the device (the KV cache can
    always be dropped)."""
    flags = {Part.WEIGHTS: free_gpu_memory.offload_weights,
             Part.OPTIMIZER: free_gpu_memory.offload_optimizer_states,
             Part.GRADS: free_gpu_memory.free_grad_buffers,
             Part.KV_CACHE: True}
    return {p for p in parts if flags[p]}


# Parts of two models may be resident together on one device group only during a weight
# push: the trainer's weights next to the rollout engine's (never optimizer state or KV cache).
PUSH_PAIR = {TRAINER.default_model: {Part.WEIGHTS}, ROLLOUT.default_model: {Part.WEIGHTS}}


def residency_violations(device_groups: list[list[str]], resident: dict,
                         pinned: dict[str, set[str]] | None = None) -> list[str]:
    """Device groups where parts of two models are resident at once, beyond ``PUSH_PAIR``.

    ``resident``: model -> resident parts. ``pinned``: parts the config keeps on the device
    (``free_gpu_memory`` flags off); they are left out of the check.
    """
    pinned = pinned or {}
    problems = []
    for group in device_groups:
        held = {m: set(resident[m] if m in resident else ()) - set(pinned[m] if m in pinned else ()) for m in group}
        held = {m: p for m, p in held.items() if p}
        if len(held) > 1 and held != PUSH_PAIR:
            problems.append(", ".join(f"{m}: {sorted(p)}" for m, p in sorted(held.items())))
    return problems


class Timeline:
    """Append-only record of transitions and stage calls."""

    def __init__(self, path: str | None):
        self.events: list[dict] = []
        # each event whole or not at all; not fsynced (many per episode): see chatlearn.logging.jsonl.RowFile
        self._file = RowFile(path, fsync=False) if path else None
        self.episode = 0

    def begin(self, episode: int) -> None:
        """Events from now on belong to ``episode``; in memory only this episode's are kept
        (the file has them all)."""
        self.episode = episode
        self.events.clear()

    def record(self, **event) -> None:
        event = {"episode": self.episode, **event}
        self.events.append(event)
        if self._file:
            self._file.write(json.dumps(event) + "\n")

    def close(self) -> None:
        if self._file:
            self._file.close()


class Scheduler:
    """Owns the models' residency: which of their parts are on the devices, and every move.

    Models are registered with :meth:`add` (which makes room on their devices first, builds them and
    records them as resident); from then on residency changes only through :meth:`ensure`. The
    engine never touches ``resident`` or calls a model's ``offload``/``onload`` itself.
    """

    def __init__(self, plan: Plan, timeline: Timeline, *, offload_without_gpu: bool, watchdog: Watchdog | None = None):
        self.plan, self.timeline = plan, timeline
        # the deadline of each build, stage and call (runtime_args.stage_timeout_s); 0 or None: none
        self.watchdog = watchdog or Watchdog(0)
        # Without a GPU the devices are logical and every part lives in host memory: moving a part
        # "to the host" frees nothing another model could use, so by default nothing moves there
        # (runtime_args.offload_without_gpu: move as on GPUs, to rehearse a GPU run's schedule).
        self.offload_without_gpu = offload_without_gpu
        self.on_gpu: bool | None = None  # known once the first model with device parts is built
        self.groups: dict[str, WorkerGroup] = {}  # read-only for others: registered through add()
        self.movable: dict[str, set[Part]] = {}
        self.resident: dict[str, set[Part]] = {}
        # models on disjoint devices may be driven from two threads at once (see the engine)
        self._lock = threading.RLock()
        # On GPUs (``track_gpu_memory``), every transition and stage also records the GPU memory of
        # the models on that device group (chatlearn.logging.gpu_memory), and the episode keeps
        # each model's largest numbers (``gpu_peaks``).
        self.track_gpu_memory = False
        self.gpu_peaks: dict[str, dict] = {}

    def add(self, name: str, build: Callable[[], WorkerGroup], movable: Iterable[str] = ()) -> WorkerGroup:
        """Register model ``name``: the models already on its devices leave them (their movable
        parts), ``build()`` creates its worker group, and all its parts are then resident.
        ``movable``: the parts its ``free_gpu_memory`` flags let leave the device (a model that
        holds no device part, such as the reward workers, has none). Returns the group."""
        with self._lock:
            self._vacate(name)
            with self.watchdog.watch(name, "build", build=True):
                group = build()
            group.watchdog = self.watchdog
            self.groups[name] = group
            parts = self.parts(name)
            if not parts:  # on CPUs only (the reward workers): nothing to move
                return group
            self.resident[name] = set(parts)
            if self.on_gpu is None:  # on GPUs, every turn records the devices' memory
                self.on_gpu = self.track_gpu_memory = bool(get(group.actors[0].device_memory.remote()))
                if not self.on_gpu and not self.offload_without_gpu and any(
                        self.plan.colocated_with(m) for m in self.plan.placements if self.parts(m)):
                    info("no GPU: colocated models keep their weights, optimizer state, gradients and KV cache "
                         "in memory during each other's turns (moving them to host memory would free nothing); "
                         "runtime_args.offload_without_gpu=true moves them as on GPUs")
            stays = not self.on_gpu and not self.offload_without_gpu
            self.movable[name] = set() if stays else {Part(p) for p in movable}
            pinned = [p for p in parts if p not in self.movable[name]]
            if self.plan.colocated_with(name) and pinned and not stays:
                warn(f"models.{name}.free_gpu_memory keeps its {', '.join(map(str, pinned))} on the devices it "
                     f"shares with {', '.join(self.plan.colocated_with(name))}: they stay resident during the "
                     "other models' turns (set the flags to true to free that memory)")
            return group

    def parts(self, name: str) -> tuple[Part, ...]:
        """What model ``name`` holds on its devices: its kind's parts (chatlearn/config/kinds.py)."""
        return self.plan.kind(name).parts

    def take_turn(self, name: str) -> None:
        """Make every part of model ``name`` resident (its turn: a forward pass, training, a checkpoint)."""
        self.ensure(name, self.parts(name))

    def _vacate(self, name: str) -> None:
        """Offload the movable parts of the registered models that share ``name``'s devices."""
        if name not in self.plan.placements:
            return
        for other in self.plan.colocated_with(name):
            if other in self.resident:
                self._offload(other, self.resident[other] & self.movable[other])

    def ensure(self, name: str, parts: Iterable[str], keep: dict[str, Iterable[str]] | None = None) -> None:
        """Make ``parts`` of ``name`` resident, first offloading what conflicts on its devices.

        ``keep`` names parts of other models that may stay resident alongside (a weight push
        keeps the trainer's weights next to the rollout engine's).
        """
        with self._lock:
            self._ensure(name, parts, keep)

    def _ensure(self, name: str, parts: Iterable[str], keep: dict[str, Iterable[str]] | None) -> None:
        keep = {k: set(v) for k, v in (keep or {}).items()}
        for other in self.plan.colocated_with(name):
            if other not in self.resident:
                continue
            out = (self.resident[other] & self.movable[other]) - (keep[other] if other in keep else set())
            self._offload(other, out)
        self._onload(name, set(parts) - self.resident[name])

    def _offload(self, name: str, parts: Iterable[str]) -> None:
        self._move(name, "offload", [p for p in self.parts(name) if p in set(parts) & self.resident[name]])

    def _onload(self, name: str, parts: Iterable[str]) -> None:
        self._move(name, "onload", [p for p in self.parts(name) if p in set(parts) - self.resident[name]])

    def _move(self, name: str, action: str, parts: list[str]) -> None:
        if not parts:
            return
        with self._lock, self.watchdog.watch(name, action, call=True):  # the move and its memory record
            self._locked_move(name, action, parts)

    def _locked_move(self, name: str, action: str, parts: list[str]) -> None:
        start = time.perf_counter()
        results, _ = self.groups[name].call(action, parts)
        seconds = time.perf_counter() - start
        moved = sum(int(r["bytes"]) for r in results if r)
        if action == "offload":
            self.resident[name] -= set(parts)
        else:
            self.resident[name] |= set(parts)
        pinned = {m: set(self.parts(m)) - (self.movable[m] if m in self.movable else set()) for m in self.resident}
        bad = residency_violations(self.plan.device_groups, self.resident, pinned)
        if bad:  # a scheduling bug, not a user error
            raise RuntimeError(f"residency invariant broken after {action} {name} {parts}: {bad}")
        self.timeline.record(kind="transition", model=name, action=action, parts=parts, bytes=moved,
                             seconds=round(seconds, 6), resident=self.snapshot(), **self._gpu_memory(name))

    def stage(self, name: str, stage: str, seconds: float) -> None:
        with self._lock, self.watchdog.watch(name, stage, call=True):  # GPU memory is read from the workers
            self.timeline.record(kind="stage", model=name, stage=stage, seconds=round(seconds, 6),
                                 resident=self.snapshot(), **self._gpu_memory(name))

    def _gpu_memory(self, name: str) -> dict:
        """``{"gpu_memory": {model: [per worker: per device {...}]}}`` for the models on ``name``'s
        device group, when GPU memory is tracked; else ``{}``."""
        if not self.track_gpu_memory or name not in self.plan.placements:
            return {}
        models = [m for m in self.plan.colocated_with(name) + [name] if m in self.groups]
        refs = {m: [a.device_memory.remote() for a in self.groups[m].actors] for m in models}
        found = {m: get(r) for m, r in refs.items()}
        for model, peaks in summarize(found).items():
            mine = self.gpu_peaks.setdefault(model, {})
            for key, value in peaks.items():
                mine[key] = max(mine[key], value) if key in mine else value
        return {"gpu_memory": found}

    def take_gpu_peaks(self) -> dict:
        """``memory/<model>_gpu_<key>`` of the largest numbers seen since the last call."""
        out = {f"memory/{model}_gpu_{key}": value for model, peaks in sorted(self.gpu_peaks.items())
               for key, value in sorted(peaks.items())}
        self.gpu_peaks = {}
        return out

    def is_resident(self, name: str, parts: Iterable[str]) -> bool:
        """Whether every one of ``parts`` of ``name`` is resident now."""
        with self._lock:
            return name in self.resident and set(parts) <= self.resident[name]

    def snapshot(self) -> dict[str, list[str]]:
        """Resident parts by model (models with none left out)."""
        return {m: sorted(p) for m, p in self.resident.items() if p}
