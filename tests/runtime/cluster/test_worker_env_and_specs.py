"""The GPU worker environment (set before the process starts, one place), the typed specs every
backend receives (built once from the validated config; device-dependent settings resolved in
the worker), and no `.get(key, default)` left in the runtime and the backends."""
from __future__ import annotations

import dataclasses
import os
import re
import time

import pytest
import ray
import torch

from chatlearn.config import load as config_load
from chatlearn.config.plan import make_plan
from chatlearn.models.specs import RolloutSpec, TrainerSpec, resolve_for_device
from chatlearn.runtime.cluster.worker_env import worker_env
from conftest import REPO

TEMPLATE = os.path.join(REPO, "template", "grpo_fsdp.yaml")


# ------------------------------------------------------------------ environment

def test_worker_env_is_consistent_between_trainer_and_engine(monkeypatch):
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    trainer = worker_env("trainer", "megatron", 4)
    engine = worker_env("rollout", "vllm", 4)
    # vLLM sets NCCL_CUMEM_ENABLE=0 at import unless set; the trainer that broadcasts to it agrees
    assert trainer["NCCL_CUMEM_ENABLE"] == engine["NCCL_CUMEM_ENABLE"] == "0"
    assert trainer["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # Megatron: before CUDA starts
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in worker_env("trainer", "fsdp", 4)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in engine
    assert "NCCL_CUMEM_ENABLE" not in worker_env("reward", "reward", 1)
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")  # the user's choice reaches both sides
    assert worker_env("trainer", "fsdp", 1)["NCCL_CUMEM_ENABLE"] == worker_env("rollout", "sglang", 1)[
        "NCCL_CUMEM_ENABLE"] == "1"


def test_expandable_segments_only_for_trainers_that_ask(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    env = worker_env("trainer", "fsdp", 1, expandable_segments=True)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:256,expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in worker_env("trainer", "fsdp", 1)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in worker_env("rollout", "vllm", 1, expandable_segments=True)


@pytest.mark.timeout(180)
def test_workers_start_with_their_environment(monkeypatch):
    """The variables are in the process before any code of the worker runs (Ray's runtime_env),
    not set later from inside it."""
    from chatlearn.runtime.cluster.group import create_group

    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, logging_level="WARNING")
    try:
        env = worker_env("trainer", "megatron", 1, expandable_segments=True)
        group = create_group("probe", "collections:OrderedDict", {}, num_actors=1, pg=None, bundles=[0],
                             gpu_fraction=0, cpus=0.1, threads=1, distributed=False, env=env)
        started = ray.get(group.actors[0].environment.remote())
        for key in ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_CUMEM_ENABLE", "PYTORCH_CUDA_ALLOC_CONF",
                    "OMP_NUM_THREADS"):
            assert started[key] == env[key], key
    finally:
        ray.shutdown()


def test_megatron_trainer_does_not_set_cuda_env_itself():
    """One place sets the GPU worker environment: no backend sets CUDA/NCCL variables."""
    pattern = re.compile(r"os\.environ(\.setdefault\(|\[)\s*\"(CUDA_|NCCL_|PYTORCH_CUDA)")
    found = []
    for root, _, files in os.walk(os.path.join(REPO, "chatlearn", "models")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with open(path, encoding="utf-8") as f:
                    found += [f"{path}:{i}" for i, line in enumerate(f, 1) if pattern.search(line)]
    assert not found, found


# ------------------------------------------------------------------ specs

def _cfg(paths_overrides, *extra):
    return config_load.load_config(TEMPLATE, paths_overrides + list(extra))


def test_specs_carry_every_setting_from_the_schema(paths_overrides):
    cfg = _cfg(paths_overrides, "models.policy_trainer.logprob_chunk_tokens=77",
               "models.policy_trainer.meta_init=true", "models.policy.deterministic_inference=false")
    t = TrainerSpec.from_config(cfg, "policy_trainer", make_plan(cfg))
    r = RolloutSpec.from_config(cfg)
    assert isinstance(t, TrainerSpec) and isinstance(r, RolloutSpec)
    assert t.logprob_chunk_tokens == 77 and t.meta_init is True and t.bf16 is None
    assert r.deterministic_inference is False and r.dtype == "auto"
    assert r.gpu_memory_utilization == cfg.models.policy.gpu_memory_utilization == 0.8
    assert r.generation_batch_size == cfg.models.policy.generation_batch_size
    with pytest.raises(TypeError):  # no mapping: a setting is read as an attribute, never by a string
        t["lr"]
    assert not hasattr(t, "keys") and not hasattr(t, "get")  # no dict(spec), no fallback default to reach for
    assert t.replace(lr=0.5).lr == 0.5 and t.replace(lr=0.5).kl_coef == t.kl_coef
    with pytest.raises(TypeError):  # every field must be given: the specs have no defaults of their own
        TrainerSpec(load="x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.lr = 1.0


def test_device_dependent_settings_resolve_in_the_worker(paths_overrides, monkeypatch, tiny_model_dir):
    from chatlearn.models import specs

    cfg = _cfg(paths_overrides)
    t, r = TrainerSpec.from_config(cfg, "policy_trainer", make_plan(cfg)), RolloutSpec.from_config(cfg)
    cpu_r, cpu_t = resolve_for_device(r, "cpu"), resolve_for_device(t, "cpu")
    assert cpu_r.device == "cpu" and cpu_r.dtype == "float32"  # the checkpoint's dtype
    assert cpu_r.deterministic_inference is True and cpu_t.bf16 is False
    monkeypatch.setattr(specs, "_cuda_bf16", lambda: True)
    gpu_r, gpu_t = resolve_for_device(r, "cuda"), resolve_for_device(t, "cuda")
    assert gpu_r.dtype == "bfloat16" and gpu_r.deterministic_inference is False and gpu_t.bf16 is True
    monkeypatch.setattr(specs, "_cuda_bf16", lambda: False)  # e.g. a V100
    assert resolve_for_device(t, "cuda").bf16 is False
    # an explicit choice is kept on every device
    fixed = r.replace(dtype="float16", deterministic_inference=True)
    assert resolve_for_device(fixed, "cuda").dtype == "float16"
    assert resolve_for_device(fixed, "cuda").deterministic_inference is True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_defaults_on_a_real_gpu_are_bf16_and_fast(paths_overrides, backend):
    """The default config on this machine's GPU, for each rollout backend installed here (the config
    refuses a backend that is not): rollout and trainer in bf16 where the GPU has it (float16 / fp32
    where not), no per-request seeds."""
    import importlib.util

    if backend != "hf" and importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed here (the hf case checks the same defaults)")
    cfg = _cfg(paths_overrides, f"runtime_args.rollout_backend={backend}")
    r = resolve_for_device(RolloutSpec.from_config(cfg), "cuda")
    t = resolve_for_device(TrainerSpec.from_config(cfg, "policy_trainer", make_plan(cfg)), "cuda")
    bf16 = torch.cuda.is_bf16_supported()
    assert r.dtype == ("bfloat16" if bf16 else "float32") and t.bf16 is bf16
    assert r.deterministic_inference is False and r.device == t.device == "cuda"


def test_chunk_tokens_must_be_positive(paths_overrides):
    from chatlearn.config.load import ConfigError

    with pytest.raises(ConfigError) as err:
        _cfg(paths_overrides, "models.policy_trainer.logprob_chunk_tokens=0")
    assert err.value.key == "models.policy_trainer.logprob_chunk_tokens"


def test_no_get_with_a_default_in_runtime_and_backends():
    """Defaults live in the schema only: `x.get(key, default)` is not used in chatlearn/models
    and chatlearn/runtime (ray.get is not a lookup)."""
    pattern = re.compile(r"(?<!ray)\.get\([^()]*,")
    found = []
    for sub in ("models", "runtime"):
        for root, _, files in os.walk(os.path.join(REPO, "chatlearn", sub)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    with open(path, encoding="utf-8") as f:
                        found += [f"{os.path.relpath(path, REPO)}:{i}: {line.strip()}"
                                  for i, line in enumerate(f, 1) if pattern.search(line)]
    assert not found, "\n".join(found)


PRELOAD_MODULE = '''
import os, time
open(os.path.join(os.environ["MARKS"], f"imported-{os.getpid()}"), "w").write(str(time.time()))


def prestart():
    open(os.path.join(os.environ["MARKS"], f"prestarted-{os.getpid()}"), "w").write(str(time.time()))


class Thing:
    def __init__(self, cfg):
        open(os.path.join(os.environ["MARKS"], f"built-{os.getpid()}"), "w").write(str(time.time()))
'''


@pytest.mark.timeout(180)
def test_started_actors_import_their_backend_before_the_model_is_built(tmp_path):
    """``start_actors`` (Cluster.prestart) starts the processes, which import the backend's module, run
    its ``prestart()`` and wait; ``create_group`` then builds the backend in those same processes, named by model and rank
    from the start (a process that dies while waiting is named too)."""
    from chatlearn.runtime.cluster.group import create_group, role_of, start_actors

    (tmp_path / "preload_probe.py").write_text(PRELOAD_MODULE)
    marks = tmp_path / "marks"
    marks.mkdir()
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    try:
        env = {**worker_env("reward", "reward", 1), "PYTHONPATH": str(tmp_path), "MARKS": str(marks)}
        args = dict(num_actors=2, pg=None, bundles=[], gpu_fraction=0, cpus=0.1, threads=1, env=env)
        actors = start_actors("probe", "preload_probe:Thing", **args)
        assert [role_of(a._actor_id.hex()) for a in actors] == ["probe rank 0", "probe rank 1"]
        deadline = time.time() + 120
        while len(list(marks.glob("prestarted-*"))) < 2:  # imported while nothing has asked for the model
            assert time.time() < deadline, list(marks.iterdir())
            time.sleep(0.1)
        assert not list(marks.glob("built-*"))
        group = create_group("probe", "preload_probe:Thing", {}, distributed=False, actors=actors, **args)
        assert group.actors == actors
        imported = {p.name.split("-")[1] for p in marks.glob("imported-*")}
        assert {p.name.split("-")[1] for p in marks.glob("built-*")} == imported
        assert {p.name.split("-")[1] for p in marks.glob("prestarted-*")} == imported  # the module's prestart()
    finally:
        ray.shutdown()


@pytest.mark.slow  # imports vLLM in a started actor: about 8 s
def test_vllm_prestart_imports_the_engine_without_building_it():
    """The vLLM replica's process imports vLLM's engine while it waits for its ``setup`` (the heavy part
    of the engine's build, overlapping the other models' builds): the module alone imports no vLLM,
    ``prestart()`` imports ``vllm.LLM``'s module and sets the CPU defaults, and builds nothing."""
    import subprocess
    import sys

    code = """
import os, sys
os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
import chatlearn.models.rollout.vllm as rollout
assert "vllm.entrypoints.llm" not in sys.modules, "imported before prestart"
rollout.prestart()
assert "vllm.entrypoints.llm" in sys.modules and "vllm.v1.engine.core_client" in sys.modules
assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
import torch
torch.set_num_threads(1)
assert torch.get_num_threads() == 1  # vLLM's CPU worker has not replaced it yet
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
