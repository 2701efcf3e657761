"""The runtime is four rooms a reader can name (docs/architecture.md): the run folder (``rundir``),
the weight push (``weight_push``), the cluster (``cluster``) and the driver (``driver``). A room
imports only the rooms below it, and nothing is left in ``chatlearn/runtime/`` outside a room."""
from __future__ import annotations

import os

from test_layering import chatlearn_imports, modules_cache

from conftest import REPO

# bottom to top: the rooms each room's modules may import (besides its own)
ROOMS: dict[str, set[str]] = {
    # the output folder holds one run; the lock on it
    "rundir": set(),
    # the trainer -> rollout weight push: the driver's side (transport, bucket plan) and the workers'
    "weight_push": set(),
    # Ray start-up, placement groups, the worker actor (which hosts a weight push endpoint), its
    # environment, signals, leftovers of killed runs
    "cluster": {"weight_push"},
    # the episode engine, the algorithms' stages, sampling and scoring, overlap, replay, evaluation,
    # the residency scheduler and measurement
    "driver": {"cluster", "weight_push", "rundir"},
}


def room_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["chatlearn", "runtime"] or len(parts) < 3:
        return None
    return parts[2]


def test_every_runtime_module_is_in_a_room():
    loose = [m for m in modules_cache() if m.startswith("chatlearn.runtime.") and room_of(m) not in ROOMS]
    assert not loose, f"runtime modules outside the rooms {sorted(ROOMS)}: {loose}"


def test_rooms_import_only_the_rooms_below_them():
    wrong = []
    for module, file in modules_cache().items():
        src = room_of(module)
        if src is None:
            continue
        for target, line in chatlearn_imports(module, file):
            dst = room_of(target)
            if dst is not None and dst != src and dst not in ROOMS[src]:
                wrong.append(f"{os.path.relpath(file, REPO)}:{line}: {module} ({src}) imports {target} ({dst})")
    assert not wrong, "runtime rooms importing upward (tests/runtime/test_rooms.py):\n" + "\n".join(sorted(wrong))
