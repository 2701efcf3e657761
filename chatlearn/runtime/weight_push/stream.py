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
* ``cuda_ipc`` (same device group, CUDA): one set of ``depth`` slots per GPU, owned by the
  trainer rank on that GPU (with full colocation trainer rank d and the rollout worker on GPU d
  share the device). Rank 0 writes each bucket into its slot and the trainers' own process
  group broadcasts it into the other ranks' slots (all ranks are in the export's lockstep
  anyway; NCCL, device to device). Before ``send`` returns, every rank synchronizes its CUDA
  stream, so no replica reads a slot whose copies are still queued (the CUDA IPC handle does not
  order later writes; verl and OpenRLHF synchronize before handing out handles likewise). The
  slots are shared as CUDA IPC handles (``torch.multiprocessing.reductions.reduce_tensor``)
  keyed by the GPU's UUID; a receiver maps the slots of its own GPU (:func:`slots_for_device`,
  :func:`ipc_rebuild`), in the rollout actor or, for an engine whose workers run in processes
  of their own (vLLM), inside each worker, and synchronizes its stream after loading, before
  the slot may be refilled. The slots exist only during a push: opened at its start, and after
  it the receivers drop their mappings, then every trainer rank deletes its slots, collects
  the IPC references (``torch.cuda.ipc_collect``) and empties its CUDA cache, so no weight
  buffer stays on a GPU between pushes (the rollout's KV cache and the trainer's state need
  that memory).
* ``broadcast`` (different device groups): rank 0 broadcasts each slot to the replicas over a
  process group of its own (rank 0 + one rank per replica; gloo on CPU, NCCL on CUDA), created
  once from a ``TCPStore`` hosted by trainer rank 0 (like vLLM's ``StatelessProcessGroup``), so
  it does not touch the trainers' default group nor vLLM's.

The rollout side receives a bucket as ``(name, tensor)`` views of the buffer, valid only during
``load_weight_bucket``, between ``begin_weight_update()`` and ``finish_weight_update()``.
"""
from __future__ import annotations

import gc
import mmap
import os
import tempfile
import uuid
from datetime import timedelta
from typing import Callable

import torch

# the bucket plan and layout, and the CUDA IPC slot helpers, are shared with the rollout engines
# (chatlearn.models): they live in the models layer
from chatlearn.models.weight_buckets import (  # noqa: F401 (ALIGN, Entry, entry_views: re-exported)
    ALIGN,
    BucketIndex,
    Entry,
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


def _share_among_ranks(buf: torch.Tensor) -> None:
    """Copy rank 0's ``buf`` into every trainer rank's (the trainers' default process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(buf, src=0)


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


def _new_broadcast_group(host: str, port: int, rank: int, world: int, device_type: str):
    """A process group of its own (not the default one) from a TCPStore hosted by rank 0."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=GROUP_TIMEOUT)
    store = dist.PrefixStore("chatlearn_weight_sync", store)
    if device_type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, world)
    return dist.ProcessGroupGloo(store, rank, world, GROUP_TIMEOUT)


def _broadcast(group, tensor: torch.Tensor) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


# ------------------------------------------------------------------ actor-side endpoint

def gather_bucket(trainer, index: BucketIndex, buf, held: Callable | None = None) -> None:
    """Gather bucket ``index`` of ``trainer``'s weights (``export_tensors``: a collective of its ranks)
    into ``buf`` on rank 0, laid out as :func:`bucket_views` reads it; the other ranks' ``buf`` is left
    as it is. ``held(tensor)``: told of each full tensor before it is copied and dropped."""
    views = dict(bucket_views(index, buf)) if trainer.rank == 0 else {}
    for name, tensor in trainer.export_tensors(index.names):
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
        self.transport = None
        self.group = None
        self.engine_maps = False  # cuda_ipc receiver: the engine's workers hold the mappings
        self.peak_live_bytes = 0  # trainer side: max bytes of slots + gathered tensors alive

    # -- trainer side
    def specs(self) -> dict:
        return {"specs": self.obj.weight_specs(), "device": torch.device(self.obj.device).type}

    def open_sender(self, transport: str, buckets: list, depth: int, group_addr=None) -> dict:
        """Allocate the ``depth`` slots (``cuda_ipc``: on every rank, on its GPU; else on rank 0);
        returns what the replicas need to attach."""
        self.transport, self.buckets = transport, buckets
        size = max(b.nbytes for b in buckets)
        device = torch.device(self.obj.device)
        if transport == "cuda_ipc":
            self.slots = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(depth)]
            return {"uuid": device_uuid(device), "handles": [ipc_share(t) for t in self.slots]}
        if self.obj.rank != 0:
            return {}
        if transport == "shm":
            tag = uuid.uuid4().hex[:12]
            self.slots = [ShmSlot(os.path.join(_shm_dir(), f"chatlearn-weights-{tag}-{i}"), size, True)
                          for i in range(depth)]
            return {"paths": [s.path for s in self.slots], "nbytes": size}
        self.slots = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(depth)]
        host, port, world = group_addr
        self.group = _new_broadcast_group(host, port, 0, world, device.type)
        return {}

    def release_names(self) -> None:
        """Unlink the shm files once every replica has mapped them (the mappings stay valid)."""
        for s in self.slots:
            if isinstance(s, ShmSlot):
                s.unlink()

    def send(self, k: int, slot: int) -> int:
        """Gather bucket k (all trainer ranks), write it into slot ``slot`` on rank 0, and for
        ``broadcast`` send it; ``cuda_ipc``: copy it into every rank's slot and wait until the
        bytes are on the device. Returns the bucket's bytes."""
        index = self.buckets[k]
        buf = None
        if self.slots:
            s = self.slots[slot]
            buf = (s.tensor if isinstance(s, ShmSlot) else s)[:index.nbytes]
        slots_bytes = sum((s.nbytes if isinstance(s, ShmSlot) else s.numel()) for s in self.slots)

        def held(tensor) -> None:
            self.peak_live_bytes = max(self.peak_live_bytes, slots_bytes + tensor.numel() * tensor.element_size())

        gather_bucket(self.obj, index, buf, held)
        if self.transport == "cuda_ipc":
            _share_among_ranks(buf)
            # The copies run asynchronously on this stream: the replicas are let in (this call
            # returns) only once they are done.
            device_stream(buf.device).synchronize()
        elif self.transport == "broadcast" and buf is not None:
            _broadcast(self.group, buf)
        return index.nbytes

    def close_sender(self) -> None:
        """``cuda_ipc``: free this rank's slots (every replica has dropped its mappings)."""
        if self.transport != "cuda_ipc" or not self.slots:
            return
        device = self.slots[0].device
        self.slots = []
        _release_cached(device)

    def stats(self) -> dict:
        return {"peak_live_bytes": self.peak_live_bytes}

    # -- rollout side
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

    def begin(self) -> None:
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
        self.obj.load_weight_bucket(bucket_views(index, buf))
        if self.transport == "cuda_ipc":
            device_stream(buf.device).synchronize()  # read out before the sender may refill the slot

    def finish(self) -> None:
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
    broadcasts it over the trainers' process group, and each rank's replica loads the views. Returns
    the bytes loaded."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    buckets = plan_buckets(trainer.weight_specs(), bucket_bytes)
    rollout.begin_weight_update()
    for index in buckets:
        if world == 1:
            rollout.load_weight_bucket([(name, t) for name, t in trainer.export_tensors(index.names)])
            continue
        buf = torch.empty(index.nbytes, dtype=torch.uint8, device=torch.device(trainer.device))
        gather_bucket(trainer, index, buf)
        dist.broadcast(buf, src=0)
        rollout.load_weight_bucket(bucket_views(index, buf))
    rollout.finish_weight_update()
    return sum(b.nbytes for b in buckets)
