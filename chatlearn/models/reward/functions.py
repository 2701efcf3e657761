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

import contextlib
import math
import numbers
import os
import threading
import traceback
from typing import TYPE_CHECKING, Callable

import numpy as np

# the entries' parsing and checks live in the config layer (validation runs them); imported
# from here too by the runtime
from chatlearn.config.reward_entries import (  # noqa: F401
    NAME_RE,
    check_functions,
    check_signature,
    describe_error,
    load_function,
    resolve_entries,
)
from chatlearn.errors import UserError
from chatlearn.models.base import Reward
from chatlearn.models.reward import math_reward

if TYPE_CHECKING:
    from chatlearn.models.specs import RewardSpec


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


class _ProcessExit(BaseException):
    """``os._exit(code)`` called by a reward function: raised in its place (see :func:`_exits_refused`)."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def _exits_refused():
    """While a reward function runs in this thread of this process, ``os._exit`` raises
    :class:`_ProcessExit` instead of ending the reward worker (whose death Ray would report as a
    crash or the OOM killer, without the function's name). Other threads, and child processes the
    function forks (multiprocessing ends each with ``os._exit``), exit as usual."""
    real, pid, thread = os._exit, os.getpid(), threading.get_ident()

    def refuse(code):
        if os.getpid() != pid or threading.get_ident() != thread:
            real(code)
        raise _ProcessExit(code)

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


def _exit_error(entry: str, how: str, code) -> UserError:
    return UserError(f"the reward worker exited while scoring: {entry} called {how}({code!r}), which "
                     f"ends the worker's process (exit code {code!r}), so the run stops. A reward function must return one "
                     "number per sample; report a failed sample with a score (such as 0.0), or raise an "
                     "exception to stop the run with its message.")


class RewardManager(Reward):
    """The reward backend (:class:`chatlearn.models.base.Reward`): one reward worker, built from a
    :class:`~chatlearn.models.specs.RewardSpec`: its ``functions`` are the full, explicit list of
    entries (name, path, weight, kwargs); its ``base_dir`` is the directory relative paths start from."""

    def __init__(self, spec: RewardSpec):
        self.entries = []
        for i, e in enumerate(spec.functions):
            key = f"models.reward.functions[{i}].path"
            fn = load_function(e["path"], key=key, base_dir=spec.base_dir)
            check_signature(fn, e["path"], dict(e["kwargs"]), key)
            self.entries.append((e["name"], e["path"], float(e["weight"]), dict(e["kwargs"]), fn))
        if any(getattr(fn, "__module__", None) == math_reward.__name__ for *_, fn in self.entries):
            # math-verify (sympy, its LaTeX parser) takes about a second to import: imported now, on a
            # thread, while the other models are built and the first responses sampled, instead of
            # inside the first episode's reward stage
            threading.Thread(target=math_reward.warm_math_verify, name="warm-math-verify", daemon=True).start()

    def call(self, path: str, fn: Callable, kwargs: dict, batch: dict, n: int,
             entry: str = "") -> dict[str, np.ndarray]:
        """Run one function on the batch; its per-sample outputs by key (``score`` and the logged keys).
        ``entry``: the function as the config names it (for the error of a function that ends the process)."""
        try:
            with _exits_refused():
                out = fn(**batch, **kwargs)
        except _ProcessExit as stop:
            raise _exit_error(entry or f"reward function {path!r}", "os._exit", stop.code) from None
        except SystemExit as stop:  # sys.exit() or exit(): Ray would end the worker
            raise _exit_error(entry or f"reward function {path!r}", "sys.exit", stop.code) from None
        except Exception as err:  # the user's code: report what it raised and where
            frames = _user_frames(err)
            raise UserError(f"reward function {path!r} raised {describe_error(err)}"
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
        entry = f"reward function {name!r} (models.reward.functions[{index}], {path!r})"
        parts = self.call(path, fn, kwargs, batch, len(batch["responses"]), entry)
        return {"score": weight * parts["score"], "metrics": {f"{name}/{k}": v for k, v in parts.items()}}
