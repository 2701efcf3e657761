"""What an offload leaves on a CUDA device, on the CPU: a fake of torch's CUDA caching allocator in
which, as in torch, the cuBLAS workspaces are blocks the allocator holds for the BLAS handles (one
per handle and stream, allocated by the first matrix product, kept for the life of the process)
and ``empty_cache`` returns only blocks nothing holds. Every model's offload ends with
``release_device_memory``; after it nothing of the process's is reserved, whatever the model."""
from __future__ import annotations

import contextlib

import pytest
import torch

from chatlearn.models import stash

MIB = 2 ** 20


class FakeCudaAllocator:
    """Reserved = live blocks + cached free blocks; the workspaces are live blocks owned by the
    BLAS handle map (``at::cuda::cublas_handle_stream_to_workspace``), not by any tensor."""

    def __init__(self):
        self.live: dict[str, int] = {}
        self.cached = 0
        self.calls: list[str] = []

    def matmul(self, stream: str) -> None:  # the first product on a stream allocates its workspace
        self.live.setdefault(f"cublas-workspace-{stream}", 32 * MIB)
        self.live.setdefault(f"cublaslt-workspace-{stream}", 32 * MIB)

    def alloc(self, name: str, nbytes: int) -> None:
        self.live[name] = nbytes

    def free(self, name: str) -> None:
        self.cached += self.live.pop(name)

    def reserved(self) -> int:
        return sum(self.live.values()) + self.cached

    # the torch entry points release_device_memory uses
    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.cached = 0

    def clear_workspaces(self) -> None:
        self.calls.append("clear_workspaces")
        for name in [n for n in self.live if "workspace" in n]:
            self.free(name)

    def synchronize(self, device=None) -> None:
        self.calls.append("synchronize")


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCudaAllocator()
    monkeypatch.setattr(torch.cuda, "empty_cache", fake.empty_cache)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", fake.clear_workspaces, raising=False)
    return fake


@pytest.mark.parametrize("streams", [["default"], ["default", "fsdp-backward"]])
def test_offload_leaves_no_workspace_behind(fake_cuda, streams):
    fake_cuda.alloc("weights", 700 * MIB)
    for s in streams:
        fake_cuda.matmul(s)
    fake_cuda.free("weights")  # the model's storage is freed by the offload itself
    stash.release_device_memory(torch.device("cuda", 0))
    assert fake_cuda.reserved() == 0  # 33 MB per stream (x2 with cuBLASLt) stayed before
    assert fake_cuda.calls.index("clear_workspaces") < fake_cuda.calls.index("empty_cache")
    assert fake_cuda.calls.index("synchronize") < fake_cuda.calls.index("clear_workspaces")


def test_empty_cache_alone_keeps_the_workspaces(fake_cuda):
    """The fake is strict: what the old offload did (empty_cache only) leaves 64 MiB per stream."""
    fake_cuda.matmul("default")
    fake_cuda.empty_cache()
    assert fake_cuda.reserved() == 64 * MIB


def test_cpu_devices_are_left_alone(fake_cuda):
    stash.release_device_memory(torch.device("cpu"))
    assert fake_cuda.calls == []


def test_every_offload_ends_with_the_release():
    """Each model kind's offload calls the shared release (no model keeps its own copy of it)."""
    import inspect

    from chatlearn.models.reward.model import RewardModel
    from chatlearn.models.rollout import common
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    assert "release_device_memory" in inspect.getsource(common.release_cuda_cache)
    for cls in (FSDPTrainer, RewardModel):
        assert "release_device_memory(self.device)" in inspect.getsource(cls.offload), cls
    import chatlearn.models.rollout.hf as hf

    assert "release_cuda_cache(self.device)" in inspect.getsource(hf.HFRollout.offload)
