"""``cuda_ipc`` slots are allocated outside expandable segments (stream.py,
``outside_expandable_segments``).

A trainer with ``use_expandable_segments`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``,
``chatlearn/runtime/cluster/worker_env.py``) allocates in expandable segments, whose memory CUDA IPC
shares through ``pidfd_getfd``, refused in unprivileged containers (pytorch issue #165685). The
fake allocator here keeps torch's settings as c10 does (``_accelerator_getAllocatorSettings``
returns the last string set; a string sets only the keys it names, except on an older torch whose
parser first resets max_split_size_mb and the others to their defaults), records the setting in
force when each tensor is allocated, and its ``ipc_share`` fails as the real one does in such a
container for a tensor allocated while expandable segments were on.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from ipc_twin import IpcTwin, LoggingRollout, LoggingTrainer, TwinActor  # this folder

from chatlearn.runtime.weight_push import driver as wp
from chatlearn.runtime.weight_push import stream as ws

DEFAULTS = ("max_split_size_mb", "garbage_collection_threshold", "roundup_power2_divisions")


class FakeAllocatorSettings:
    def __init__(self, initial: str, resets: bool):
        self.resets, self.values, self.calls = resets, {}, []
        self._parse(initial)
        self.last = initial

    def _parse(self, settings: str) -> None:
        if self.resets:  # torch <= 2.8 CUDAAllocatorConfig::parseArgs
            for key in DEFAULTS:
                self.values.pop(key, None)
        for item in filter(None, (x.strip() for x in settings.split(","))):
            key, value = (x.strip() for x in item.split(":", 1))
            if key == "expandable_segments" and value not in ("True", "False"):
                raise ValueError(f"Expected a single True/False argument for expandable_segments, got {value!r}")
            self.values[key] = value

    def set(self, settings: str) -> None:
        self.calls.append(settings)
        self._parse(settings)
        self.last = settings

    def get(self) -> str:
        return self.last

    @property
    def expandable(self) -> bool:
        return "expandable_segments" in self.values and self.values["expandable_segments"] == "True"


@pytest.fixture(params=["getter", "setter only", "older torch"])
def allocator(request, monkeypatch):
    """Install a fake allocator factory: ``make(initial)`` -> FakeAllocatorSettings, started from
    ``initial``, with the API of a torch that has ``torch._C._accelerator_{get,set}AllocatorSettings``
    (``getter``), of one with the setter alone, whose allocator read ``PYTORCH_ALLOC_CONF`` before
    ``PYTORCH_CUDA_ALLOC_CONF`` (``setter only``), or of an older one that has only
    ``torch.cuda.memory._set_allocator_settings`` and read only ``PYTORCH_CUDA_ALLOC_CONF``."""
    def make(initial: str) -> FakeAllocatorSettings:
        fake = FakeAllocatorSettings(initial, resets=request.param == "older torch")
        if request.param == "getter":
            monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", fake.get, raising=False)
        else:
            monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
        if request.param == "older torch":
            monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings", raising=False)
            monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", fake.set)
            monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")  # not read by it
            monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", initial)
        else:
            monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", fake.set, raising=False)
            monkeypatch.setenv("PYTORCH_ALLOC_CONF", initial)
            monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")  # read second
        return fake

    return make


def _push_with(monkeypatch, fake: FakeAllocatorSettings, pushes: int = 2) -> list[bool]:
    """Two pushes, one trainer rank and one replica on GPU-0; returns the expandable setting in
    force at each allocation of a tensor that was then shared."""
    twin = IpcTwin(monkeypatch)
    at_alloc: dict[int, bool] = {}
    shared: list[bool] = []
    empty = torch.empty

    def recording_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        at_alloc[t.data_ptr()] = fake.expandable
        return t

    def share(tensor):
        expandable = at_alloc[tensor.data_ptr()]
        shared.append(expandable)
        if expandable:  # what an unprivileged container answers (pytorch issue #165685)
            raise RuntimeError("pidfd_getfd: Operation not permitted")
        return twin._share(tensor)

    monkeypatch.setattr(torch, "empty", recording_empty)
    monkeypatch.setattr(ws, "ipc_share", share)
    trainer = TwinActor(twin, "GPU-0", LoggingTrainer([(16, 16)] * 4, 0, twin.log))
    rollout = LoggingRollout(twin, "GPU-0")
    cfg = SimpleNamespace(runtime_args=SimpleNamespace(coalesced_buffer_mb=2048 / 2 ** 20))
    sync = wp.WeightPush(SimpleNamespace(actors=[trainer]), SimpleNamespace(actors=[TwinActor(twin, "GPU-0", rollout)]),
                         None, cfg, transport="cuda_ipc")
    for _ in range(pushes):
        sync.push()
        assert set(rollout.got) == set(trainer.endpoint.obj.weights)
        assert twin.held() == {}
    return shared


def test_slots_are_allocated_outside_expandable_segments(monkeypatch, allocator):
    fake = allocator("max_split_size_mb:256,expandable_segments:True")
    shared = _push_with(monkeypatch, fake)
    assert shared == [False] * (2 * wp.DEPTH)  # every shared slot, both pushes
    # back on afterwards, every other setting as it was (an older torch resets what a string omits)
    assert fake.values == {"max_split_size_mb": "256", "expandable_segments": "True"}
    assert fake.calls == ["max_split_size_mb:256,expandable_segments:False",
                          "max_split_size_mb:256,expandable_segments:True"] * 2


@pytest.mark.parametrize("initial", ["", "max_split_size_mb:256", "expandable_segments:False"])
def test_settings_are_left_alone_when_expandable_segments_are_off(monkeypatch, allocator, initial):
    fake = allocator(initial)
    assert _push_with(monkeypatch, fake) == [False] * (2 * wp.DEPTH)
    assert fake.calls == []


@pytest.mark.parametrize("settings,on", [
    ("expandable_segments:True", True),
    ("max_split_size_mb:128, expandable_segments : True", True),
    ("roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:True,garbage_collection_threshold:0.6", True),
    ("expandable_segments:True,expandable_segments:False", False),  # the last one counts
    ("expandable_segments:False", False),
    ("max_split_size_mb:128", False),
    ("", False),
])
def test_expandable_segments_on(settings, on):
    assert ws.expandable_segments_on(settings) is on


@pytest.mark.skipif(not hasattr(torch._C, "_accelerator_setAllocatorSettings"), reason="torch < 2.9")
def test_real_allocator_parser_takes_the_strings_set():
    """This torch's own parser (CPU builds parse the settings too) accepts both strings, and the
    one from before is back afterwards."""
    get, apply = torch._C._accelerator_getAllocatorSettings, torch._C._accelerator_setAllocatorSettings
    saved = get()
    before = "max_split_size_mb:256,roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:True"
    try:
        apply(before)
        with ws.outside_expandable_segments():
            assert get() == "max_split_size_mb:256,roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:False"
        assert get() == before
    finally:
        apply(saved or "expandable_segments:False")
