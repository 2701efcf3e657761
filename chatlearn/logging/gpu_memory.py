"""GPU memory of one worker, as torch and as the driver (NVML, what ``nvidia-smi`` shows) see it.

torch's allocator counts only this process (``allocated``: live tensors; ``reserved``: what the
caching allocator holds). A rollout engine allocates in processes of its own (vLLM's engine core
and workers, SGLang's schedulers), which torch in the worker never sees: NVML's per-process usage,
summed over the worker and every process it started, covers them. NVML's device-wide ``used`` is
what decides an out-of-memory error. Reading NVML creates no CUDA context, so the numbers of a
worker that never touched CUDA itself (a vLLM adapter whose engine runs in subprocesses) cost no
device memory.
"""
from __future__ import annotations

import os

MIB = 2 ** 20


def load_nvml():
    """pynvml (package ``nvidia-ml-py``), initialised; None where it is missing or no driver answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no NVML library, no driver: NVML numbers are left out
        return None


def visible_handles(nvml) -> list:
    """NVML handles of the devices this process sees (``CUDA_VISIBLE_DEVICES``: indices or UUIDs)."""
    visible = os.environ["CUDA_VISIBLE_DEVICES"] if "CUDA_VISIBLE_DEVICES" in os.environ else None
    if visible is None:
        return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    handles = []
    for item in (x.strip() for x in visible.split(",") if x.strip()):
        if item.startswith(("GPU-", "MIG-")):
            handles.append(nvml.nvmlDeviceGetHandleByUUID(item))
        else:
            handles.append(nvml.nvmlDeviceGetHandleByIndex(int(item)))
    return handles


def visible_gpu_count() -> int:
    """How many GPUs this process sees (``CUDA_VISIBLE_DEVICES`` applied), without importing torch where
    it can: NVML when it answers; 0 on a machine with no GPU device node (no NVIDIA or ROCm driver);
    torch's count otherwise."""
    nvml = load_nvml()
    if nvml is not None:
        try:
            return len(visible_handles(nvml))
        except Exception:  # noqa: BLE001 - a visible-device entry NVML cannot resolve: ask torch
            pass
    if not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")):
        return 0
    import torch

    return torch.cuda.device_count()


def _process_tree(pid: int) -> set[int]:
    import psutil

    try:
        proc = psutil.Process(pid)
        return {pid, *(c.pid for c in proc.children(recursive=True))}
    except psutil.Error:
        return {pid}


def device_memory(pid: int | None = None) -> list[dict]:
    """One entry per device this process sees, in MiB; ``[]`` without CUDA.

    ``pid``: this process (models whose workers share a process, e.g. a fused rollout and its
    trainer, show the same numbers); ``device``: the physical index (NVML) or the visible index; ``allocated_mb``/``reserved_mb``:
    torch in this process (only once this process has initialised CUDA); ``used_mb``/``total_mb``:
    the whole device (NVML); ``processes_mb``: NVML's usage of this process and its descendants on
    that device (the engine subprocesses of a rollout).
    """
    import torch

    if not torch.cuda.is_available():
        return []
    pid = os.getpid() if pid is None else pid
    nvml = load_nvml()
    handles = visible_handles(nvml) if nvml is not None else [None] * torch.cuda.device_count()
    tree = _process_tree(pid) if nvml is not None else set()
    out = []
    for visible, handle in enumerate(handles):
        entry: dict = {"device": visible, "pid": pid}
        if torch.cuda.is_initialized():
            entry["allocated_mb"] = torch.cuda.memory_allocated(visible) / MIB
            entry["reserved_mb"] = torch.cuda.memory_reserved(visible) / MIB
        if handle is not None:
            entry["device"] = int(nvml.nvmlDeviceGetIndex(handle))
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
            entry["used_mb"], entry["total_mb"] = info.used / MIB, info.total / MIB
            mine = [p for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid in tree]
            entry["processes_mb"] = sum((p.usedGpuMemory or 0) for p in mine) / MIB
        out.append(entry)
    return out


def summarize(snapshots: dict[str, list[list[dict]]]) -> dict[str, dict]:
    """Per model, the largest numbers over its workers and devices: ``{model: {key: MiB}}``.

    ``snapshots``: model -> one :func:`device_memory` list per worker.
    """
    out: dict[str, dict] = {}
    for model, workers in snapshots.items():
        entries = [e for w in workers for e in w]
        if not entries:
            continue
        out[model] = {k: round(max(e[k] for e in entries if k in e), 1)
                      for k in ("allocated_mb", "reserved_mb", "processes_mb", "used_mb")
                      if any(k in e for e in entries)}
    return out
