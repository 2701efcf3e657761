"""vLLM 0.32's ``CuMemAllocator`` (``vllm/device_allocator/cumem.py``) as sleep mode uses it,
over CPU tensors: tagged allocations that ``sleep`` unmaps and ``wake_up`` maps again.

* ``sleep(offload_tags)``: every mapped allocation is released; those whose tag is in
  ``offload_tags`` are first copied to a host backup. The worker offloads ``weights`` at
  level 1 and nothing at level 2 (``CuMemBackend.suspend``), and never the KV cache.
* ``wake_up(tags)``: the sleeping allocations of ``tags`` (None: all; tags other than
  ``weights``/``kv_cache`` always) get fresh memory, then their backup if they have one. Fresh
  memory holds whatever was there: weights discarded at level 2 are garbage until every one of
  them is loaded again.

In the fake, memory stays allocated (a CPU tensor whose storage is freed crashes the process
when read, where an unmapped CUDA address raises an error): an unmapped allocation is filled
with NaN and its tensors are marked (``UNMAPPED``), and the fake's weight loaders refuse to write
into a marked tensor, as a CUDA kernel writing there faults. Memory woken without a backup keeps
the NaN (uninitialised). Only what was allocated in the allocator's pool is managed: without
``enable_sleep_mode`` nothing is, and sleep frees nothing (vLLM 0.32 does not refuse ``sleep``
then). vLLM has one allocator per process; the fake has one per worker.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DEFERRABLE_TAGS = ("weights", "kv_cache")
UNMAPPED = "_fake_vllm_unmapped"  # attribute set on the tensors of an unmapped allocation


def check_mapped(tensor: torch.Tensor) -> None:
    """What a CUDA kernel touching unmapped memory does: fail."""
    if getattr(tensor, UNMAPPED, False):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (the fake: this tensor's "
                           "memory was released by sleep mode and not woken up)")


@dataclass
class AllocationData:
    tensor: torch.Tensor
    tag: str
    is_asleep: bool = False
    cpu_backup_tensor: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def unmap(self) -> None:
        if self.tensor.is_floating_point():
            self.tensor.data.fill_(float("nan"))
        setattr(self.tensor, UNMAPPED, True)
        self.is_asleep = True

    def map(self) -> None:
        setattr(self.tensor, UNMAPPED, False)
        self.is_asleep = False


class CuMemAllocator:
    default_tag: str = "default"

    def __init__(self):
        self.pointer_to_data: dict[int, AllocationData] = {}

    def register(self, tensors, tag: str) -> None:
        """The fake's ``use_memory_pool(tag)``: ``tensors`` were allocated in the pool with ``tag``."""
        for t in tensors:
            if t.numel() and t.data_ptr() not in self.pointer_to_data:
                self.pointer_to_data[t.data_ptr()] = AllocationData(t, tag)

    def get_current_usage(self) -> int:
        return sum(d.nbytes for d in self.pointer_to_data.values() if not d.is_asleep)

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        if offload_tags is None:
            offload_tags = (CuMemAllocator.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        for data in self.pointer_to_data.values():
            if data.is_asleep:
                continue
            if data.tag in offload_tags:
                data.cpu_backup_tensor = data.tensor.detach().clone()
            data.unmap()

    def wake_up(self, tags: list[str] | None = None) -> None:
        for data in self.pointer_to_data.values():
            if not data.is_asleep:
                continue
            if tags is None or data.tag in tags or data.tag not in DEFERRABLE_TAGS:
                data.map()
                if data.cpu_backup_tensor is not None:
                    data.tensor.data.copy_(data.cpu_backup_tensor)
                    data.cpu_backup_tensor = None
