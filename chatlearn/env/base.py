"""The environment interface of multi-turn rollouts (``models.policy.multi_turn.environment``).

A user writes a class with two methods and names it in the config (``path/to/file.py:Class`` or
``package.module:Class``; ``environment_kwargs`` go to its constructor)::

    class Guess(Environment):
        def reset(self, row):            # row: the data row of this sample (see below)
            self.answer = int(row["ground_truth"])
            return None                  # None: start from the row's prompt as the data set renders it

        def step(self, action):          # action: the text of the model's turn
            guess = int(action.strip() or -1)
            if guess == self.answer:
                return None, 1.0, True, {}                    # observation, reward, done, info
            return "higher" if guess < self.answer else "lower", 0.0, False, {"misses": 1}

The rollout builds one instance per trajectory (each of a prompt's ``num_inference_per_prompt``
samples has its own), calls :meth:`Environment.reset` once, then :meth:`Environment.step` after
every model turn until it says ``done`` or a limit of ``multi_turn`` ends the trajectory, and
:meth:`Environment.close` at the end in every case. The calls run on the driver, in a pool of
``multi_turn.num_workers`` threads beside the generation, each within ``multi_turn.step_timeout_s``
seconds: a call that raises or overruns ends its trajectory with the error recorded (the run goes
on). Instances are never shared between trajectories, so an environment may keep its state in
``self``; one that reads shared state or draws unseeded random numbers makes runs unrepeatable.

``row`` holds the sample's data row: ``prompt`` (the chat messages of the row), ``ground_truth``,
``data_source``, and the row's other columns. An *observation* is a string (one message of role
``multi_turn.observation_role``), a message ``{"role": ..., "content": ...}``, a list of
messages, or None (nothing to add: only with ``done``). The chat template renders it; the
tokens are appended to the trajectory once and never re-rendered. ``reset`` returns the
conversation the model starts from: None keeps the row's prompt, a string becomes the user
message, messages the whole conversation. ``info``: numbers summed over the trajectory's steps
and logged as ``train/env/info/<key>`` (their mean over the trajectories).
"""
from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from dataclasses import dataclass, field


class Environment:
    """Base class of an environment (see the module docstring); subclass it and implement
    :meth:`step` (and :meth:`reset` when the trajectory needs state of the row)."""

    # ToolEnvironment and its subclasses: the rollout gives them models.policy.multi_turn.tools
    uses_tools = False

    def reset(self, row: dict):
        """The conversation the model starts from: None (the row's prompt), a string (the user
        message) or a list of chat messages. Called once, before the first model turn."""
        return None

    def step(self, action: str):
        """The model's turn ``action`` (its text, without special tokens) -> ``(observation,
        reward, done, info)``: what the model sees next (None with ``done``), this turn's reward
        (a finite number), whether the trajectory ends, and numbers to log (a dict, may be empty)."""
        raise NotImplementedError(f"{type(self).__name__}.step is not implemented")

    def close(self) -> None:
        """Called once the trajectory has ended (release what the environment holds)."""
        return None


class BadEnvironmentOutput(ValueError):
    """An environment returned something the rollout cannot use (the message names what)."""


@dataclass
class StepResult:
    """One :meth:`Environment.step`, checked: the observation as chat messages (None: nothing),
    the reward, whether the trajectory ends, and the info numbers."""

    observation: list | None
    reward: float
    done: bool
    info: dict = field(default_factory=dict)


def as_messages(value, role: str, what: str) -> list | None:
    """An observation as a list of chat messages (None stays None); see the module docstring."""
    if value is None:
        return None
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return [dict(m) for m in value]
    raise BadEnvironmentOutput(f"{what} is a {type(value).__name__} ({_short(value)}); it must be a string, a "
                               "message {'role': ..., 'content': '...'}, a non-empty list of messages, or None")


def as_step_result(value, role: str) -> StepResult:
    """Check what :meth:`Environment.step` returned: ``(observation, reward, done, info)``."""
    if not isinstance(value, (tuple, list)) or len(value) != 4:
        raise BadEnvironmentOutput(f"step returned {_short(value)}; it must return a tuple (observation, reward, "
                                   "done, info)")
    observation, reward, done, info = value
    if not isinstance(reward, numbers.Real) or isinstance(reward, bool) or not math.isfinite(float(reward)):
        raise BadEnvironmentOutput(f"step returned the reward {_short(reward)}; it must be a finite number")
    if not isinstance(done, (bool, numbers.Integral)):
        raise BadEnvironmentOutput(f"step returned done={_short(done)}; it must be True or False")
    info = {} if info is None else info
    if not isinstance(info, dict) or not all(
            isinstance(k, str) and isinstance(v, numbers.Real) and math.isfinite(float(v)) for k, v in info.items()):
        raise BadEnvironmentOutput(f"step returned the info {_short(info)}; it must be a dict of names to finite "
                                   "numbers (or None)")
    messages = as_messages(observation, role, "the observation step returned")
    if messages is None and not done:
        raise BadEnvironmentOutput("step returned no observation (None) without done: the model needs something "
                                   "to answer; return an observation, or done=True")
    return StepResult(messages, float(reward), bool(done), {k: float(v) for k, v in info.items()})


def _short(value, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def awaited(value):
    """``value``, or what it resolves to when it is awaitable (an ``async def`` environment method or
    tool), run to completion on an event loop of the calling thread's own (a step thread)."""
    if not inspect.isawaitable(value):
        return value

    async def wait():
        return await value

    return asyncio.run(wait())
