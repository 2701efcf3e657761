"""Environments for the multi-turn tests, named in configs as ``multiturn_envs:<Class>`` (tests/support
is on ``sys.path``), so that a test reads what they recorded."""
from __future__ import annotations

import threading
import time

from chatlearn.env import Environment

RECORD: list = []  # (prompt text, action) of every step, in call order
LOCK = threading.Lock()


class ScriptedEnv(Environment):
    """Steps through ``script[<the row's first message>]``: a list of ``[observation, reward, done, info]``
    (one per step), or of the words ``"raise"`` (the step raises), ``"sleep"`` (it sleeps ``sleep_s``),
    ``"bad"`` (returns a malformed result); ``first`` maps a row to what reset returns, ``"raise"``
    making reset raise."""

    def __init__(self, script: dict, first: dict | None = None, sleep_s: float = 5.0):
        self.script, self.first, self.sleep_s = script, first or {}, sleep_s
        self.key, self.turn = None, 0

    def reset(self, row):
        self.key = row["prompt"][0]["content"]
        out = self.first.get(self.key)
        if out == "raise":
            raise RuntimeError(f"reset failed for {self.key}")
        return out

    def step(self, action):
        with LOCK:
            RECORD.append((self.key, action))
        todo = self.script[self.key][self.turn]
        self.turn += 1
        if todo == "raise":
            raise ValueError(f"step {self.turn} of {self.key} failed")
        if todo == "sleep":
            time.sleep(self.sleep_s)
            return "late", 0.0, False, {}
        if todo == "bad":
            return "obs", "one", False, {}
        return tuple(todo)


class CountdownEnv(Environment):
    """Multi-turn without meaning, for any model: the observation asks for the next turn, ``turns``
    times, then done with reward 1 when the model's last action was non-empty (any text)."""

    def __init__(self, turns: int = 2):
        self.turns, self.left = turns, turns

    def step(self, action):
        self.left -= 1
        if self.left <= 0:
            return None, float(bool(action.strip())), True, {"steps": 1}
        return f"Again ({self.left} left).", 0.0, False, {"steps": 1}


class AsyncEnv(Environment):
    """``async def`` reset and step (an environment calling a service): one observation, then done."""

    async def reset(self, row):
        import asyncio

        await asyncio.sleep(0)
        return None

    async def step(self, action):
        import asyncio

        await asyncio.sleep(0.01)
        self.steps = getattr(self, "steps", 0) + 1
        return (None, 1.0, True, {"steps": self.steps}) if self.steps > 1 else ("more", 0.5, False, {})


def unreachable_lookup(query: str) -> str:
    """Look a query up (a service that is down: every call raises)."""
    raise ConnectionError("lookup service unreachable")


_FLAKY = {"calls": 0}


def flaky_lookup(query: str) -> str:
    """Look a query up (every other call raises)."""
    with LOCK:
        _FLAKY["calls"] += 1
        n = _FLAKY["calls"]
    if n % 2:
        raise TimeoutError(f"call {n} timed out")
    return f"result of {query}"
