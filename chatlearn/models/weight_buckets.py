"""The weight buckets of the streamed weight push: their plan, their layout in a byte buffer, and
the CUDA IPC handles of the slot buffers that hold them.

A bucket is one contiguous byte buffer plus a small index of ``(name, dtype, shape, offset)``
entries (:class:`BucketIndex`, offsets aligned to ``ALIGN`` bytes), planned once from a trainer's
``weight_specs()`` (:func:`plan_buckets`). The sender (``chatlearn.runtime.weight_push.stream``) fills
buckets; a rollout engine reads them as ``(name, tensor)`` views (:func:`bucket_views`,
:func:`entry_views`), in the rollout actor or inside an engine's own worker processes, which map
the slots of their own GPU (:func:`slots_for_device`, :func:`ipc_rebuild`). Which trainer ranks
hold ``cuda_ipc`` slots and which replicas read them is planned from the GPUs each side uses
(:func:`plan_slots`). Pure helpers on torch, shared by the models (trainers' ``export_weights``,
rollout engines) and the runtime; the plans (:func:`plan_buckets`, :func:`plan_slots`) need no
torch, since the driver makes them, and torch is imported by the helpers that make tensors.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

ALIGN = 64  # byte alignment of every tensor in a bucket (any dtype's element size divides it)


# ------------------------------------------------------------------ bucket plan

@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple
    offset: int  # byte offset in the bucket buffer
    nbytes: int


@dataclass(frozen=True)
class BucketIndex:
    entries: tuple
    nbytes: int  # bytes used in the buffer (the end of the last entry)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]


# element sizes of the dtypes weights come in, by torch dtype name (others are asked of torch)
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
            "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


def itemsize(dtype: str) -> int:
    """Bytes per element of the torch dtype named ``dtype`` (e.g. ``"bfloat16"``)."""
    if dtype in ITEMSIZE:
        return ITEMSIZE[dtype]
    import torch

    found = getattr(torch, dtype, None)
    if not isinstance(found, torch.dtype):
        raise ValueError(f"{dtype!r} is not a torch dtype")
    return found.itemsize


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(specs: list, bucket_bytes: int) -> list[BucketIndex]:
    """Buckets from ``specs``: ``(name, dtype, shape, group)`` in export order.

    Consecutive specs with the same ``group`` are never split; a bucket is closed before the group
    that would take it past ``bucket_bytes`` (a group larger than that is a bucket of its own).
    """
    groups: list[list] = []
    for spec in specs:
        if groups and groups[-1][0][3] == spec[3]:
            groups[-1].append(spec)
        else:
            groups.append([spec])
    buckets, cur, size = [], [], 0
    for group in groups:
        need = sum(_align(int(np.prod(s[2], dtype=np.int64)) * itemsize(s[1]))
                   for s in group)
        if cur and size + need > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur += group
        size += need
    if cur:
        buckets.append(cur)
    out = []
    for specs_k in buckets:
        entries, offset = [], 0
        for name, dtype, shape, _ in specs_k:
            nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize(dtype)
            entries.append(Entry(name, dtype, tuple(int(d) for d in shape), offset, nbytes))
            offset = _align(offset + nbytes)
        out.append(BucketIndex(tuple(entries), entries[-1].offset + entries[-1].nbytes))
    return out


def bucket_views(index: BucketIndex, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of the uint8 buffer ``buf`` (same memory, no copy)."""
    import torch

    return [(e.name, buf[e.offset:e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape))
            for e in index.entries]


def index_rows(index: BucketIndex) -> list[list]:
    """The index as plain ``[name, dtype, shape, offset, nbytes]`` rows (msgpack-friendly)."""
    return [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in index.entries]


def entry_views(rows: list, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``bucket_views`` for :func:`index_rows` rows."""
    return bucket_views(BucketIndex(tuple(Entry(n, d, tuple(sh), o, nb) for n, d, sh, o, nb in rows),
                                    0), buf)


# ------------------------------------------------------------------ CUDA IPC slots

def device_uuid(device) -> str:
    """The GPU's UUID: the same in every process, whichever index ``CUDA_VISIBLE_DEVICES`` gives it."""
    import torch

    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


def ipc_share(tensor: torch.Tensor):
    """A picklable CUDA IPC handle of ``tensor`` (``reduce_tensor``: ``(rebuild_cuda_tensor, args)``)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(tensor)


def ipc_rebuild(handle, device) -> torch.Tensor:
    """The tensor of ``handle`` (:func:`ipc_share`) mapped into this process on ``device``.

    The handle names the device by the sender's index; this process may number the same GPU
    differently (another ``CUDA_VISIBLE_DEVICES``), so the index is replaced by ``device``'s,
    as verl and OpenRLHF do. The argument is found by its name in ``rebuild_cuda_tensor``
    (``storage_device``, torch 2.x ``torch/multiprocessing/reductions.py``).
    """
    import torch

    fn, args = handle
    args = list(args)
    args[list(inspect.signature(fn).parameters).index("storage_device")] = torch.device(device).index
    return fn(*args)


def slot_table(opened: list[dict]) -> dict[str, list]:
    """``{GPU uuid: [handle per slot]}`` from the trainer ranks' ``open_sender`` answers (``{}``
    from a rank that shares no slots, :class:`SlotPlan`)."""
    table: dict[str, list] = {}
    for rank, o in enumerate(opened):
        if not o:
            continue
        if o["uuid"] in table:  # plan_slots makes one owner per GPU: two answers are a planning bug
            raise RuntimeError(f"weight sync (cuda_ipc): trainer rank {rank} shares slots on GPU {o['uuid']}, "
                               "where another rank shares slots already")
        table[o["uuid"]] = o["handles"]
    return table


def slots_for_device(table: dict[str, list], device) -> list:
    """The slot handles that live on ``device`` (a receiver reads only from its own GPU). The push
    maps slots only in replicas whose GPUs all have an owner (:func:`plan_slots`); any other
    replica reads host memory, so a GPU missing here is a planning bug, not a placement limit."""
    uuid = device_uuid(device)
    if uuid not in table:
        raise RuntimeError(f"weight sync (cuda_ipc): no slots on GPU {uuid} (slots on: {sorted(table)}); "
                           "this replica should read the host-memory slots (plan_slots)")
    return table[uuid]


# ------------------------------------------------------------------ cuda_ipc slot plan
#
# Why a trainer rank on a GPU that no replica maps must not share slots (torch 2.x,
# torch/csrc/StorageSharing.cpp and torch/csrc/CudaIPCTypes.cpp): ``reduce_tensor`` calls
# ``storage._share_cuda_()`` (THPStorage_shareCuda), which wraps the storage's DataPtr by
# ``GetNewRefCountedSentData``: a ``CudaIPCSentData`` whose counter, in a shared-memory file,
# starts at 1. Only a consumer decrements it: the deleter of the storage that
# ``rebuild_cuda_tensor`` -> ``_new_shared_cuda`` (THPStorage_newSharedCuda) made, or
# ``_release_ipc_counter_cuda`` when that process has the storage cached already
# (torch/multiprocessing/reductions.py). When the sender drops its tensor with the counter above
# 0, ``CudaIPCSentDataDelete`` moves the block into ``CudaIPCSentDataLimbo``, and
# ``CudaIPCSentDataLimbo::collect`` (``torch.cuda.ipc_collect``, and the allocator's free-memory
# callback) frees only blocks whose counter is 0. A handle nobody rebuilds keeps its counter at 1:
# the block is never freed while the process lives (``depth`` slots per push on every GPU without
# a replica). So only the owner of a GPU that a replica maps shares its slots.

@dataclass(frozen=True)
class SlotPlan:
    """Who holds and who reads the slots of a ``cuda_ipc`` push (:func:`plan_slots`).

    ``owners``: trainer ranks that allocate ``depth`` slots on their GPU and share them (CUDA IPC),
    one per GPU that a replica maps. ``members``: the ranks of each bucket's device broadcast,
    rank 0 (it gathers the bucket) and the owners; ``()`` when no replica maps a GPU slot. Ranks
    outside ``members`` allocate nothing (they still take part in every gather). ``ipc_replicas``
    map the slots of their GPUs; ``shm_replicas`` (a GPU of theirs has no trainer rank) read host
    shared-memory slots that rank 0 fills with one device-to-host copy per bucket.
    """
    owners: tuple = ()
    members: tuple = ()
    ipc_replicas: tuple = ()
    shm_replicas: tuple = ()


def _gpu_key(uuid: str) -> str:
    """A GPU UUID as torch (``xxxxxxxx-xxxx-...``) and NVML (``GPU-xxxxxxxx-...``) both spell it."""
    key = str(uuid).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def plan_slots(trainer_gpus: list[str], replica_gpus: list[list[str]]) -> SlotPlan:
    """The :class:`SlotPlan` of trainer ranks on ``trainer_gpus`` (rank r's GPU UUID) and replicas
    on ``replica_gpus`` (replica i's GPU UUIDs: every GPU its engine reads slots on).

    A replica maps CUDA IPC slots only if every one of its GPUs has a trainer rank (a process
    reaches only its own GPUs' memory, and NCCL cannot connect two processes on one GPU); the
    lowest rank on such a GPU owns its slots. Every other replica reads host memory.
    """
    owner_of: dict[str, int] = {}
    for rank, gpu in enumerate(trainer_gpus):
        owner_of.setdefault(_gpu_key(gpu), rank)
    ipc, shm = [], []
    for i, gpus in enumerate(replica_gpus):
        keys = [_gpu_key(g) for g in gpus]
        (ipc if keys and all(k in owner_of for k in keys) else shm).append(i)
    owners = sorted({owner_of[_gpu_key(g)] for i in ipc for g in replica_gpus[i]})
    members = tuple(sorted({0, *owners})) if owners else ()
    return SlotPlan(tuple(owners), members, tuple(ipc), tuple(shm))


def device_stream(device: torch.device):
    """The current CUDA stream of ``device`` (its ``synchronize`` waits for queued copies)."""
    import torch

    return torch.cuda.current_stream(device)
