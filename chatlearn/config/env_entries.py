"""``models.policy.multi_turn`` as validation checks it and the rollout reads it: the environment
class, the tools (each function imported, its JSON schema checked, or derived from the function
when the entry gives none) and the tool-call parser, imported by their paths (see
:mod:`chatlearn.config.reward_entries` for the path forms).

This imports the user's code, never a chatlearn module above the config layer: the built-ins are
found by their ``"module:name"`` strings (``chatlearn.config.registry``).
"""
from __future__ import annotations

import inspect
import os
import re
import typing
from typing import Callable

from omegaconf import OmegaConf

from chatlearn.config.registry import BUILTIN_ENVIRONMENTS, BUILTIN_TOOLS, TOOL_PARSERS
from chatlearn.config.reward_entries import describe_error, load_object
from chatlearn.config.schema import MultiTurn
from chatlearn.errors import ConfigError

KEY = "models.policy.multi_turn"
TOOL_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


def load_environment(path: str, base_dir: str | None) -> Callable:
    """The environment class (or factory) named by ``multi_turn.environment``."""
    return load_object(path, key=f"{KEY}.environment", base_dir=base_dir, what="environment",
                       builtins=BUILTIN_ENVIRONMENTS, kind="class", runs_in="the driver")


def load_parser(name: str, base_dir: str | None) -> Callable:
    """The tool-call parser named by ``multi_turn.tool_parser`` (``hermes``, or a path)."""
    return load_object(name, key=f"{KEY}.tool_parser", base_dir=base_dir, what="tool-call parser",
                       builtins=TOOL_PARSERS, runs_in="the driver")


def tool_entries(mt: dict, base_dir: str | None) -> list[dict]:
    """The tools of ``multi_turn`` (a plain dict) as ``{name, fn, description, parameters, kwargs}``
    dicts, each function imported, a null description or schema taken from the function
    (:func:`function_schema`), the schema checked; ConfigErrors name the entry's key."""
    from jsonschema.exceptions import SchemaError
    from jsonschema.validators import validator_for

    out, seen = [], set()
    for i, e in enumerate(mt["tools"]):
        k = f"{KEY}.tools[{i}]"
        if not TOOL_NAME_RE.match(str(e["name"])):
            raise ConfigError(f"{e['name']!r} is not a tool name: use letters, digits, '_', '.' and '-', starting with "
                              "a letter or '_'.", key=f"{k}.name")
        if e["name"] in seen:
            raise ConfigError(f"{e['name']!r} names two tools. Give each tool its own name.", key=f"{k}.name")
        seen.add(e["name"])
        fn = load_object(e["path"], key=f"{k}.path", base_dir=base_dir, what="tool", builtins=BUILTIN_TOOLS,
                         runs_in="the driver")
        kwargs = dict(e["kwargs"])
        description, parameters = function_schema(fn, skip=tuple(kwargs))
        description = description if e["description"] is None else e["description"]
        parameters = parameters if e["parameters"] is None else e["parameters"]
        if not isinstance(parameters, dict) or parameters.get("type") != "object":
            raise ConfigError('must be a JSON schema of an object, e.g. {"type": "object", "properties": {"x": '
                              '{"type": "string"}}, "required": ["x"]}.', key=f"{k}.parameters")
        try:
            validator_for(parameters).check_schema(parameters)
        except SchemaError as err:
            raise ConfigError(f"is not a valid JSON schema: {err.message}. Fix it, or set it to null to take it "
                              "from the function's signature.", key=f"{k}.parameters") from None
        _check_tool_signature(fn, e["path"], list(parameters.get("properties", {})), kwargs, f"{k}.path")
        out.append({"name": e["name"], "fn": fn, "description": description, "parameters": parameters,
                    "kwargs": kwargs})
    return out


def _check_tool_signature(fn: Callable, path: str, names: list, kwargs: dict, key: str) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: checked when called
        return
    try:
        sig.bind_partial(**{n: None for n in names}, **kwargs)
    except TypeError as err:
        raise ConfigError(f"tool {path!r} cannot take the arguments of its schema ({', '.join(names) or 'none'}) "
                          f"and its kwargs ({', '.join(kwargs) or 'none'}): {err}. Make the function's parameters "
                          "match its JSON schema (parameters) and kwargs.", key=key) from None


JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def function_schema(fn: Callable, skip: tuple = ()) -> tuple[str, dict]:
    """``(description, parameters)`` of a tool function, for an entry that gives none: the first
    paragraph of its docstring, and a JSON schema of its parameters (less ``skip``, the entry's fixed
    kwargs) from their annotations (str, int, float, bool, list, dict; others: any type), required
    where they have no default; ``Args:`` lines of the docstring (``name: text``) describe them."""
    doc = inspect.getdoc(fn) or ""
    description = " ".join(doc.split("\n\n")[0].split())
    arg_docs = dict(re.findall(r"^\s+(\w+)(?:\s*\([^)]*\))?:\s*(.+)$", doc.split("Args:", 1)[1], re.M)) \
        if "Args:" in doc else {}
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - unresolvable annotations: any type
        hints = {}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    props, required = {}, []
    for name, p in params.items():
        if name in skip or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        prop = {"type": JSON_TYPES[hints[name]]} if hints.get(name) in JSON_TYPES else {}
        if name in arg_docs:
            prop["description"] = arg_docs[name].strip()
        props[name] = prop
        if p.default is p.empty:
            required.append(name)
    return description, {"type": "object", "properties": props, "required": required}


def check_multi_turn(cfg) -> None:
    """Validate ``models.policy.multi_turn`` of ``cfg``: without an environment every other key keeps
    its default; with one, the limits, the environment class (its methods and constructor), the
    tools and the parser (imported from the directory chatlearn runs from)."""
    mt = OmegaConf.to_container(cfg.models.policy.multi_turn, resolve=True)
    if mt["environment"] is None:
        defaults = OmegaConf.to_container(OmegaConf.structured(MultiTurn), resolve=True)
        changed = [k for k in mt if mt[k] != defaults[k]]
        if changed:
            raise ConfigError(f"{KEY}.{changed[0]} is set, but {KEY}.environment is null (single-turn rollouts), so "
                              "it would have no effect. Set environment (builtin:tools, or your class) or remove it.",
                              key=f"{KEY}.{changed[0]}")
        return
    _check_limits(mt, cfg.models.policy.max_response_tokens_length)
    base_dir = os.getcwd()
    env = load_environment(mt["environment"], base_dir)
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise ConfigError(f"environment {mt['environment']!r} has no method {method}(); an environment implements "
                              "reset(row) and step(action) (subclass chatlearn.env.Environment).",
                              key=f"{KEY}.environment")
    uses_tools = bool(getattr(env, "uses_tools", False))
    if uses_tools and not mt["tools"]:
        raise ConfigError(f"environment {mt['environment']!r} calls tools, and none is given. List them in "
                          f"{KEY}.tools (name, path; e.g. path: builtin:calculator).", key=f"{KEY}.tools")
    if mt["tools"] and not uses_tools:
        raise ConfigError(f"environment {mt['environment']!r} does not use tools (it is not a "
                          "chatlearn.env.ToolEnvironment), so the tools would have no effect. Use environment: "
                          "builtin:tools (or a subclass of ToolEnvironment), or remove the tools.", key=f"{KEY}.tools")
    kwargs = dict(mt["environment_kwargs"])
    if uses_tools:
        tool_entries(mt, base_dir)
        load_parser(mt["tool_parser"], base_dir)
        kwargs.update(tools=[], parser=None, max_tool_calls_per_turn=1)
    try:
        inspect.signature(env).bind(**kwargs)
    except TypeError as err:
        raise ConfigError(f"environment {mt['environment']!r} cannot be built with the keyword arguments "
                          f"{', '.join(kwargs) or '(none)'}: {describe_error(err)}. Fix {KEY}.environment_kwargs or "
                          "the class's constructor.", key=f"{KEY}.environment_kwargs") from None
    except ValueError:
        pass  # no signature to check: the constructor says so when the rollout builds it


def _check_limits(mt: dict, max_response: int) -> None:
    for key in ("max_turns", "max_observation_tokens", "num_workers", "max_tool_calls_per_turn"):
        if mt[key] < 1:
            raise ConfigError(f"is {mt[key]}; it must be at least 1.", key=f"{KEY}.{key}")
    if mt["max_turn_tokens"] is not None and not 1 <= mt["max_turn_tokens"] <= max_response:
        raise ConfigError(f"is {mt['max_turn_tokens']}; it must be in [1, models.policy.max_response_tokens_length "
                          f"({max_response})] (every token after the prompt counts against that), or null.",
                          key=f"{KEY}.max_turn_tokens")
    if not mt["step_timeout_s"] > 0:
        raise ConfigError(f"is {mt['step_timeout_s']}; it must be > 0 (seconds).", key=f"{KEY}.step_timeout_s")
    if not 0 < mt["reward_discount"] <= 1:
        raise ConfigError(f"is {mt['reward_discount']}; it must be in (0, 1] (1: the rewards of the turns summed).",
                          key=f"{KEY}.reward_discount")
    if not str(mt["observation_role"]).strip():
        raise ConfigError("is empty; give the role of string observations (e.g. user or tool).",
                          key=f"{KEY}.observation_role")
