"""The entries of ``models.reward.functions`` as validation checks them: parsed into explicit
entries, each function imported (a ``package.module:function`` path, a ``path/to/file.py:function``
file, or a built-in of :data:`chatlearn.config.registry.BUILTIN_REWARDS`) and its parameters
checked against the contract (see :mod:`chatlearn.models.reward.functions`, which runs them).

This imports the user's code, never a chatlearn module above the config layer: a built-in is
found by its ``"module:function"`` string.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
from typing import Callable

from chatlearn.config.registry import BUILTIN_REWARDS
from chatlearn.errors import ConfigError

CONTRACT = ("prompts", "responses", "ground_truths", "data_sources", "extra")
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
SIGNATURE_HINT = ("define it as def f(prompts, responses, ground_truths, data_sources, extra, **kwargs) "
                  "(names as given, keyword arguments)")


def resolve_entries(reward, with_environment: bool = False) -> list[dict]:
    """The explicit entries of ``models.reward`` (a config section or dict): ``functions`` as plain dicts, or,
    when it is empty, the built-in math reward alone with weight 1 (none ``with_environment``: a multi-turn
    environment's reward alone); ``builtin:math`` gets its kwargs from ``correct_score`` and ``incorrect_score``."""
    default = [] if with_environment else [{"name": "math", "path": "builtin:math", "weight": 1.0, "kwargs": {},
                                            "normalize": "none"}]
    entries = [{"name": e["name"], "path": e["path"], "weight": float(e["weight"]), "kwargs": dict(e["kwargs"]),
                "normalize": str(e["normalize"]) if "normalize" in e else "none"} for e in reward["functions"]] or default
    for e in entries:
        if e["path"] == "builtin:math":
            e["kwargs"] = {"correct_score": float(reward["correct_score"]),
                           "incorrect_score": float(reward["incorrect_score"]), **e["kwargs"]}
    return entries


def _import_file(file: str, path: str, key: str, what: str = "reward function", runs_in: str = "the reward workers"):
    if not os.path.isfile(file):
        raise ConfigError(f"{what} {path!r}: the file {file!r} does not exist (cwd: {os.getcwd()}). "
                          "Fix the path (relative paths are relative to the directory you run chatlearn from).",
                          key=key)
    digest = hashlib.sha1(os.path.abspath(file).encode()).hexdigest()[:12]
    mod_name = f"chatlearn_user_{re.sub(r'[^0-9A-Za-z_]', '_', os.path.basename(file)[:-3])}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as err:  # the user's module: any error while it runs is theirs
        del sys.modules[mod_name]
        raise ConfigError(f"{what} {path!r}: importing {file!r} failed with {describe_error(err)}. Fix the "
                          f"file so that it imports (its code runs in {runs_in}).", key=key) from None
    return module


def load_function(path: str, *, key: str = "models.reward.functions", base_dir: str | None = None) -> Callable:
    """The callable named by ``path`` (see the module docstring); a bad path is a ConfigError naming it."""
    return load_object(path, key=key, base_dir=base_dir)


def load_object(path: str, *, key: str, base_dir: str | None = None, what: str = "reward function",
                builtins=BUILTIN_REWARDS, kind: str = "function", runs_in: str = "the reward workers"):
    """The object named by ``path``: ``package.module:name``, ``path/to/file.py:name`` or one of
    ``builtins`` (a :class:`~chatlearn.config.registry.Registry` of ``builtin:...`` names); a bad path is
    a ConfigError naming ``what`` and ``key``. The object must be callable (a ``kind``: function or class)."""
    if path.startswith("builtin:") and path not in builtins:
        raise ConfigError(f"{what} {path!r} is not a built-in one; the built-ins are {', '.join(builtins.names)}. "
                          f"Fix the name, or give package.module:{kind} or path/to/file.py:{kind}.", key=key)
    target = builtins.get(path) if path in builtins else path
    mod_part, sep, attr = target.rpartition(":")
    if not sep or not mod_part or not attr.isidentifier():
        raise ConfigError(f"{what} path {path!r} is not of the form package.module:{kind}, "
                          f"path/to/file.py:{kind} or one of {', '.join(builtins.names)}. Fix the path.", key=key)
    if mod_part.endswith(".py") or "/" in mod_part or os.sep in mod_part:
        file = mod_part if os.path.isabs(mod_part) or base_dir is None else os.path.join(base_dir, mod_part)
        module = _import_file(file, path, key, what, runs_in)
    else:
        if base_dir and base_dir not in sys.path:
            sys.path.append(base_dir)
        try:
            module = importlib.import_module(mod_part)
        except BaseException as err:  # ImportError, or any error raised by the user's module while it runs
            raise ConfigError(f"{what} {path!r}: cannot import module {mod_part!r}: {describe_error(err)}. "
                              "Install the package or run chatlearn from the directory that holds it, or give "
                              f"the file instead (path/to/file.py:{kind}).", key=key) from None
    fn = getattr(module, attr, None)
    if fn is None:
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        raise ConfigError(f"{what} {path!r}: {mod_part!r} has no {kind} {attr!r} (it defines: "
                          f"{', '.join(defined) or 'none'}). Fix the name after the colon.", key=key)
    if not callable(fn):
        raise ConfigError(f"{what} {path!r}: {attr!r} is a {type(fn).__name__}, not a {kind}. Point "
                          f"the path at a {kind}.", key=key)
    return fn


def check_signature(fn: Callable, path: str, kwargs: dict, key: str) -> None:
    """The function accepts the contract's keyword arguments plus ``kwargs``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: checked when called
        return
    try:
        sig.bind(**{k: None for k in CONTRACT}, **kwargs)
    except TypeError as err:
        raise ConfigError(f"reward function {path!r} cannot be called with the keyword arguments "
                          f"{', '.join(CONTRACT + tuple(kwargs))}: {err}. Fix its parameters: {SIGNATURE_HINT}.",
                          key=key) from None


def check_functions(reward, key: str = "models.reward.functions", with_environment: bool = False) -> None:
    """Validate ``models.reward.functions`` (names, weights, paths): each function is imported and its
    parameters are checked against the contract."""
    seen = set()
    for i, e in enumerate(reward["functions"]):
        k = f"{key}[{i}]"
        name = e["name"]
        if not NAME_RE.match(str(name)):
            raise ConfigError(f"name {name!r} may hold only letters, digits, '_', '.' and '-' (it names the "
                              "metrics train/reward/<name>/...). Rename it.", key=f"{k}.name")
        if name in seen:
            raise ConfigError(f"name {name!r} is used twice. Give each reward function its own name.",
                              key=f"{k}.name")
        seen.add(name)
        if not math.isfinite(e["weight"]):
            raise ConfigError(f"weight must be a finite number, got {e['weight']!r}.", key=f"{k}.weight")
        if "normalize" in e and e["normalize"] not in ("none", "batch"):
            raise ConfigError(f"normalize is {e['normalize']!r}: none (the score as it is) or batch (whitened over "
                              "the episode's samples: zero mean, unit std, before x weight).", key=f"{k}.normalize")
        if e["path"] == "builtin:math" and len(e["kwargs"]):
            raise ConfigError("builtin:math takes no kwargs: its values are models.reward.correct_score and "
                              "incorrect_score. Remove the kwargs and set those keys.", key=f"{k}.kwargs")
    for i, e in enumerate(resolve_entries(reward, with_environment)):
        fn = load_function(e["path"], key=f"{key}[{i}].path", base_dir=os.getcwd())
        check_signature(fn, e["path"], e["kwargs"], f"{key}[{i}].path")


def describe_error(err: BaseException, limit: int = 300) -> str:
    """``TypeName: message`` of an error the user's code raised, on one line, cut near ``limit`` characters."""
    text = " ".join(str(err).split())
    text = text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " (...)"
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
