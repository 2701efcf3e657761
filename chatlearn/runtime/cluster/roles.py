"""Which model and rank each actor of this process's worker groups is, and its handle while it lives.

Ray names a dead actor only by its class (``Worker``) and id: :func:`role_of` says which model and rank it
was, for the errors that report a dead worker (:mod:`chatlearn.runtime.cluster.group`) and the watchdog's
stall messages (:mod:`chatlearn.runtime.cluster.watchdog`), which also kills the live actors on a stall.
"""
from __future__ import annotations

import weakref

# actor id (hex) -> (model, index) of every actor started by chatlearn.runtime.cluster.group
_ROLES: dict[str, tuple[str, int]] = {}
# actor id (hex) -> handle of the same actors, while a handle lives
_ACTORS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def register(actor, name: str, index: int) -> None:
    """``actor`` (a Ray actor handle, or a worker of a run without Ray) is actor ``index`` of model ``name``."""
    actor_id = actor._actor_id.hex()
    _ROLES[actor_id] = (name, index)
    _ACTORS[actor_id] = actor


def model_of(actor_id: str | None) -> str | None:
    """The model of an actor id (hex) of this process's groups; None for any other."""
    return _ROLES[actor_id][0] if actor_id in _ROLES else None


def role_of(actor_id: str | None) -> str | None:
    """``"policy_trainer rank 1"``, ``"policy replica 0"``, ... for an actor id (hex) of this process's groups."""
    if not actor_id or actor_id not in _ROLES:
        return None
    name, index = _ROLES[actor_id]
    return f"{name} {'replica' if name in ('policy', 'rollout') else 'rank'} {index}"


def live_actors() -> dict:
    """Actor id (hex) -> handle of the registered actors whose handles still live."""
    return dict(list(_ACTORS.items()))


def handle_of(actor_id: str):
    """The handle of a registered actor, while it lives; None otherwise."""
    return _ACTORS.get(actor_id)
