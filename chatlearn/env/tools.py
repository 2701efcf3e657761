"""Tool use, the common case of a multi-turn environment: ``environment: builtin:tools``.

The tools are ``models.policy.multi_turn.tools`` entries: a ``name``, a Python callable (``path``:
``package.module:function``, ``path/to/file.py:function`` or ``builtin:calculator``), a
``description`` and a JSON schema of its arguments (``parameters``; both taken from the function's
docstring and signature when left null), and fixed ``kwargs``. The prompts are rendered with the
tools' schemas (the chat template's ``tools``, in the OpenAI function format), so that a model
that knows tool calling (Qwen2.5, Qwen3, Llama 3.1, ...) sees them as in inference.

:class:`ToolEnvironment` parses each model turn with ``multi_turn.tool_parser`` (``hermes``: the
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of Hermes, Qwen2.5 and Qwen3;
or a user function ``text -> [ToolCall, ...]`` raising :class:`ToolCallError`). A turn without a
tool call is the model's final answer: the trajectory ends (reward: :meth:`ToolEnvironment.final_reward`,
0 unless a subclass says otherwise; the reward functions score the whole trajectory). Otherwise
each call (at most ``max_tool_calls_per_turn``) runs and its result, or the error, goes back to
the model as a ``tool`` message: a malformed call, an unknown tool, arguments that do not fit the
schema, or a tool that raises are the model's mistakes to learn from, not the run's. The rollout
counts, per tool, the calls that ran and those that raised (:attr:`ToolEnvironment.tool_stats`): a
tool's first error is shown, and a tool that raises on every call of several episodes stops the run
(``runtime_args.max_failed_env_episodes``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable

from chatlearn.env.base import Environment, awaited


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: the tool's name and its arguments."""

    name: str
    arguments: dict


class ToolCallError(ValueError):
    """The model's text holds a tool call that cannot be parsed (the message says how)."""


TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """The ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>`` blocks of ``text``, in
    order ([] when there is none); ``arguments`` may also be a JSON string of the object.
    ToolCallError for a block that is not such JSON, or a ``<tool_call>`` never closed."""
    bodies = TOOL_CALL.findall(text)
    if text.count("<tool_call>") != len(bodies):
        raise ToolCallError("a <tool_call> is not closed with </tool_call>")
    calls = []
    for body in bodies:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            raise ToolCallError(f"the tool call {_clip(body.strip())!r} is not JSON ({err.msg})") from None
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            raise ToolCallError(f'the tool call {_clip(body.strip())!r} is not {{"name": "...", "arguments": '
                                "{...}}")
        calls.append(ToolCall(obj["name"], args))
    return calls


@dataclass
class Tool:
    """A tool the model may call: ``fn(**arguments, **kwargs)`` returns its result (a string, or
    anything JSON can write; ``fn`` may be an ``async def``); ``parameters`` is the JSON schema its
    arguments are checked against."""

    name: str
    fn: Callable
    description: str
    parameters: dict
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        from jsonschema.validators import validator_for

        self._validator = validator_for(self.parameters)(self.parameters)

    def schema(self) -> dict:
        """The tool in the OpenAI function format, as chat templates take it (``tools``)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def __call__(self, arguments: dict) -> str:
        """The result as text; ``error: ...`` text for arguments outside the schema or a raise."""
        problem = self.check(arguments)
        return problem if problem is not None else self.call(arguments)[0]

    def check(self, arguments: dict) -> str | None:
        """``error: ...`` text for arguments outside the schema (the model's mistake: the function
        does not run); None for arguments that fit."""
        problems = sorted(self._validator.iter_errors(arguments), key=lambda e: list(e.path))
        if not problems:
            return None
        where = ".".join(str(p) for p in problems[0].path)
        return (f"error: invalid arguments for {self.name}" + (f" ({where})" if where else "")
                + f": {problems[0].message}")

    def call(self, arguments: dict) -> tuple[str, Exception | None]:
        """Run the function on ``arguments`` (checked): its result as text and None, or ``error: ...``
        text and the exception it raised."""
        try:
            out = awaited(self.fn(**arguments, **self.kwargs))  # an async def tool runs to completion here
        except Exception as err:  # noqa: BLE001 - the tool's failure is the model's answer
            return f"error: {type(err).__name__}: {err}", err
        return (out if isinstance(out, str) else json.dumps(out, ensure_ascii=False, default=str)), None


class ToolEnvironment(Environment):
    """``builtin:tools`` (see the module docstring). Subclass it to give rewards: override
    :meth:`final_reward` (the model's final answer) or :meth:`step`.

    ``tools``: the :class:`Tool` objects of ``multi_turn.tools``; ``parser``: the tool-call parser;
    ``max_tool_calls_per_turn``: calls beyond it in one turn get an error result, unrun."""

    uses_tools = True

    def __init__(self, tools: list[Tool], parser: Callable[[str], list], max_tool_calls_per_turn: int):
        self.tools = {t.name: t for t in tools}
        self.parser, self.max_calls = parser, int(max_tool_calls_per_turn)
        self.row: dict = {}
        # per tool that ran: [calls, calls that raised, the first exception]; the rollout reads it to
        # warn of a tool that fails (chatlearn.runtime.driver.multiturn)
        self.tool_stats: dict[str, list] = {}

    def reset(self, row: dict):
        self.row = row
        return None

    def step(self, action: str):
        try:
            calls = self.parser(action)
        except ToolCallError as err:
            return ([{"role": "tool", "content": f"error: {err}"}], 0.0, False,
                    {"tool_calls": 0.0, "tool_errors": 0.0, "tool_parse_errors": 1.0})
        if not calls:
            return None, float(self.final_reward(action)), True, {
                "tool_calls": 0.0, "tool_errors": 0.0, "tool_parse_errors": 0.0}
        results = [self.run(c) if i < self.max_calls else
                   f"error: more than {self.max_calls} tool calls in one turn; this one was not run"
                   for i, c in enumerate(calls)]
        messages = [{"role": "tool", "name": c.name, "content": r} for c, r in zip(calls, results)]
        errors = sum(r.startswith("error: ") for r in results)
        return messages, 0.0, False, {"tool_calls": float(len(calls)), "tool_errors": float(errors),
                                      "tool_parse_errors": 0.0}

    def run(self, call: ToolCall) -> str:
        """One call's result text (``error: ...`` for an unknown tool)."""
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; the tools are {', '.join(sorted(self.tools))}"
        problem = tool.check(call.arguments)
        if problem is not None:
            return problem
        text, error = tool.call(call.arguments)
        stats = self.tool_stats.setdefault(call.name, [0, 0, None])
        stats[0] += 1
        if error is not None:
            stats[1] += 1
            stats[2] = stats[2] if stats[2] is not None else error
        return text

    def final_reward(self, action: str) -> float:
        """The reward of the final answer ``action`` (a turn without tool calls); 0 here: the
        reward functions (``models.reward.functions``) score the trajectory."""
        return 0.0


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
