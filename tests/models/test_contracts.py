"""The backend contracts of ``chatlearn.models.base``: each base class declares every method the
runtime calls on its backends, a backend that misses an abstract one fails when it is built, and
every backend the runtime can start implements them all.

The runtime's calls are found in its source (``chatlearn/runtime/**/*.py``), not listed here: method
names passed as strings to a worker group's ``call`` / ``call_each`` / ``call_async``, the
scheduler's ``offload`` / ``onload`` moves, and the weight push endpoint's ``self.obj.<name>``.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import os
import re

import pytest

from chatlearn.models.base import JudgingModel, Model, Reward, Rollout, ScoringModel, Trainer

RUNTIME = os.path.join(os.path.dirname(__file__), "..", "..", "chatlearn", "runtime")
CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "chatlearn", "config")
BASES = {"Trainer": Trainer, "Rollout": Rollout, "Reward": Reward, "ScoringModel": ScoringModel,
         "JudgingModel": JudgingModel, "Model": Model}
BACKENDS = ["chatlearn.models.trainer.fsdp:FSDPTrainer",
            "chatlearn.models.trainer.megatron:MegatronTrainer",
            "chatlearn.models.rollout.hf:HFRollout",
            "chatlearn.models.rollout.vllm:VLLMRollout",
            "chatlearn.models.rollout.sglang:SGLangRollout",
            "chatlearn.models.reward.functions:RewardManager",
            "chatlearn.models.reward.model:RewardModel"]


# ------------------------------------------------------------------ (a) missing methods fail early

def _complete(base: type) -> type:
    """A subclass of ``base`` that implements every abstract method (doing nothing)."""
    return type(f"Complete{base.__name__}", (base,),
                {name: (lambda self, *a, **k: None) for name in base.__abstractmethods__})


@pytest.mark.parametrize("base", [Trainer, Rollout, Reward, ScoringModel, JudgingModel], ids=lambda b: b.__name__)
def test_a_backend_missing_an_abstract_method_fails_at_instantiation(base):
    _complete(base)()  # all of them: it builds
    assert base.__abstractmethods__
    for missing in sorted(base.__abstractmethods__):
        methods = {n: (lambda self, *a, **k: None) for n in base.__abstractmethods__ if n != missing}
        partial = type(f"Partial{base.__name__}", (base,), methods)
        with pytest.raises(TypeError, match=missing):
            partial()


def test_the_declared_contracts():
    """The methods the issue named are declared, abstract where a backend must implement them."""
    assert {"offload", "onload"} <= Model.__abstractmethods__
    assert {"train", "compute_logprobs", "compute_grads", "logprob_stats"}.isdisjoint(Trainer.__abstractmethods__)
    assert {"save_checkpoint", "load_checkpoint", "save_hf", "weight_specs", "export_tensors",
            "_accumulate_grads", "_logprob_pass", "_micro_batches", "_set_lr", "_clip_and_step",
            "zero_grad", "_optimizer_steps"} <= Trainer.__abstractmethods__
    assert "temperature" in inspect.signature(Trainer.train).parameters
    assert {"generate", "begin_weight_update", "load_weight_bucket",
            "finish_weight_update"} <= Rollout.__abstractmethods__
    assert not hasattr(Rollout, "update_weights")
    assert Reward.__abstractmethods__ == {"score", "score_one"}


def test_slot_methods_are_declared_and_refuse_unless_the_backend_maps_slots():
    """The CUDA IPC slot methods: documented on the base, off by default (``maps_weight_slots``
    False: the weight push hands such a backend buckets), and calling one on a backend without them
    raises NotImplementedError naming the backend; vLLM provides them."""
    rollout = _complete(Rollout)()
    assert "cuda_ipc" in Rollout.attach_weight_slots.__doc__ and rollout.maps_weight_slots is False
    for name, args in (("attach_weight_slots", ({},)), ("load_weight_slot", (0, [])), ("detach_weight_slots", ())):
        assert getattr(Rollout, name).__doc__
        with pytest.raises(NotImplementedError, match=f"CompleteRollout.{name}: .*maps_weight_slots is False"):
            getattr(rollout, name)(*args)
    vllm = pytest.importorskip("chatlearn.models.rollout.vllm")
    assert vllm.VLLMRollout.maps_weight_slots is True
    for name in ("attach_weight_slots", "load_weight_slot", "detach_weight_slots"):
        assert getattr(vllm.VLLMRollout, name) is not getattr(Rollout, name), name


# ------------------------------------------------------------------ (b) what the runtime calls

def _runtime_files() -> list[str]:
    """Every module of ``chatlearn/runtime/`` (its rooms' folders too), relative to it."""
    return sorted(os.path.relpath(os.path.join(root, name), RUNTIME)
                  for root, _, names in os.walk(RUNTIME) for name in names if name.endswith(".py"))


def _sources() -> dict[str, ast.Module]:
    out = {}
    for name in _runtime_files():
        with open(os.path.join(RUNTIME, name), encoding="utf-8") as f:
            out[name] = ast.parse(f.read())
    return out


def _base_of(receiver: str) -> str | None:
    """Which backends a worker group expression holds, by its name (``self.trainer``,
    ``self.ref``, ``self.policy``, ``self.reward``); None when the name does not tell."""
    receiver = receiver.lower()
    if "trainer" in receiver or "ref" in receiver:
        return "Trainer"
    if "policy" in receiver:
        return "Rollout"
    if "reward" in receiver:
        return "Reward"
    return None


def _group_calls() -> list[tuple[str, str | None, str]]:
    """``(method, base or None, where)`` of every group call with a method name given as a string,
    and of the scheduler's moves (``self._move(name, "offload", parts)``: every placed model)."""
    calls = []
    for file, tree in _sources().items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            attr, args = node.func.attr, node.args
            if attr in ("call", "call_each", "call_async") and args and isinstance(args[0], ast.Constant) \
                    and isinstance(args[0].value, str):
                calls.append((args[0].value, _base_of(ast.unparse(node.func.value)), f"{file}:{node.lineno}"))
            elif attr == "_move" and len(args) > 1 and isinstance(args[1], ast.Constant):
                calls.append((args[1].value, "Model", f"{file}:{node.lineno}"))
    return calls


def _endpoint_uses() -> list[tuple[str, str, str]]:
    """``(attribute, base, where)`` of every ``self.obj.<attribute>`` in the weight push's
    ``Endpoint``: trainer side before the ``# -- rollout side`` marker, rollout side after it; and of
    every ``trainer.<attribute>`` / ``rollout.<attribute>`` in the module's functions that take them
    (``gather_bucket``, ``local_push``)."""
    path = os.path.join(RUNTIME, "weight_push", "stream.py")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.splitlines()
    marker = next(i + 1 for i, line in enumerate(lines) if line.strip().startswith("# -- rollout side"))
    endpoint = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.name == "Endpoint")
    uses = []
    for node in ast.walk(endpoint):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "obj" and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "self"):
            uses.append((node.attr, "Trainer" if node.lineno < marker else "Rollout",
                         f"weight_push/stream.py:{node.lineno}"))
    sides = {"trainer": "Trainer", "rollout": "Rollout"}
    for fn in ast.parse(text).body:
        if not isinstance(fn, ast.FunctionDef) or not {a.arg for a in fn.args.args} & set(sides):
            continue
        for node in ast.walk(fn):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in sides):
                uses.append((node.attr, sides[node.value.id], f"weight_push/stream.py:{node.lineno}"))
    return uses


def _declared(base: type, name: str) -> bool:
    return hasattr(base, name) or any(name in getattr(k, "__annotations__", {}) for k in base.__mro__)


def test_every_method_the_runtime_calls_is_declared_on_its_base():
    calls = _group_calls() + _endpoint_uses()
    found = {name for name, _, _ in calls}
    # the scan sees the calls it is meant to see (else it would check nothing)
    assert {"generate", "score_one", "compute_logprobs", "train", "save_checkpoint", "load_checkpoint",
            "logprob_stats", "offload", "onload", "push_view", "device", "rank",
            "begin_weight_update", "load_weight_bucket", "finish_weight_update",
            "attach_weight_slots", "load_weight_slot", "detach_weight_slots"} <= found, found
    undeclared = []
    for name, base, where in calls:
        bases = [BASES[base]] if base else [Trainer, Rollout, Reward, ScoringModel, JudgingModel]
        if not any(_declared(b, name) for b in bases):
            undeclared.append(f"{name} ({where}, on {base or 'a backend'})")
    assert not undeclared, f"the runtime calls methods no base class declares: {undeclared}"


# ------------------------------------------------------------------ (c) the backends are complete

def _all_backends() -> list[str]:
    """The explicit list, plus every ``chatlearn.models...:Class`` factory the runtime or the
    config names."""
    found = set(BACKENDS)
    files = [os.path.join(RUNTIME, name) for name in _runtime_files()]
    files += [os.path.join(CONFIG, name) for name in os.listdir(CONFIG) if name.endswith(".py")]
    for path in files:
        with open(path, encoding="utf-8") as f:
            found |= set(re.findall(r"chatlearn\.models\.[\w.]+:[A-Z]\w*", f.read()))
    return sorted(found)


@pytest.mark.parametrize("factory", _all_backends())
def test_every_backend_implements_its_contract(factory):
    module, name = factory.split(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError as err:  # the backend's library is not installed here
        pytest.skip(f"{module}: {err}")
    bases = [b for b in (Trainer, Rollout, Reward, ScoringModel, JudgingModel) if issubclass(cls, b)]
    assert len(bases) == 1, f"{factory} must derive from one of Trainer, Rollout, Reward, ScoringModel, JudgingModel"
    assert not inspect.isabstract(cls), f"{factory} leaves {sorted(cls.__abstractmethods__)} unimplemented"
    assert not hasattr(cls, "update_weights")
