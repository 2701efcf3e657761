"""The fake vLLM (``tests/support/fake_vllm``) held to the vLLM installed here, and its behaviour.

Against the installed vLLM (skipped where vLLM is not installed, or is not a 0.32 release, the
one the fake models): one subprocess imports the real package (the fake is also named ``vllm``,
so the two never share a process) and reports the facts as JSON: the adapter's ``LLM(...)`` and ``SamplingParams(...)`` keywords exist there; the
fake's ``LLM.__init__`` parameters, ``EngineArgs`` fields and ``SamplingParams`` fields exist there
with the same defaults; ``generate``, ``sleep``, ``wake_up``, ``collective_rpc`` and
``reset_prefix_cache`` have the same parameters; the fake's ``SamplingParams`` accepts and rejects
(same exception class) exactly what the real one does on a table of arguments, and normalises the
accepted ones alike; every name the adapter imports from vLLM exists there; the adapter's worker
extension clashes with no attribute of vLLM's workers.

Without vLLM: the fake's generation, request checks, sleep levels and wake-up tags, engine
arguments and ``collective_rpc`` (as modelled from vLLM 0.32's source, see the fake's modules),
and the adapter's offload / onload / weight push on it.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import logging
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from test_vllm_weight_paths import _hf_weights, _scaled, _spec, fake_vllm, restore_threads  # noqa: F401

ADAPTER = os.path.join(os.path.dirname(__file__), "..", "..", "..", "chatlearn", "models", "rollout", "vllm.py")
METHODS = ("generate", "sleep", "wake_up", "collective_rpc", "reset_prefix_cache")
MODELLED = "0.32.0"  # the fake's default release (its __version__)
NAN, INF = float("nan"), float("inf")

# (kwargs) for SamplingParams: accepted or rejected alike by the fake and the real one
SAMPLING_TABLE = [
    {}, {"n": 0}, {"n": 2}, {"n": 1.5}, {"n": "2"}, {"n": 2, "temperature": 0.0},
    {"temperature": -0.1}, {"temperature": 0.0}, {"temperature": 0.005}, {"temperature": 2.0},
    {"temperature": 2.5}, {"temperature": NAN}, {"temperature": INF}, {"temperature": "x"},
    {"top_p": 0.0}, {"top_p": 0.5}, {"top_p": 1.1}, {"top_p": 0.5, "temperature": 0.0},
    {"top_k": -1}, {"top_k": 0}, {"top_k": -2}, {"top_k": 5}, {"top_k": 1.5}, {"top_k": "x"},
    {"top_k": 5, "temperature": 0.0}, {"min_p": -0.1}, {"min_p": 0.5}, {"min_p": 1.5},
    {"presence_penalty": 2.0}, {"presence_penalty": 2.5}, {"presence_penalty": -2.5},
    {"frequency_penalty": 3.0}, {"frequency_penalty": -1.0}, {"repetition_penalty": 0.0},
    {"repetition_penalty": -1.0}, {"repetition_penalty": INF}, {"repetition_penalty": 1.5},
    {"max_tokens": 0}, {"max_tokens": -1}, {"max_tokens": None}, {"max_tokens": 1},
    {"min_tokens": -1}, {"min_tokens": 5, "max_tokens": 3}, {"min_tokens": 2, "max_tokens": 3},
    {"min_tokens": 5, "max_tokens": None}, {"logprobs": 0}, {"logprobs": -1}, {"logprobs": -2},
    {"logprobs": True}, {"logprobs": 5}, {"seed": -1}, {"seed": 7}, {"seed": "x"}, {"seed": 1.5},
    {"stop_token_ids": [1, 1, 2]}, {"stop_token_ids": [1, "a"]}, {"stop_token_ids": None},
    {"stop": ""}, {"stop": "a"}, {"stop": ["a", ""]}, {"stop": "a", "detokenize": False},
    {"ignore_eos": True}, {"skip_special_tokens": False}, {"detokenize": False},
    {"foo": 1}, {"best_of": 2}, {"use_beam_search": True},
]

REAL_FACTS = r'''
import dataclasses, importlib, inspect, json, sys
import msgspec
import vllm
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs

req = json.load(sys.stdin)
out = {"version": vllm.__version__}
def params(f):
    return [[p.name, p.kind.name, "<empty>" if p.default is p.empty else repr(p.default)]
            for p in inspect.signature(f).parameters.values() if p.name != "self"]
out["llm_init"] = params(LLM.__init__)
out["methods"] = {m: params(getattr(LLM, m)) for m in req["methods"]}
out["engine_args"] = {f.name: repr(f.default) if f.default is not dataclasses.MISSING else "<factory>"
                      for f in dataclasses.fields(EngineArgs)}
out["sampling_fields"] = {f.name: repr(f.default) if f.default is not msgspec.NODEFAULT else "<factory>"
                          for f in msgspec.structs.fields(SamplingParams)}
table = []
for kwargs in req["table"]:
    try:
        sp = SamplingParams(**kwargs)
    except Exception as e:
        table.append(["raise", type(e).__name__])
    else:
        table.append(["ok", {k: getattr(sp, k) for k in req["fields"]}])
out["table"] = table
missing = []
for module, name in req["imports"]:
    try:
        mod = importlib.import_module(module)
        if name is not None and not hasattr(mod, name):
            importlib.import_module(module + "." + name)
    except Exception as e:
        missing.append([module, name, repr(e)])
out["missing_imports"] = missing
ext = getattr(importlib.import_module("chatlearn.models.rollout.vllm"), "WorkerExtension")
clashes = {}
for module, cls in (("vllm.v1.worker.gpu_worker", "Worker"), ("vllm.v1.worker.cpu_worker", "CPUWorker")):
    worker = getattr(importlib.import_module(module), cls)
    clashes[cls] = [a for a in dir(ext) if not a.startswith("__") and hasattr(worker, a)]
out["clashes"] = clashes
from vllm.v1.executor.abstract import SLEEP_TAGS
out["sleep_tags"] = sorted(SLEEP_TAGS)
print("FACTS" + json.dumps(out, default=repr))
'''


# ------------------------------------------------------------------ the adapter's use of vLLM

def _adapter_tree() -> ast.Module:
    with open(ADAPTER, encoding="utf-8") as f:
        return ast.parse(f.read())


def _call_keywords(attr: str) -> set[str]:
    """Keywords of every call of ``<x>.{attr}(...)`` / ``{attr}(...)`` in the adapter; for ``LLM``
    also the keys of ``sizing[...]`` (passed as ``**sizing``)."""
    names: set[str] = set()
    for node in ast.walk(_adapter_tree()):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called == attr:
                names |= {k.arg for k in node.keywords if k.arg is not None}
        if attr == "LLM" and isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
                and node.value.id == "sizing" and isinstance(node.slice, ast.Constant):
            names.add(node.slice.value)
    return names


def _adapter_imports() -> list[list]:
    """``[module, name]`` of every ``from vllm... import name`` in the adapter, and the attributes
    of ``vllm`` it uses after ``import vllm``."""
    found = set()
    for node in ast.walk(_adapter_tree()):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            found |= {(node.module, a.name) for a in node.names}
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "vllm":
            found.add(("vllm", node.attr))
    return sorted([m, n] for m, n in found)


def _wake_up_tags() -> set[str]:
    tags = set()
    for node in ast.walk(_adapter_tree()):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "wake_up":
            for k in node.keywords:
                if k.arg == "tags" and isinstance(k.value, ast.List):
                    tags |= {e.value for e in k.value.elts}
    return tags


# ------------------------------------------------------------------ the fake's side

def _params(f) -> list[list[str]]:
    return [[p.name, p.kind.name, "<empty>" if p.default is p.empty else repr(p.default)]
            for p in inspect.signature(f).parameters.values() if p.name != "self"]


def _fake_sampling_fields(sp_cls) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(sp_cls) if f.init]


def _fake_outcome(sp_cls, kwargs: dict, fields: list[str]) -> list:
    try:
        sp = sp_cls(**kwargs)
    except Exception as e:  # noqa: BLE001 - the class is what is compared
        return ["raise", type(e).__name__]
    return ["ok", {k: getattr(sp, k) for k in fields}]


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """Facts of the installed vLLM, from one subprocess (the fake is not on its path)."""
    if importlib.util.find_spec("vllm") is None or "fake_vllm" in (importlib.util.find_spec("vllm").origin or ""):
        pytest.skip("vLLM is not installed (the fake is compared with the real package)")
    with fake_vllm():
        from vllm import SamplingParams as FakeSP

        fields = _fake_sampling_fields(FakeSP)
    request = {"methods": list(METHODS), "table": SAMPLING_TABLE, "fields": fields, "imports": _adapter_imports()}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    proc = subprocess.run([sys.executable, "-c", REAL_FACTS], input=json.dumps(request), capture_output=True,
                          text=True, env=env, cwd=str(tmp_path_factory.mktemp("real_vllm")), timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FACTS")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    facts = json.loads(lines[-1][len("FACTS"):])
    if facts["version"].split(".")[:2] != MODELLED.split(".")[:2]:
        pytest.skip(f"the fake models vLLM {MODELLED}; vLLM {facts['version']} is installed")
    return facts


# ------------------------------------------------------------------ against the installed vLLM

def test_the_adapter_passes_only_arguments_vllm_has(real):
    llm_names = {p[0] for p in real["llm_init"]} | set(real["engine_args"])
    used = _call_keywords("LLM")
    assert {"model", "enable_sleep_mode", "worker_extension_cls", "kv_cache_memory_bytes"} <= used  # parsed
    assert used <= llm_names, sorted(used - llm_names)
    sp_used = _call_keywords("SamplingParams")
    assert {"temperature", "logprobs", "seed"} <= sp_used
    assert sp_used <= set(real["sampling_fields"]), sorted(sp_used - set(real["sampling_fields"]))
    assert _wake_up_tags() and _wake_up_tags() <= set(real["sleep_tags"])
    assert real["missing_imports"] == []
    assert real["clashes"] == {"Worker": [], "CPUWorker": []}


def test_fake_llm_signatures_are_vllms(real):
    with fake_vllm():
        import vllm
        from vllm.engine.arg_utils import EngineArgs

        assert vllm.__version__ == MODELLED
        fake_init = _params(vllm.LLM.__init__)
        fake_methods = {m: _params(getattr(vllm.LLM, m)) for m in METHODS}
        fake_args = {f: repr(getattr(EngineArgs, f)) for f in EngineArgs.__dataclass_fields__}
    real_init = {p[0]: p for p in real["llm_init"]}
    for p in fake_init:
        assert real_init[p[0]] == p, (p, real_init.get(p[0]))  # same kind and default
    assert fake_init[-1][1] == "VAR_KEYWORD" == real["llm_init"][-1][1]
    for name, default in fake_args.items():
        assert real["engine_args"][name] == default, (name, default, real["engine_args"][name])
    for m in METHODS:
        assert fake_methods[m] == real["methods"][m], m


def test_fake_sampling_params_fields_are_vllms(real):
    with fake_vllm():
        from vllm import SamplingParams

        defaults = SamplingParams.__dataclass_fields__
        fields = {f: repr(defaults[f].default) for f in _fake_sampling_fields(SamplingParams)}
    assert {"n", "temperature", "top_p", "top_k", "max_tokens", "logprobs", "seed", "detokenize"} <= set(fields)
    for name, default in fields.items():
        assert real["sampling_fields"][name] == default, (name, default)
    assert _call_keywords("SamplingParams") <= set(fields)


def test_fake_sampling_params_accept_and_reject_as_vllm(real):
    with fake_vllm():
        from vllm import SamplingParams

        fields = _fake_sampling_fields(SamplingParams)
        fake = [_fake_outcome(SamplingParams, dict(kw), fields) for kw in SAMPLING_TABLE]
    assert len(real["table"]) == len(SAMPLING_TABLE)
    kinds = {o[0] for o in real["table"]}
    assert kinds == {"ok", "raise"}
    for kwargs, want, got in zip(SAMPLING_TABLE, real["table"], fake):
        assert got[0] == want[0] and (got[1] == want[1] if got[0] == "raise" else True), (kwargs, want, got)
        if got[0] == "ok":
            for name in fields:
                assert _same(got[1][name], want[1][name]), (kwargs, name, want[1][name], got[1][name])


# ------------------------------------------------------------------ the fake's behaviour

def _llm(path: str, **kw):
    import vllm

    return vllm.LLM(path, **{"max_model_len": 24, "max_num_seqs": 4, "enable_sleep_mode": True,
                             "logprobs_mode": "processed_logprobs", **kw})


def _ids(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def test_generate_depends_on_prompt_seed_and_request(tiny_model_dir):
    with fake_vllm():
        from vllm import SamplingParams

        llm = _llm(tiny_model_dir)
        sp = SamplingParams(max_tokens=6, seed=5, logprobs=2, ignore_eos=True)
        first = llm.generate([{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [6, 7]}], sp)
        assert _ids(first) == _ids(llm.generate([[3, 4, 5], [6, 7]], [sp, sp]))  # seeded: repeatable
        assert _ids(first)[0] != _ids(first)[1]
        assert _ids(first) != _ids(llm.generate([[3, 4, 5], [6, 7]], SamplingParams(max_tokens=6, seed=6)))
        out = first[0]
        comp = out.outputs[0]
        assert out.prompt_token_ids == [3, 4, 5] and out.finished and [o.request_id for o in first] == ["0", "1"]
        assert len(comp.token_ids) == 6 and comp.finish_reason == "length" and comp.stop_reason is None
        assert len(comp.logprobs) == 6
        for step, token in zip(comp.logprobs, comp.token_ids):
            assert token in step and 1 <= len(step) <= 3 and step[token].logprob <= 0
            assert {1, 2} <= {e.rank for e in step.values()}  # the top 2, and the sampled token's rank
        total = sum(step[t].logprob for step, t in zip(comp.logprobs, comp.token_ids))
        assert comp.cumulative_logprob == pytest.approx(total)
        plain = llm.generate([[3]], SamplingParams(max_tokens=2))[0].outputs[0]
        assert plain.logprobs is None and plain.cumulative_logprob is None and len(plain.token_ids) <= 2
        many = llm.generate([[3]], SamplingParams(n=3, max_tokens=4, seed=1, ignore_eos=True))[0].outputs
        assert [c.index for c in many] == [0, 1, 2] and len({tuple(c.token_ids) for c in many}) == 3
        greedy = [_ids(llm.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=5, seed=s))) for s in (1, 2)]
        assert greedy[0] == greedy[1]


def test_stop_token_ids_eos_and_max_model_len(tiny_model_dir, tmp_path):
    with fake_vllm():
        from vllm import SamplingParams

        llm = _llm(tiny_model_dir)
        greedy = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
        run = _ids(llm.generate([[3, 4]], SamplingParams(**greedy)))[0]
        k = next(i for i in range(1, len(run)) if run[i] not in run[:i])
        stopped = llm.generate([[3, 4]], SamplingParams(**greedy, stop_token_ids=[run[k]]))[0].outputs[0]
        assert stopped.token_ids == run[:k + 1] and stopped.finish_reason == "stop" and stopped.stop_reason == run[k]
        capped = llm.generate([list(range(3, 23))], SamplingParams(max_tokens=None, ignore_eos=True))[0].outputs[0]
        assert len(capped.token_ids) == 4 and capped.finish_reason == "length"  # 20 + 4 = max_model_len
        # the same weights with that token as EOS (config.json, generation_config.json)
        folder = tmp_path / "eos"
        shutil.copytree(tiny_model_dir, folder)
        for name in ("config.json", "generation_config.json"):
            config = json.loads((folder / name).read_text())
            (folder / name).write_text(json.dumps({**config, "eos_token_id": run[k]}))
        eos = _llm(str(folder))
        ended = eos.generate([[3, 4]], SamplingParams(temperature=0.0, max_tokens=10))[0].outputs[0]
        assert ended.token_ids == run[:k + 1] and ended.finish_reason == "stop" and ended.stop_reason is None
        assert _ids(eos.generate([[3, 4]], SamplingParams(**greedy)))[0] == run  # ignore_eos


def test_generate_refuses_what_vllm_refuses(tiny_model_dir):
    with fake_vllm():
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError

        llm = _llm(tiny_model_dir)
        sp = SamplingParams(max_tokens=2)
        for prompt in ([], list(range(24)), list(range(25)), [3, 320], [-1, 3]):
            with pytest.raises(VLLMValidationError):
                llm.generate([prompt], sp)
        for bad in (SamplingParams(logprobs=21), SamplingParams(logprobs=-1), SamplingParams(stop_token_ids=[320])):
            with pytest.raises(VLLMValidationError):
                llm.generate([[3]], bad)
        with pytest.raises(VLLMValidationError, match="lengths of prompts"):
            llm.generate([[3], [4]], [sp])
        with pytest.raises(RuntimeError, match="manual_seed"):
            llm.generate([[3]], SamplingParams(seed="x", max_tokens=2))
        assert llm.generate([[3]], SamplingParams(seed="x", temperature=0.0, max_tokens=2))  # greedy: no generator
        assert len(llm.generate([list(range(23))], sp)[0].outputs[0].token_ids) == 1  # room for one token


def test_sleep_level_1_offloads_weights_and_drops_the_kv_cache(tiny_model_dir):
    with fake_vllm():
        from vllm import SamplingParams

        llm = _llm(tiny_model_dir)
        greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        before = _ids(llm.generate([[3, 4]], greedy))
        model, kv = llm.worker.model_runner.get_model(), llm.worker.model_runner.kv_caches
        llm.sleep(level=1)
        assert torch.isnan(kv[0]).all() and torch.isnan(model.model.norm.weight).all()  # released
        with pytest.raises(RuntimeError, match="paused"):
            llm.generate([[3, 4]], greedy)
        with pytest.raises(RuntimeError, match="illegal memory access"):  # a push into sleeping weights
            llm.collective_rpc(lambda worker: worker.model_runner.model.load_weights(
                iter([("model.norm.weight", torch.ones(128))])))
        assert llm.wake_up(tags=["weights"]) is False  # the KV cache still sleeps: still paused
        assert not torch.isnan(model.model.norm.weight).any()  # the host copy is back
        with pytest.raises(RuntimeError, match="paused"):
            llm.generate([[3, 4]], greedy)
        assert llm.wake_up(tags=["kv_cache"]) is True
        assert _ids(llm.generate([[3, 4]], greedy)) == before


def test_sleep_level_2_needs_every_weight_loaded_again(tiny_model_dir):
    with fake_vllm():
        from vllm import SamplingParams

        llm = _llm(tiny_model_dir)
        greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        before = _ids(llm.generate([[3, 4]], greedy))
        hf = _hf_weights(tiny_model_dir)
        llm.sleep(level=2)
        assert llm.wake_up() is True
        with pytest.raises(RuntimeError, match="uninitialised"):
            llm.generate([[3, 4]], greedy)
        model = llm.worker.model_runner.get_model()
        model.load_weights(iter([(k, v) for k, v in hf.items() if "layers.1." not in k]))
        with pytest.raises(RuntimeError, match="model.layers.1"):
            llm.generate([[3, 4]], greedy)
        model.load_weights(iter(hf.items()))
        assert _ids(llm.generate([[3, 4]], greedy)) == before
        model.load_weights(iter(_scaled(hf, 2.0).items()))
        assert _ids(llm.generate([[3, 4]], greedy)) != before  # the output follows the weights


def test_wake_up_tags_as_vllm(tiny_model_dir, caplog):
    with fake_vllm():
        llm = _llm(tiny_model_dir)
        executor = llm.llm_engine.model_executor
        caplog.set_level(logging.WARNING, logger="vllm.v1.executor.abstract")
        assert llm.wake_up() is True and "Executor is not sleeping." in caplog.text
        llm.sleep(level=1)
        llm.sleep(level=1)
        assert "already sleeping" in caplog.text
        assert llm.wake_up(tags=["weight"]) is False  # misspelt: a warning, nothing woken
        assert "Tag weight is not in sleeping tags" in caplog.text and executor.sleeping_tags == {"weights", "kv_cache"}
        assert llm.wake_up(tags=["weights", "scheduling"]) is False and executor.sleeping_tags == {"kv_cache"}
        assert llm.wake_up(tags=["weights", "kv_cache"]) is False  # weights are awake: the whole call is ignored
        assert executor.sleeping_tags == {"kv_cache"}
        assert llm.wake_up(tags=["kv_cache"]) is True and llm.llm_engine.is_sleeping() is False
        llm.sleep(level=0)  # the scheduler only
        assert llm.llm_engine.is_sleeping() and not executor.sleeping_tags
        assert llm.wake_up(tags=["scheduling"]) is True
        for mode in ("wait", "later"):
            with pytest.raises(ValueError):
                llm.sleep(level=1, mode=mode)


def test_without_sleep_mode_sleep_frees_nothing(tiny_model_dir):
    with fake_vllm():
        from vllm import SamplingParams

        llm = _llm(tiny_model_dir, enable_sleep_mode=False)
        greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        before = _ids(llm.generate([[3, 4]], greedy))
        llm.sleep(level=2)
        assert not torch.isnan(llm.worker.model_runner.get_model().model.norm.weight).any()
        assert llm.wake_up() is True
        assert _ids(llm.generate([[3, 4]], greedy)) == before


def test_engine_arguments_checked_as_vllm(tiny_model_dir, tmp_path):
    with fake_vllm():
        with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_sequences'"):
            _llm(tiny_model_dir, max_num_sequences=4)
        for bad in ({"logprobs_mode": "logprobs"}, {"gpu_memory_utilization": 1.5}, {"max_model_len": 1000},
                    {"dtype": "fp32"}, {"max_num_batched_tokens": 2}, {"kv_cache_memory_bytes": 2048},
                    {"distributed_executor_backend": "threads"}):
            with pytest.raises(ValueError):
                _llm(tiny_model_dir, **bad)
        empty = tmp_path / "no_weights"
        empty.mkdir()
        shutil.copy(os.path.join(tiny_model_dir, "config.json"), empty / "config.json")
        with pytest.raises(RuntimeError, match="Cannot find any model weights"):
            _llm(str(empty))


class ClashingExtension:
    def sleep(self, level: int = 1) -> None:  # the worker's own method
        raise AssertionError("never installed")


def test_collective_rpc_and_worker_extension(tiny_model_dir):
    with fake_vllm():
        llm = _llm(tiny_model_dir)
        with pytest.raises(NotImplementedError, match="not implemented"):
            llm.collective_rpc("chatlearn_no_such_method")
        assert llm.collective_rpc(lambda worker, x: (x, worker.device.type), args=(2,)) == [(2, "cpu")]
        with pytest.raises(AssertionError, match="conflicts with the worker extension"):
            _llm(tiny_model_dir, worker_extension_cls=f"{__name__}.ClashingExtension")
    with fake_vllm(multiprocess=True):
        llm = _llm(tiny_model_dir)
        with pytest.raises(TypeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
            llm.collective_rpc(lambda worker: None)
        with pytest.raises(NotImplementedError, match="not implemented"):
            llm.collective_rpc("chatlearn_no_such_method")
        assert llm.collective_rpc("wake_up", kwargs={"tags": ("weights",)}) == [None]  # a tuple crosses as a list


def test_adapter_offload_push_onload_on_the_fake(tiny_model_dir, restore_threads):
    """The adapter's sleep-mode calls against the fake's sleep levels and tags: a full offload,
    a push between the two wake steps, and the KV cache alone."""
    from chatlearn.models.rollout.vllm import VLLMRollout

    greedy = {"temperature": 0.0, "max_tokens": 3}
    hf = _hf_weights(tiny_model_dir)
    with fake_vllm():
        rollout = VLLMRollout(_spec(tiny_model_dir))
        engine = rollout.llm.llm_engine
        before = rollout.generate([[3, 4]], greedy)["tokens"]
        assert rollout.offload(["weights", "kv_cache"])["bytes"] > 0
        assert engine.model_executor.sleeping_tags == {"weights", "kv_cache"}
        rollout.onload(["weights"])
        assert engine.model_executor.sleeping_tags == {"kv_cache"} and engine.paused
        rollout.begin_weight_update()
        rollout.load_weight_bucket([(k, v) for k, v in _scaled(hf, 2.0).items() if k != "lm_head.weight"])
        rollout.finish_weight_update()
        rollout.onload(["kv_cache"])
        assert not engine.is_sleeping()
        assert list(rollout.generate([[3, 4]], greedy)["tokens"]) != list(before)
        rollout.offload(["kv_cache"])
        assert engine.model_executor.sleeping_tags == {"kv_cache"}
        with pytest.raises(RuntimeError, match="onload"):
            rollout.generate([[3, 4]], greedy)
        rollout.offload(["weights"])
        rollout.onload(["weights", "kv_cache"])
        rollout.begin_weight_update()
        rollout.load_weight_bucket(list(hf.items()))
        rollout.finish_weight_update()
        assert list(rollout.generate([[3, 4]], greedy)["tokens"]) == list(before)


def test_adapter_refuses_what_vllm_032_would_change_or_refuse(tiny_model_dir, restore_threads):
    """A temperature in (0, 0.01), which vLLM samples at 0.01 (the log-probs would not be the
    trainer's), and a tied ``lm_head.weight`` in a bucket without the embedding, which vLLM 0.32's
    loader refuses (the trainers never send it)."""
    from chatlearn.models.rollout.vllm import VLLMRollout

    hf = _hf_weights(tiny_model_dir)
    with fake_vllm():
        from vllm import SamplingParams

        assert SamplingParams(temperature=0.005).temperature == 0.01  # what the adapter avoids
        rollout = VLLMRollout(_spec(tiny_model_dir))
        with pytest.raises(ValueError, match="temperature 0.005"):
            rollout.generate([[3, 4]], {"temperature": 0.005, "max_tokens": 3})
        assert rollout.llm.requests == []
        rollout.generate([[3, 4]], {"temperature": 0.01, "max_tokens": 3})
        rollout.begin_weight_update()
        with pytest.raises(ValueError, match="tied"):
            rollout.load_weight_bucket([("lm_head.weight", hf["model.embed_tokens.weight"].clone())])
        rollout.load_weight_bucket([("model.embed_tokens.weight", hf["model.embed_tokens.weight"].clone()),
                                    ("lm_head.weight", hf["model.embed_tokens.weight"].clone())])
        rollout.finish_weight_update()
