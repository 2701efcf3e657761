"""Reward functions: the built-in math reward and user functions, combined by weight.

``models.reward.functions`` lists the rewards; each entry has a ``name``, a ``path``, a ``weight`` and
fixed ``kwargs``. ``path`` is ``builtin:math``, an import path ``package.module:function`` (imported
with the directory chatlearn runs from on ``sys.path``) or a file ``path/to/file.py:function``.

The contract of a reward function: it is called once per batch (each reward worker scores its share
of an episode's samples in one call) with keyword arguments

- ``prompts``: list[str], the prompts as the model saw them (chat template applied), decoded
  without special tokens;
- ``responses``: list[str], the decoded responses;
- ``ground_truths``: list, the value of ``runtime_args.ground_truth_key`` of each sample's row
  (None when that key is null);
- ``data_sources``: list[str], each row's ``data_source``;
- ``extra``: list[dict], the other columns of each row;

plus the entry's ``kwargs``. It returns one number per sample, either as a sequence (list, tuple,
1-D array) or as a dict whose ``score`` holds them and whose other keys hold further per-sample
numbers that are logged (their means) as ``train/reward/<name>/<key>`` (``eval/...`` in
evaluation). The reward of a sample is ``sum_i weight_i * score_i`` over the entries; each entry's
unweighted ``score`` mean is logged as ``train/reward/<name>/score``.

A function that cannot be imported, does not accept those keyword arguments, raises, or returns
the wrong number of values or a value that is not a finite number stops the run with a
:class:`~chatlearn.errors.UserError` naming the function's path.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
import traceback
from typing import Callable

import numpy as np

from chatlearn.errors import ConfigError, UserError

BUILTIN = {"builtin:math": "chatlearn.models.reward.math_reward:math_reward"}
CONTRACT = ("prompts", "responses", "ground_truths", "data_sources", "extra")
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
SIGNATURE_HINT = ("define it as def f(prompts, responses, ground_truths, data_sources, extra, **kwargs) "
                  "(names as given, keyword arguments)")


def resolve_entries(reward) -> list[dict]:
    """The explicit entries of ``models.reward`` (a config section or dict): ``functions`` as plain dicts, or,
    when it is empty, the built-in math reward alone with weight 1; ``builtin:math`` gets its kwargs
    from ``correct_score`` and ``incorrect_score``."""
    entries = [{"name": e["name"], "path": e["path"], "weight": float(e["weight"]), "kwargs": dict(e["kwargs"])}
               for e in reward["functions"]] or [{"name": "math", "path": "builtin:math", "weight": 1.0, "kwargs": {}}]
    for e in entries:
        if e["path"] == "builtin:math":
            e["kwargs"] = {"correct_score": float(reward["correct_score"]),
                           "incorrect_score": float(reward["incorrect_score"]), **e["kwargs"]}
    return entries


def _import_file(file: str, path: str, key: str):
    if not os.path.isfile(file):
        raise ConfigError(f"reward function {path!r}: the file {file!r} does not exist (cwd: {os.getcwd()}). "
                          "Fix the path (relative paths are relative to the directory you run chatlearn from).",
                          key=key)
    digest = hashlib.sha1(os.path.abspath(file).encode()).hexdigest()[:12]
    mod_name = f"chatlearn_user_reward_{re.sub(r'[^0-9A-Za-z_]', '_', os.path.basename(file)[:-3])}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as err:  # the user's module: any error while it runs is theirs
        del sys.modules[mod_name]
        raise ConfigError(f"reward function {path!r}: importing {file!r} failed with {_describe(err)}. Fix the "
                          "file so that it imports (its code runs in the reward workers).", key=key) from None
    return module


def load_function(path: str, *, key: str = "models.reward.functions", base_dir: str | None = None) -> Callable:
    """The callable named by ``path`` (see the module docstring); a bad path is a ConfigError naming it."""
    target = BUILTIN[path] if path in BUILTIN else path
    mod_part, sep, attr = target.rpartition(":")
    if not sep or not mod_part or not attr.isidentifier():
        raise ConfigError(f"reward function path {path!r} is not of the form package.module:function, "
                          "path/to/file.py:function or builtin:math. Fix the path.", key=key)
    if mod_part.endswith(".py") or "/" in mod_part or os.sep in mod_part:
        file = mod_part if os.path.isabs(mod_part) or base_dir is None else os.path.join(base_dir, mod_part)
        module = _import_file(file, path, key)
    else:
        if base_dir and base_dir not in sys.path:
            sys.path.append(base_dir)
        try:
            module = importlib.import_module(mod_part)
        except BaseException as err:  # ImportError, or any error raised by the user's module while it runs
            raise ConfigError(f"reward function {path!r}: cannot import module {mod_part!r}: {_describe(err)}. "
                              "Install the package or run chatlearn from the directory that holds it, or give "
                              "the file instead (path/to/file.py:function).", key=key) from None
    fn = getattr(module, attr, None)
    if fn is None:
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        raise ConfigError(f"reward function {path!r}: {mod_part!r} has no function {attr!r} (it defines: "
                          f"{', '.join(defined) or 'none'}). Fix the name after the colon.", key=key)
    if not callable(fn):
        raise ConfigError(f"reward function {path!r}: {attr!r} is a {type(fn).__name__}, not a function. Point "
                          "the path at a function.", key=key)
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


def check_functions(reward, key: str = "models.reward.functions") -> None:
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
        if e["path"] == "builtin:math" and len(e["kwargs"]):
            raise ConfigError("builtin:math takes no kwargs: its values are models.reward.correct_score and "
                              "incorrect_score. Remove the kwargs and set those keys.", key=f"{k}.kwargs")
    for i, e in enumerate(resolve_entries(reward)):
        fn = load_function(e["path"], key=f"{key}[{i}].path", base_dir=os.getcwd())
        check_signature(fn, e["path"], e["kwargs"], f"{key}[{i}].path")


def _describe(err: BaseException, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    text = text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " (...)"
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _user_frames(err: BaseException, n: int = 3) -> str:
    """The last ``n`` frames of the traceback outside this module, as ``file:line in function``."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename != __file__]
    return "; ".join(f"{f.filename}:{f.lineno} in {f.name}" for f in frames[-n:])


def _numbers(value, n: int, what: str, path: str) -> np.ndarray:
    fix = ("Return one number per sample: a list of floats, or a dict with key 'score' (the floats) and other "
           "keys holding lists of floats to log")
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()  # numpy arrays, torch tensors
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__") or not hasattr(value, "__iter__"):
        raise UserError(f"reward function {path!r} returned {what} as a {type(value).__name__}, not a sequence "
                        f"of numbers. {fix}.")
    if len(value) != n:
        raise UserError(f"reward function {path!r} returned {len(value)} values for {what}, but it was given {n} "
                        f"samples. {fix}, in the order of the samples.")
    out = np.empty(n, dtype=np.float64)
    for i, v in enumerate(value):
        if not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
            raise UserError(f"reward function {path!r} returned {v!r} ({type(v).__name__}) at index {i} of {what}, "
                            f"which is not a finite number. {fix}.")
        out[i] = float(v)
    return out


class RewardManager:
    """The reward backend: one reward worker. ``cfg["functions"]`` is the full, explicit list of entries
    (name, path, weight, kwargs); ``cfg["base_dir"]`` is the directory relative paths start from."""

    def __init__(self, cfg: dict):
        self.entries = []
        for i, e in enumerate(cfg["functions"]):
            key = f"models.reward.functions[{i}].path"
            fn = load_function(e["path"], key=key, base_dir=cfg["base_dir"])
            check_signature(fn, e["path"], dict(e["kwargs"]), key)
            self.entries.append((e["name"], e["path"], float(e["weight"]), dict(e["kwargs"]), fn))

    def call(self, path: str, fn: Callable, kwargs: dict, batch: dict, n: int) -> dict[str, np.ndarray]:
        """Run one function on the batch; its per-sample outputs by key (``score`` and the logged keys)."""
        try:
            out = fn(**batch, **kwargs)
        except Exception as err:  # the user's code: report what it raised and where
            frames = _user_frames(err)
            raise UserError(f"reward function {path!r} raised {_describe(err)}"
                            + (f" (at {frames})" if frames else "") + ". Fix the function; it runs in the "
                            "reward workers, once per batch, with the keyword arguments prompts, responses, "
                            "ground_truths, data_sources and extra.") from None
        if isinstance(out, dict):
            if "score" not in out:
                raise UserError(f"reward function {path!r} returned a dict without the key 'score' (its keys: "
                                f"{', '.join(map(str, out)) or 'none'}). Put the per-sample rewards under "
                                "'score'; other keys are logged as metrics.")
            bad = [k for k in out if not isinstance(k, str) or not NAME_RE.match(k)]
            if bad:
                raise UserError(f"reward function {path!r} returned the dict key {bad[0]!r}, which cannot name a "
                                "metric. Use keys of letters, digits, '_', '.' and '-'.")
            return {k: _numbers(v, n, f"{k!r}", path) for k, v in out.items()}
        return {"score": _numbers(out, n, "the rewards", path)}

    def score(self, prompts: list[str], responses: list[str], ground_truths: list, data_sources: list[str],
              extra: list[dict]) -> dict:
        """``{"score": sum_i weight_i * score_i, "metrics": {"<name>/<key>": per-sample values}}``."""
        batch = {"prompts": list(prompts), "responses": list(responses), "ground_truths": list(ground_truths),
                 "data_sources": list(data_sources), "extra": list(extra)}
        total = np.zeros(len(responses), dtype=np.float64)
        metrics: dict[str, np.ndarray] = {}
        for i in range(len(self.entries)):
            out = self.score_one(i, batch)
            total += out["score"]
            metrics.update(out["metrics"])
        return {"score": total.astype(np.float32), "metrics": metrics}

    def score_one(self, index: int, batch: dict) -> dict:
        """Entry ``index`` alone on ``batch`` (the contract's keyword arguments, as lists):
        ``{"score": weight x score (float64), "metrics": {"<name>/<key>": per-sample values}}``. The
        driver calls the entries one at a time (and sums them as :meth:`score` does), so that a time
        limit knows which function overran."""
        name, path, weight, kwargs, fn = self.entries[index]
        parts = self.call(path, fn, kwargs, batch, len(batch["responses"]))
        return {"score": weight * parts["score"], "metrics": {f"{name}/{k}": v for k, v in parts.items()}}
