"""GPU memory per device, per model and per turn: torch's view of the worker, NVML's view of the
device and of the worker's process tree (a rollout engine's subprocesses included). Checked here
against a fake NVML shaped like ``pynvml`` (nvidia-ml-py) and a faked ``torch.cuda``; the
``gpu``-marked test reads the real ones."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from chatlearn.logging import gpu_memory
from chatlearn.runtime.driver.scheduler import Scheduler, Timeline

MIB = 2 ** 20


class FakeNVML(types.ModuleType):
    """The calls of pynvml that ``device_memory`` makes, with pynvml's signatures and result shapes
    (``nvmlDeviceGetMemoryInfo`` -> .total/.free/.used bytes; ``nvmlDeviceGetComputeRunningProcesses``
    -> objects with .pid and .usedGpuMemory, which is None where the driver cannot tell)."""

    def __init__(self, devices: dict[int, dict]):
        super().__init__("pynvml")
        self.devices = devices
        self.inits = 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index):
        if index not in self.devices:
            raise ValueError("NVML_ERROR_INVALID_ARGUMENT")
        return ("handle", index)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for index, dev in self.devices.items():
            if dev["uuid"] == uuid:
                return ("handle", index)
        raise ValueError("NVML_ERROR_NOT_FOUND")

    def nvmlDeviceGetIndex(self, handle):
        return handle[1]

    def nvmlDeviceGetMemoryInfo(self, handle):
        dev = self.devices[handle[1]]
        return types.SimpleNamespace(total=dev["total"], used=dev["used"], free=dev["total"] - dev["used"])

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=used)
                for pid, used in self.devices[handle[1]]["procs"].items()]


@pytest.fixture
def fake_gpu(monkeypatch):
    """Two physical GPUs; this process sees physical GPU 1 (as a Ray actor does); a child process
    of this one (an engine subprocess) and an unrelated process use memory on it too."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    nvml = FakeNVML({
        0: {"uuid": "GPU-aaa", "total": 80 * 1024 * MIB, "used": 5 * 1024 * MIB, "procs": {12345: 5 * 1024 * MIB}},
        1: {"uuid": "GPU-bbb", "total": 80 * 1024 * MIB, "used": 30 * 1024 * MIB,
            "procs": {os.getpid(): 2 * 1024 * MIB, child.pid: 20 * 1024 * MIB, 99999: 8 * 1024 * MIB}},
    })
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    yield nvml, child
    child.kill()
    child.wait()


def test_device_memory_counts_the_worker_and_its_engine_processes(fake_gpu, monkeypatch):
    nvml, _ = fake_gpu
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a worker that never used CUDA
    (entry,) = gpu_memory.device_memory()
    assert entry["device"] == 1  # the physical index, from CUDA_VISIBLE_DEVICES
    assert entry["pid"] == os.getpid()  # which models share a process (a fused rollout)
    assert entry["used_mb"] == 30 * 1024 and entry["total_mb"] == 80 * 1024
    assert entry["processes_mb"] == 22 * 1024  # itself + its child, not the unrelated process
    assert "allocated_mb" not in entry  # no CUDA context is created to ask torch
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 3 * MIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 4 * MIB)
    (entry,) = gpu_memory.device_memory()
    assert entry["allocated_mb"] == 3 and entry["reserved_mb"] == 4


def test_visible_devices_by_uuid(fake_gpu, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    (entry,) = gpu_memory.device_memory()
    assert entry["device"] == 0 and entry["processes_mb"] == 0


def test_without_nvml_torch_numbers_only(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 1 * MIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 2 * MIB)
    assert gpu_memory.device_memory() == [{"device": 0, "pid": os.getpid(), "allocated_mb": 1.0, "reserved_mb": 2.0}]


def test_no_cuda_no_entries(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_memory.device_memory() == []


class _Remote:
    def __init__(self, value):
        self.value = value

    def remote(self):
        return self.value


class _Actor:
    def __init__(self, snap):
        self.device_memory = _Remote(snap)


class _Group:
    """A model's worker group: ``call`` moves parts, ``device_memory`` reports fixed numbers."""

    def __init__(self, snaps):
        self.actors = [_Actor(s) for s in snaps]

    def call(self, method, parts):
        return [{"bytes": 10}] * len(self.actors), 0.0


def test_every_turn_records_the_memory_of_the_models_on_that_device_group(tmp_path, monkeypatch):
    from chatlearn.config.kinds import DEFAULT_MODELS
    from chatlearn.config.plan import ModelPlacement, Plan
    from chatlearn.runtime.driver import scheduler

    monkeypatch.setattr(scheduler, "get", lambda refs, timeout=None: refs)
    plan = Plan.__new__(Plan)
    plan.device_groups = [["policy", "policy_trainer"]]
    plan.placements = {name: ModelPlacement(name, 1, 0, [0]) for name in ("policy", "policy_trainer")}
    plan.kinds = {name: DEFAULT_MODELS[name] for name in plan.placements}
    trainer = [[{"device": 0, "allocated_mb": 100.0, "reserved_mb": 120.0, "used_mb": 900.0, "processes_mb": 130.0}]]
    rollout = [[{"device": 0, "used_mb": 950.0, "processes_mb": 700.0}]]
    groups = {"policy_trainer": _Group(trainer), "policy": _Group(rollout)}
    timeline = Timeline(str(tmp_path / "timeline.jsonl"))
    sched = Scheduler(plan, timeline, offload_without_gpu=False)  # a GPU: the flag has no effect
    # registering the trainer finds device memory to report: tracking is on from then on
    sched.add("policy_trainer", lambda: groups["policy_trainer"], {"weights", "optimizer", "grads"})
    assert sched.track_gpu_memory
    sched.add("policy", lambda: groups["policy"], {"weights", "kv_cache"})  # the trainer leaves first
    sched.ensure("policy_trainer", ["weights"])  # the rollout engine leaves, the trainer's weights come back
    sched.stage("policy_trainer", "train", 1.0)
    events = [json.loads(line) for line in open(tmp_path / "timeline.jsonl")]
    assert [(e["kind"], e.get("model"), e.get("action")) for e in events] == [
        ("transition", "policy_trainer", "offload"), ("transition", "policy", "offload"),
        ("transition", "policy_trainer", "onload"), ("stage", "policy_trainer", None)]
    assert events[0]["gpu_memory"] == {"policy_trainer": trainer}  # the rollout engine was not built yet
    for e in events[1:]:
        assert e["gpu_memory"] == {"policy_trainer": trainer, "policy": rollout}
    peaks = sched.take_gpu_peaks()
    assert peaks["memory/policy_gpu_processes_mb"] == 700.0
    assert peaks["memory/policy_trainer_gpu_reserved_mb"] == 120.0
    assert peaks["memory/policy_gpu_used_mb"] == 950.0
    assert sched.take_gpu_peaks() == {}  # per episode
    sched.track_gpu_memory = False  # on CPU nothing is asked or recorded
    sched.ensure("policy", ["weights"])
    assert sched.timeline.events[-1]["action"] == "onload" and "gpu_memory" not in sched.timeline.events[-1]
    timeline.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_device_memory_sees_an_allocation():
    x = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    (entry, *_) = gpu_memory.device_memory()
    assert entry["allocated_mb"] >= 256 and entry["reserved_mb"] >= 256
    if "used_mb" in entry:  # NVML present
        assert entry["used_mb"] >= entry["reserved_mb"] and entry["processes_mb"] >= 256
    del x
    torch.cuda.empty_cache()
    (after, *_) = gpu_memory.device_memory()
    assert after["reserved_mb"] < entry["reserved_mb"] - 200
