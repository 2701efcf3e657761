"""Residency: which parts of which model are on each device group, and the turns between them.

Models in one device group take turns. ``ensure(model, parts)`` offloads the parts of the other
models of that group that are resident (those their ``free_gpu_memory`` flags allow to move) and
onloads the parts ``model`` needs that are not resident. Nothing moves when nothing has to: a
model that is already resident stays so. Every move and every stage call is recorded in the
timeline (``<output_dir>/timeline.jsonl``) with its model, parts, bytes and seconds.
"""
from __future__ import annotations

import json
import time
from typing import Iterable

from chatlearn.config.plan import Plan
from chatlearn.runtime.group import WorkerGroup

MODEL_PARTS = {
    "policy": ("weights", "kv_cache"),
    "policy_trainer": ("weights", "optimizer", "grads"),
    "ref_policy": ("weights",),
}


def movable_parts(name: str, free_gpu_memory) -> set[str]:
    """Parts the config allows to leave the device (the KV cache can always be dropped)."""
    flags = {"weights": free_gpu_memory.offload_weights,
             "optimizer": free_gpu_memory.offload_optimizer_states,
             "grads": free_gpu_memory.free_grad_buffers,
             "kv_cache": True}
    return {p for p in MODEL_PARTS[name] if flags[p]}


class Timeline:
    """Append-only record of transitions and stage calls."""

    def __init__(self, path: str | None):
        self.events: list[dict] = []
        self._file = open(path, "a", encoding="utf-8") if path else None
        self.episode = 0

    def record(self, **event) -> None:
        event = {"episode": self.episode, **event}
        self.events.append(event)
        if self._file:
            self._file.write(json.dumps(event) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()


class Scheduler:
    def __init__(self, plan: Plan, groups: dict[str, WorkerGroup], movable: dict[str, set[str]],
                 timeline: Timeline):
        self.plan, self.groups, self.movable, self.timeline = plan, groups, movable, timeline
        # after setup every model holds all its parts
        self.resident: dict[str, set[str]] = {n: set(MODEL_PARTS[n]) for n in groups if n in MODEL_PARTS}

    def ensure(self, name: str, parts: Iterable[str], keep: dict[str, Iterable[str]] | None = None) -> None:
        """Make ``parts`` of ``name`` resident, first offloading what conflicts on its devices.

        ``keep`` names parts of other models that may stay resident alongside (a weight push
        keeps the trainer's weights next to the rollout engine's).
        """
        keep = {k: set(v) for k, v in (keep or {}).items()}
        for other in self.plan.colocated_with(name):
            if other not in self.resident:
                continue
            out = (self.resident[other] & self.movable[other]) - keep.get(other, set())
            self.offload(other, out)
        self.onload(name, set(parts) - self.resident[name])

    def offload(self, name: str, parts: Iterable[str]) -> None:
        self._move(name, "offload", [p for p in MODEL_PARTS[name] if p in set(parts) & self.resident[name]])

    def onload(self, name: str, parts: Iterable[str]) -> None:
        self._move(name, "onload", [p for p in MODEL_PARTS[name] if p in set(parts) - self.resident[name]])

    def _move(self, name: str, action: str, parts: list[str]) -> None:
        if not parts:
            return
        start = time.perf_counter()
        results, _ = self.groups[name].call(action, parts)
        seconds = time.perf_counter() - start
        moved = sum(int((r or {}).get("bytes", 0)) for r in results)
        if action == "offload":
            self.resident[name] -= set(parts)
        else:
            self.resident[name] |= set(parts)
        self.timeline.record(kind="transition", model=name, action=action, parts=parts, bytes=moved,
                             seconds=round(seconds, 6))

    def stage(self, name: str, stage: str, seconds: float) -> None:
        self.timeline.record(kind="stage", model=name, stage=stage, seconds=round(seconds, 6),
                             resident={m: sorted(p) for m, p in self.resident.items() if p})
