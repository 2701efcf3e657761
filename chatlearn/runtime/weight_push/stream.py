"""Streaming, bucketed weight push from the trainer ranks into every rollout replica: the protocol the
workers run (the driver's side, with no torch, is :mod:`chatlearn.runtime.weight_push.driver`).

``WeightPush(trainer_group, rollout_group, plan, cfg).push()`` (the driver) moves the trainer's full weights,
in Hugging Face names, into the rollout engines, one *bucket* at a time:

* A bucket is one contiguous byte buffer plus a small index of ``(name, dtype, shape, offset)``
  entries (:class:`BucketIndex`, offsets aligned to ``ALIGN`` bytes). The buckets are planned
  once from the trainer's ``weight_specs()`` (about ``runtime_args.coalesced_buffer_mb`` MiB each;
  a bucket is closed before the spec group that would overflow it, so the tensors that one
  trainer gather produces, e.g. q/k/v split from a fused Megatron QKV, stay together).
* Bucket k is produced by ``export_tensors(names of bucket k)`` on every trainer rank in
  lockstep (FSDP's ``full_tensor`` and Megatron's gathers are collectives): each full tensor is
  gathered, copied into rank 0's slot buffer and dropped, so no rank ever holds more than its
  shards, ``depth`` slot buffers and one gathered tensor.
* At most ``depth`` (2) buckets are in flight: the trainer gathers bucket k+1 into one slot while
  the replicas load bucket k from the other; slot ``k % depth`` is refilled only after every
  replica has loaded bucket ``k - depth``, and a replica loads bucket k only after every trainer
  rank has returned from writing it.

Transports, chosen by placement (``driver.choose_transport``):

* ``shm`` (trainer and rollout on the same device group, CPU): the slots are files in
  ``/dev/shm`` that rank 0 creates and every replica maps; replicas read the bytes in place
  (no pickling, no copy until the engine's own load). The files are unlinked once every replica
  has mapped them, so nothing is left behind if a process dies. The slots are made on the first
  push and stay mapped between pushes (host memory, reused by every push).
* ``cuda_ipc`` (same device group, CUDA): ``depth`` slots on every GPU that both a trainer rank
  and a replica use. On its first push the driver asks every trainer rank and replica for its GPUs
  (UUIDs; a replica names every GPU its engine reads on) and plans who holds what
  (``chatlearn.models.weight_buckets.plan_slots``, a :class:`SlotPlan`):

  - the lowest trainer rank on a GPU that a replica maps *owns* that GPU's slots. Rank 0 gathers
    each bucket into its slot and broadcasts it into the owners' slots over a process group of
    rank 0 and the owners (NCCL, device to device; the default group when that is every rank).
  - a trainer rank on a GPU that no replica maps allocates and shares nothing (it still takes part
    in every gather). A shared slot that no process maps is never freed by torch (its IPC
    reference count stays at 1: see ``chatlearn.models.weight_buckets``), so this is what keeps a
    placement with more trainer ranks than rollout GPUs from leaking 2 slots per push per GPU.
  - a replica with a GPU that no trainer rank uses (more rollout GPUs than trainer ranks) cannot
    map a slot: a process reaches only its own GPUs, and NCCL cannot connect two processes on one
    GPU. It reads host shared-memory slots instead, as with ``shm``: trainer rank 0 copies each
    bucket from its GPU slot into its host slot (one device-to-host copy per bucket, whatever the
    number of such replicas), and the replica's engine loads from host memory. The host slots
    are made on the first push and kept; the other replicas still map GPU slots (a mixed push).

  What a push of a model of M bytes moves, with R replicas of which H are on a GPU without a
  trainer rank (``tests/runtime/weight_push/test_slot_plan.py`` counts it): M bytes over NCCL
  into each owner other than rank 0; M bytes device to host once, on rank 0, when H > 0; M
  bytes read in place from its GPU slots by each of the R - H other replicas (per engine
  worker), and M bytes loaded from host memory by each of the H. Memory: ``depth`` x the
  largest bucket on each owner's GPU and rank 0's during the push, none on any other GPU;
  the same in host shared memory when H > 0, kept between pushes. Switching the whole push to
  ``shm`` for such a placement would move the same device-to-host M but M bytes host to device
  into each of the R replicas, where the mixed push keeps R - H of them on device-to-device
  reads.

  The slots are shared as CUDA IPC handles (``torch.multiprocessing.reductions.reduce_tensor``)
  keyed by the GPU's UUID; a receiver maps the slots of its own GPU (:func:`slots_for_device`,
  :func:`ipc_rebuild`), in the rollout actor or, for an engine whose workers run in processes
  of their own (vLLM), inside each worker, and synchronizes its stream after loading, before
  the slot may be refilled. Before ``send`` returns, every rank synchronizes its CUDA stream, so
  no replica reads a slot whose copies are still queued (the CUDA IPC handle does not order
  later writes; verl and OpenRLHF synchronize before handing out handles likewise). The slots
  are allocated with expandable segments turned off (:func:`outside_expandable_segments`), so
  that a trainer with ``use_expandable_segments`` shares them with ``cudaIpcGetMemHandle``
  rather than ``pidfd_getfd``, which unprivileged containers refuse. The GPU slots exist only
  during a push: opened at its start, and after it the receivers drop their mappings, then
  every rank deletes its slots, collects the IPC references (``torch.cuda.ipc_collect``) and
  empties its CUDA cache, so no weight buffer stays on a GPU between pushes (the rollout's KV
  cache and the trainer's state need that memory).
* ``broadcast`` (different device groups): rank 0 broadcasts each slot to the replicas over a
  process group of its own (rank 0 + one rank per replica; gloo on CPU, NCCL on CUDA), created
  once from a ``TCPStore`` hosted by trainer rank 0 (like vLLM's ``StatelessProcessGroup``), so
  it does not touch the trainers' default group nor vLLM's.

The rollout side receives a bucket as ``(name, tensor)`` views of the buffer, valid only during
``load_weight_bucket``, between ``begin_weight_update()`` and ``finish_weight_update()``.
"""
from __future__ import annotations

import contextlib
import gc
import mmap
import os
import re
import tempfile
import uuid
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from chatlearn.logging import gpu_memory
from chatlearn.models.rollout.lora_push import AdapterMerge

# the bucket plan and layout, and the CUDA IPC slot helpers, are shared with the rollout engines
# (chatlearn.models): they live in the models layer
from chatlearn.models.weight_buckets import (  # noqa: F401 (ALIGN, Entry, entry_views: re-exported)
    ALIGN,
    BucketIndex,
    Entry,
    SlotPlan,
    bucket_views,
    device_stream,
    device_uuid,
    entry_views,
    index_rows,
    ipc_rebuild,
    ipc_share,
    plan_buckets,
    slot_table,
    slots_for_device,
)

GROUP_TIMEOUT = timedelta(minutes=10)


def _this_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _release_cached(device: torch.device) -> None:
    """Give freed slot memory back to the driver: blocks other processes used through IPC are
    held until collected, then the caching allocator's free blocks are released."""
    with torch.cuda.device(device):
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


def _rank_group(members: tuple):
    """The process group of the trainer ranks ``members`` (rank 0 and the slot owners of a
    :class:`SlotPlan`), made from the trainers' default group; ``None`` when that is all of them
    (the default group itself) or there is no group. Every rank calls this at once, members or not
    (``new_group`` is a collective of the default group)."""
    if not (dist.is_available() and dist.is_initialized()) or len(members) == dist.get_world_size():
        return None
    from chatlearn.models.trainer.fsdp import collective_timeout

    return dist.new_group(list(members), timeout=collective_timeout())  # as the default group's


def _share_among_ranks(buf: torch.Tensor, group) -> None:
    """Copy rank 0's ``buf`` into the ``buf`` of every rank of ``group`` (:func:`_rank_group`)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.broadcast(buf, src=0, group=group)


def _copy_to_host(host: torch.Tensor, buf: torch.Tensor) -> None:
    """Copy a bucket from rank 0's GPU slot ``buf`` into its host slot ``host``; returns once the
    bytes are there (a copy into pageable memory is synchronous)."""
    host.copy_(buf)


def _visible_gpu_uuids() -> list[str]:
    """UUIDs of the GPUs this process sees (``CUDA_VISIBLE_DEVICES`` applied), read through NVML
    where it answers, which makes no CUDA context: a vLLM adapter whose workers run in processes of
    their own never initialises CUDA itself (``chatlearn.logging.gpu_memory``). torch's otherwise."""
    nvml = gpu_memory.load_nvml()
    if nvml is not None:
        try:
            ids = [nvml.nvmlDeviceGetUUID(h) for h in gpu_memory.visible_handles(nvml)]
            return [u.decode() if isinstance(u, bytes) else str(u) for u in ids]
        except Exception:  # noqa: BLE001 - a visible-device entry NVML cannot resolve: ask torch
            pass
    return [device_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())]


# ------------------------------------------------------------------ IPC slots outside expandable segments
#
# Memory of an expandable segment (``expandable_segments:True``, ``use_expandable_segments``) is
# shared through a POSIX file descriptor that the receiver takes with ``pidfd_getfd``, refused in
# containers without ptrace rights ("pidfd_getfd: Operation not permitted", pytorch issue
# #165685); a segment of its own (``cudaMalloc``) is shared with ``cudaIpcGetMemHandle``, which
# needs no such right. So the slots are allocated with expandable segments turned off, as verl
# does around its weight sync (``verl.utils.device.set_expandable_segments``). The caching
# allocator honours the switch for blocks it already cached, too: with it off, ``get_free_block``
# skips free blocks of expandable segments (c10/cuda/CUDACachingAllocator.cpp: "since we cannot
# share expandable memory via IPC, someone might temporarily disable it").

ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
_EXPANDABLE = re.compile(r"(^|,)\s*expandable_segments\s*:\s*(\w+)\s*(?=,|$)")


def _allocator_settings() -> str:
    """The allocator's settings string: ``torch._C._accelerator_getAllocatorSettings()`` (the
    environment's at start, then each string set at run time), or, on a torch without that getter,
    the environment variable the allocator read when CUDA started: the device-generic allocator
    config (the one with ``torch._C._accelerator_setAllocatorSettings``) reads ``PYTORCH_ALLOC_CONF``
    and, when that is unset, ``PYTORCH_CUDA_ALLOC_CONF``; the CUDA-only one before it reads only
    the latter. Nothing in a trainer sets allocator settings at run time but
    :func:`outside_expandable_segments`, which puts back what it found."""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get is not None:
        return get()
    generic = hasattr(torch._C, "_accelerator_setAllocatorSettings")
    for name in ALLOC_CONF_VARS if generic else ALLOC_CONF_VARS[1:]:
        if name in os.environ:
            return os.environ[name]
    return ""


def _set_allocator_settings(settings: str) -> None:
    """Apply ``settings`` (``PYTORCH_ALLOC_CONF`` syntax) to the caching allocator now:
    ``torch._C._accelerator_setAllocatorSettings``, or ``torch.cuda.memory._set_allocator_settings``
    on a torch without it (the same call there; deprecated where the other exists)."""
    apply = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if apply is None:
        apply = torch.cuda.memory._set_allocator_settings
    apply(settings)


def expandable_segments_on(settings: str) -> bool:
    """Whether ``settings`` turn expandable segments on (the last ``expandable_segments`` entry)."""
    found = _EXPANDABLE.findall(settings)
    return bool(found) and found[-1][1].lower() == "true"


@contextlib.contextmanager
def outside_expandable_segments():
    """Allocations inside the block go to segments of their own (shareable by CUDA IPC without
    ``pidfd_getfd``). Only when expandable segments are on is anything set: every other setting
    is kept (an older torch resets the ones a settings string leaves out), and on leaving, the
    settings string from before is set again."""
    before = _allocator_settings()
    if not expandable_segments_on(before):
        yield
        return
    others = _EXPANDABLE.sub("", before).strip(", ")
    _set_allocator_settings(",".join(x for x in (others, "expandable_segments:False") if x))
    try:
        yield
    finally:
        _set_allocator_settings(before)


# ------------------------------------------------------------------ slot buffers

def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class ShmSlot:
    """A shared-memory file of ``nbytes`` mapped into this process (``create``: made here)."""

    def __init__(self, path: str, nbytes: int, create: bool):
        self.path, self.nbytes = path, nbytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            self.map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _new_shm_slots(nbytes: int, depth: int) -> list[ShmSlot]:
    """``depth`` new shared-memory files of ``nbytes`` each, mapped here."""
    tag = uuid.uuid4().hex[:12]
    return [ShmSlot(os.path.join(_shm_dir(), f"chatlearn-weights-{tag}-{i}"), nbytes, True) for i in range(depth)]


def _new_broadcast_group(host: str, port: int, rank: int, world: int, device_type: str):
    """A process group of its own (not the default one) from a TCPStore hosted by rank 0."""
    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=GROUP_TIMEOUT)
    store = dist.PrefixStore("chatlearn_weight_sync", store)
    if device_type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, world)
    return dist.ProcessGroupGloo(store, rank, world, GROUP_TIMEOUT)


def _broadcast(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


# ------------------------------------------------------------------ actor-side endpoint

def push_view(trainer):
    """What a push sends from ``trainer``: its ``push_view()`` (the LoRA trainer's adapters alone, with a
    ``manifest``), or the trainer itself (a trainer without that method: every weight)."""
    return trainer.push_view() if hasattr(trainer, "push_view") else trainer


def adapter_manifest(view) -> dict | None:
    """The manifest of an adapter push (``chatlearn.models.rollout.lora_push``), None for a full one."""
    return getattr(view, "manifest", None)


def _merge_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def gather_bucket(trainer, index: BucketIndex, buf, held: Callable | None = None) -> None:
    """Gather bucket ``index`` of ``trainer``'s weights (``export_tensors``: a collective of its ranks)
    into ``buf`` on rank 0, laid out as :func:`bucket_views` reads it; the other ranks' ``buf`` is left
    as it is. ``held(tensor)``: told of each full tensor before it is copied and dropped."""
    views = dict(bucket_views(index, buf)) if trainer.rank == 0 else {}
    for name, tensor in push_view(trainer).export_tensors(index.names):
        if tensor is not None:
            if held is not None:
                held(tensor)
            views[name].copy_(tensor)
        del tensor


class Endpoint:
    """The sending (trainer rank) or receiving (rollout replica) side, inside a worker actor.

    Trainer backends provide ``weight_specs()`` (``[(hf_name, dtype, shape, group)]``, the same on
    every rank, no collective) and ``export_tensors(names)`` (a collective generator of
    ``(name, full tensor on rank 0 / None elsewhere)``). Rollout backends provide
    ``begin_weight_update()``, ``load_weight_bucket(weights)`` and ``finish_weight_update()``;
    an engine whose workers run in processes of their own also provides
    ``attach_weight_slots(table)``, ``load_weight_slot(slot, rows)`` and
    ``detach_weight_slots()`` (``cuda_ipc``: the workers map the slots themselves).
    """

    def __init__(self, obj):
        self.obj = obj
        self.buckets: list[BucketIndex] = []
        self.slots: list = []
        self.host_slots: list[ShmSlot] = []  # cuda_ipc, rank 0: what the shm_replicas of the plan read
        self.transport = None
        self.group = None
        self.plan: SlotPlan | None = None  # cuda_ipc: who holds and reads the slots
        self.rank_group = None  # cuda_ipc: the process group of plan.members (None: the default group)
        self.group_members: tuple | None = None
        self.engine_maps = False  # cuda_ipc receiver: the engine's workers hold the mappings
        self.peak_live_bytes = 0  # trainer side: max bytes of slots + gathered tensors alive
        self.merge = None  # rollout side, LoRA adapter push: the AdapterMerge the buckets go through

    # -- trainer side
    def specs(self) -> dict:
        view = push_view(self.obj)
        return {"specs": view.weight_specs(), "device": torch.device(self.obj.device).type,
                "adapters": adapter_manifest(view)}

    def sender_gpu(self) -> str:
        """The UUID of this trainer rank's GPU (``cuda_ipc``: :func:`plan_slots`)."""
        return device_uuid(torch.device(self.obj.device))

    def open_sender(self, transport: str, buckets: list, depth: int, group_addr=None,
                    plan: SlotPlan | None = None) -> dict:
        """Allocate the ``depth`` slots (``cuda_ipc``: on the ranks of ``plan.members``, on their
        GPUs, shared by ``plan.owners``; else on rank 0); returns what the replicas need to attach."""
        self.transport, self.buckets = transport, buckets
        size = max(b.nbytes for b in buckets)
        device = torch.device(self.obj.device)
        if transport == "cuda_ipc":
            if plan is None:
                raise ValueError("open_sender(cuda_ipc): the push's SlotPlan (plan_slots) is required")
            return self._open_ipc_slots(plan, size, depth, device)
        if self.obj.rank != 0:
            return {}
        if transport == "shm":
            self.slots = _new_shm_slots(size, depth)
            return {"paths": [s.path for s in self.slots], "nbytes": size}
        self.slots = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(depth)]
        host, port, world = group_addr
        self.group = _new_broadcast_group(host, port, 0, world, device.type)
        return {}

    def _open_ipc_slots(self, plan: SlotPlan, size: int, depth: int, device: torch.device) -> dict:
        """``cuda_ipc``: this rank's part of ``plan`` (every rank calls it at once). A member
        allocates its slots outside expandable segments; an owner shares them; any other rank
        allocates nothing (no slot that no replica maps: it would never be freed, see
        ``chatlearn.models.weight_buckets``)."""
        self.plan = plan
        if self.group_members != plan.members:  # once per plan: a collective of every rank
            self.rank_group = _rank_group(plan.members) if len(plan.members) > 1 else None
            self.group_members = plan.members
        rank = self.obj.rank
        if rank not in plan.members:
            return {}
        with outside_expandable_segments():
            self.slots = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(depth)]
        if rank not in plan.owners:  # rank 0 gathers here, broadcasts, copies to host; nobody maps it
            return {}
        return {"uuid": device_uuid(device), "handles": [ipc_share(t) for t in self.slots]}

    def open_host_slots(self, buckets: list, depth: int) -> dict:
        """``cuda_ipc``, rank 0: the host shared-memory slots that the replicas on GPUs without a
        trainer rank read (made once, kept between pushes like the ``shm`` transport's)."""
        self.host_slots = _new_shm_slots(max(b.nbytes for b in buckets), depth)
        return {"paths": [s.path for s in self.host_slots], "nbytes": self.host_slots[0].nbytes}

    def release_names(self) -> None:
        """Unlink the shm files once every replica has mapped them (the mappings stay valid)."""
        for s in [*self.slots, *self.host_slots]:
            if isinstance(s, ShmSlot):
                s.unlink()

    def send(self, k: int, slot: int) -> int:
        """Gather bucket k (all trainer ranks), write it into slot ``slot`` on rank 0, and for
        ``broadcast`` send it; ``cuda_ipc``: copy it into the slots of ``plan.members`` and, for
        the plan's shm replicas, into rank 0's host slot, and wait until the bytes are there.
        Returns the bucket's bytes."""
        index = self.buckets[k]
        buf = None
        if self.slots:
            s = self.slots[slot]
            buf = (s.tensor if isinstance(s, ShmSlot) else s)[:index.nbytes]
        elif self.host_slots:  # cuda_ipc with no GPU slot mapped anywhere: gather to host at once
            buf = self.host_slots[slot].tensor[:index.nbytes]
        slots_bytes = sum((s.nbytes if isinstance(s, ShmSlot) else s.numel()) for s in self.slots)

        def held(tensor) -> None:
            self.peak_live_bytes = max(self.peak_live_bytes, slots_bytes + tensor.numel() * tensor.element_size())

        gather_bucket(self.obj, index, buf, held)
        if self.transport == "cuda_ipc" and self.slots:
            if len(self.plan.members) > 1:
                _share_among_ranks(buf, self.rank_group)
            if self.host_slots:  # rank 0: one device-to-host copy for every shm replica
                _copy_to_host(self.host_slots[slot].tensor[:index.nbytes], buf)
            # The copies run asynchronously on this stream: the replicas are let in (this call
            # returns) only once they are done.
            device_stream(buf.device).synchronize()
        elif self.transport == "broadcast" and buf is not None:
            _broadcast(self.group, buf)
        return index.nbytes

    def close_sender(self) -> None:
        """``cuda_ipc``: free this rank's slots (every replica has dropped its mappings); the host
        slots stay for the next push."""
        if self.transport != "cuda_ipc" or not self.slots:
            return
        device = self.slots[0].device
        self.slots = []
        _release_cached(device)

    def stats(self) -> dict:
        return {"peak_live_bytes": self.peak_live_bytes}

    # -- rollout side
    def receiver_gpus(self) -> list[str]:
        """UUIDs of the GPUs this replica reads ``cuda_ipc`` slots on (:func:`plan_slots`): those its
        engine's workers use (every GPU this process sees) when they map the slots themselves,
        else this process's current GPU."""
        if self.obj.maps_weight_slots:
            return _visible_gpu_uuids()
        return [device_uuid(_this_device())]

    def open_receiver(self, transport: str, buckets: list, attach: dict, group_addr=None,
                      rank: int = 0) -> None:
        self.transport, self.buckets = transport, buckets
        if transport == "shm":
            self.slots = [ShmSlot(p, attach["nbytes"], False) for p in attach["paths"]]
        elif transport == "cuda_ipc":  # attach: {GPU uuid: [handle per slot]} (slot_table)
            self.engine_maps = self.obj.maps_weight_slots
            if self.engine_maps:
                self.obj.attach_weight_slots(attach)
            else:
                device = _this_device()
                self.slots = [ipc_rebuild(h, device) for h in slots_for_device(attach, device)]
        else:
            host, port, world = group_addr
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            size = max(b.nbytes for b in buckets)
            self.slots = [torch.empty(size, dtype=torch.uint8, device=device)]
            self.group = _new_broadcast_group(host, port, rank, world, device.type)

    def expect_adapters(self, manifest: dict) -> None:
        """LoRA adapter push: every later push brings the adapters of ``manifest`` and is merged here
        (:class:`chatlearn.models.rollout.lora_push.AdapterMerge`)."""
        self.merge = AdapterMerge(manifest, _merge_device())

    def begin(self) -> None:
        if self.merge is not None:
            self.merge.begin(self.obj)
            return
        self.obj.begin_weight_update()

    def recv(self, k: int, slot: int, *_after) -> None:
        """Load bucket k (``_after``: object refs the caller makes this call wait for: the
        trainer ranks' ``send`` of bucket k)."""
        index = self.buckets[k]
        if self.transport == "cuda_ipc" and self.engine_maps:
            self.obj.load_weight_slot(slot, index_rows(index))  # returns once read
            return
        if self.transport == "broadcast":
            buf = self.slots[0][:index.nbytes]
            _broadcast(self.group, buf)
        else:
            s = self.slots[slot]
            buf = (s.tensor if isinstance(s, ShmSlot) else s)[:index.nbytes]
        if self.merge is not None:
            self.merge.take(self.obj, bucket_views(index, buf))
        else:
            self.obj.load_weight_bucket(bucket_views(index, buf))
        if self.transport == "cuda_ipc":
            device_stream(buf.device).synchronize()  # read out before the sender may refill the slot

    def finish(self) -> None:
        if self.merge is not None:
            self.merge.finish(self.obj)
            return
        self.obj.finish_weight_update()

    def close_receiver(self) -> None:
        """``cuda_ipc``: drop the mappings of this push's slots."""
        if self.transport != "cuda_ipc":
            return
        if self.engine_maps:
            self.obj.detach_weight_slots()
        self.slots = []
        gc.collect()


# ------------------------------------------------------------------ fused rollout (runtime_args.fuse_rollout)
def local_push(trainer, rollout, bucket_bytes: int) -> int:
    """The weight push of a rollout replica that lives in its trainer rank's process: every trainer
    rank runs this at once (a collective). Bucket by bucket, as planned for the streamed push, the
    ranks gather the full tensors (``export_tensors``: on rank 0); with one rank the replica loads them
    as they are (no copy beyond its own), with several rank 0 packs the bucket into one buffer and
    broadcasts it over the trainers' process group, and each rank's replica loads the views. A LoRA
    adapter push (the view's ``manifest``) goes through an ``AdapterMerge`` kept on the rollout. Returns
    the bytes loaded."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    view = push_view(trainer)
    buckets = plan_buckets(view.weight_specs(), bucket_bytes)
    merge = _local_merge(rollout, adapter_manifest(view))
    if merge is not None:
        begin, finish = (lambda: merge.begin(rollout)), (lambda: merge.finish(rollout))
        load = lambda weights: merge.take(rollout, weights)  # noqa: E731
    else:
        begin, load, finish = rollout.begin_weight_update, rollout.load_weight_bucket, rollout.finish_weight_update
    begin()
    for index in buckets:
        if world == 1:
            load([(name, t) for name, t in view.export_tensors(index.names)])
            continue
        buf = torch.empty(index.nbytes, dtype=torch.uint8, device=torch.device(trainer.device))
        gather_bucket(trainer, index, buf)
        dist.broadcast(buf, src=0)
        load(bucket_views(index, buf))
    finish()
    return sum(b.nbytes for b in buckets)


def _local_merge(rollout, manifest: dict | None):
    """The ``AdapterMerge`` of a fused replica for ``manifest`` (made on its first adapter push and kept on
    the rollout object), or None for a full push."""
    if manifest is None:
        return None
    merge = rollout.__dict__.get("_chatlearn_adapter_merge")
    if merge is None:
        merge = AdapterMerge(manifest, _merge_device())
        rollout.__dict__["_chatlearn_adapter_merge"] = merge
    return merge
