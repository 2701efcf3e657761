"""Offloaded trainer state: device storage freed in place, its bytes kept on the host; and
:func:`release_device_memory`, which every offload ends with."""
from __future__ import annotations

import gc
from typing import Iterable

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """uint8 tensor over the whole storage (same memory)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def own_storage(params) -> None:
    """Give every tensor of ``params`` whose storage cannot be resized (weights loaded from
    safetensors sit in the file's memory map) memory of its own, so that offloading can free it."""
    with torch.no_grad():
        for p in params:
            if not p.data.untyped_storage().resizable():
                p.data = p.data.clone()


class Stash:
    """Storages freed on the device (``resize_(0)``) with their bytes kept on the host.

    Resizing the storage in place keeps every tensor viewing it valid (FSDP2's
    ``_sharded_param_data``, the DTensor's local shard, Adam's state): after ``restore`` the
    same views see the same bytes again, at a new address.
    """

    def __init__(self, tensors: Iterable[torch.Tensor]):
        storages = {}
        for t in tensors:
            st = _local(t).untyped_storage()
            if st.nbytes() > 0:
                storages.setdefault(st.data_ptr(), st)
        self.items = []
        for st in storages.values():
            host = torch.empty(st.nbytes(), dtype=torch.uint8,
                               pin_memory=st.device.type == "cuda")
            host.copy_(_bytes_view(st))
            st.resize_(0)
            self.items.append((st, host))
        self.nbytes = sum(host.numel() for _, host in self.items)

    def restore(self) -> int:
        for st, host in self.items:
            st.resize_(host.numel())
            _bytes_view(st).copy_(host)
        return self.nbytes


def release_device_memory(device: torch.device) -> None:
    """Give what this process no longer uses on a CUDA device back to the driver (nothing on a CPU).

    * ``gc.collect()``: tensors kept alive only by reference cycles are freed first.
    * The cuBLAS and cuBLASLt workspaces: torch allocates one per (handle, stream) through its
      caching allocator on the first matrix product and keeps it for the life of the process
      (``at::cuda::getCurrentCUDABlasHandle``; 32 MiB each on Hopper, ``CUBLAS_WORKSPACE_CONFIG``'s
      ``:4096:8``; about 8 MiB elsewhere), so after everything else is offloaded a process that ever
      multiplied still holds 33-67 MB, whatever the model's size. ``torch._C._cuda_clearCublasWorkspaces``
      drops them; the next product allocates them again (one allocation, microseconds).
    * ``torch.cuda.empty_cache()``: the caching allocator's free blocks, those included, return to
      the driver, visible to the other processes sharing the GPU.
    """
    if device.type != "cuda":
        return
    gc.collect()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        torch.cuda.synchronize(device)  # no queued product still uses a workspace
        with torch.cuda.device(device):
            clear()
    torch.cuda.empty_cache()
