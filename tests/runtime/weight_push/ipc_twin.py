"""A CPU twin of the ``cuda_ipc`` weight push (``chatlearn/runtime/weight_push/stream.py``), for the
tests of this folder: trainer ranks and rollout replicas are :class:`TwinActor` objects "on" named
GPUs, driven by the real ``WeightPush`` through a Ray stand-in whose calls run at once, in order.

:class:`IpcTwin` replaces the CUDA-only seams of the push (``device_uuid``, ``ipc_share``,
``ipc_rebuild``, ``device_stream``, the trainers' broadcast, the copy to host, the release of the
slots) with fakes that are strict where the real ones are:

* a process maps only memory of its own GPU (``ipc_rebuild`` of another GPU's handle raises);
* torch's CUDA IPC reference counting (torch/csrc/StorageSharing.cpp, ``THPStorage_shareCuda``;
  torch/csrc/CudaIPCTypes.cpp, ``GetNewRefCountedSentData``, ``CudaIPCSentDataDelete``,
  ``CudaIPCSentDataLimbo::collect``): sharing a slot makes a sent block whose counter starts at 1
  and which holds the slot's memory; a receiver's mapping decrements the counter when it is
  released; only ``torch.cuda.ipc_collect`` (the push's ``_release_cached``) in the sharing
  process frees blocks, and only those whose counter is 0. A slot shared but never mapped stays
  held for good: :meth:`IpcTwin.held` reports it as a leak.

Bytes are counted where the push moves them: ``nccl`` (the trainers' device broadcast, per
receiving rank), ``to_host`` (rank 0's device-to-host copies), and per replica the bytes it loaded
from mapped GPU slots (``ipc``) or from host memory (``host``).
"""
from __future__ import annotations

import contextlib
import gc
import weakref
from collections import defaultdict

import torch

from chatlearn.models import weight_buckets as wb
from chatlearn.runtime.weight_push import driver as wp
from chatlearn.runtime.weight_push import stream as ws


class FakeTrainer:
    """A trainer rank 0 whose export is instrumented: every gathered tensor is counted while it
    is alive (weakref finalizers), and the peak of those bytes is recorded."""

    def __init__(self, shapes: list[tuple]):
        self.rank, self.device = 0, "cpu"
        g = torch.Generator().manual_seed(0)
        self.weights = {f"p{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
        self.live = 0
        self.peak = 0

    def weight_specs(self):
        return [(n, "float32", tuple(t.shape), i) for i, (n, t) in enumerate(self.weights.items())]

    def _gone(self, nbytes):
        self.live -= nbytes

    def export_tensors(self, names):
        for name in names:
            full = self.weights[name].clone()  # a "gathered" full tensor
            nbytes = full.numel() * full.element_size()
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(full, self._gone, nbytes)
            yield name, full
            del full


class FakeRollout:
    maps_weight_slots = False  # with cuda_ipc the receiving process maps the slots itself

    def __init__(self):
        self.got = {}

    def begin_weight_update(self):
        self.got = {}

    def load_weight_bucket(self, weights):
        for name, view in weights:
            self.got[name] = view.clone()

    def finish_weight_update(self):
        pass


class SentBlock:
    """A shared slot as torch's ``CudaIPCSentData`` keeps it: its memory (held), its GPU, the
    process that shared it, and the consumers' reference counter (1 when shared)."""

    def __init__(self, owner, gpu: str, tensor: torch.Tensor):
        self.owner, self.gpu, self.tensor, self.counter = owner, gpu, tensor, 1
        self.nbytes = tensor.numel() * tensor.element_size()


class IpcTwin:
    """CUDA IPC on the CPU (see the module docstring); every device-side step is logged in order."""

    def __init__(self, monkeypatch):
        self.gpu = None  # the GPU the running call is on
        self.actor = None  # the TwinActor whose call is running
        self.log: list[tuple] = []
        self.sent: dict[int, SentBlock] = {}  # handle key -> block, until ipc_collect frees it
        self.shared = 0  # handles made
        self.wire = None  # the trainers' broadcast
        self.mapped: list = []  # weakrefs of every rebuilt view
        self.slots: list = []  # weakrefs of every shared slot tensor
        self.nccl: dict[int, int] = defaultdict(int)  # bytes the broadcast put into rank r's slot
        self.to_host = 0  # bytes rank 0 copied from its GPU slot into its host slot
        twin = self

        class Stream:
            def __init__(self, gpu):
                self.gpu = gpu

            def synchronize(self):
                twin.log.append(("sync", self.gpu))

        for module in (ws, wb):
            monkeypatch.setattr(module, "device_uuid", lambda device: self.gpu)
            monkeypatch.setattr(module, "ipc_share", self._share)
            monkeypatch.setattr(module, "ipc_rebuild", self._rebuild)
        monkeypatch.setattr(ws, "device_stream", lambda device: Stream(self.gpu))
        monkeypatch.setattr(ws, "_this_device", lambda: torch.device("cpu"))
        monkeypatch.setattr(ws, "_visible_gpu_uuids", lambda: list(self.actor.gpus), raising=False)
        monkeypatch.setattr(ws, "_share_among_ranks", self._share_among_ranks)
        monkeypatch.setattr(ws, "_copy_to_host", self._copy_to_host, raising=False)
        monkeypatch.setattr(ws, "_release_cached", self._ipc_collect)
        # Ray: calls run at once, in submission order; refs are the results
        monkeypatch.setattr(wp, "get", lambda x, timeout=None: x)

    @contextlib.contextmanager
    def on(self, gpu: str):
        """Run the block "on" ``gpu`` (an engine worker of a replica that spans several GPUs)."""
        saved, self.gpu = self.gpu, gpu
        try:
            yield
        finally:
            self.gpu = saved

    def _share(self, tensor):
        key = self.shared
        self.shared += 1
        self.sent[key] = SentBlock(self.actor, self.gpu, tensor)
        self.slots.append(weakref.ref(tensor))
        return ("ipc", key)

    def _rebuild(self, handle, device):
        block = self.sent[handle[1]]  # KeyError: the handle of a block freed already
        if block.gpu != self.gpu:
            raise RuntimeError(f"CUDA IPC: a process on {self.gpu} cannot map memory of {block.gpu}")
        self.log.append(("map", self.gpu, block.gpu))
        view = block.tensor[:]
        self.mapped.append(weakref.ref(view))
        weakref.finalize(view, self._unmapped, handle[1])  # the consumer's storage deleter
        return view

    def _unmapped(self, key: int) -> None:
        if key in self.sent:
            self.sent[key].counter -= 1

    def _ipc_collect(self, device) -> None:
        """``_release_cached``: ``torch.cuda.ipc_collect`` of this process frees its blocks whose
        counter is 0 (``CudaIPCSentDataLimbo::collect``); the others stay."""
        self.log.append(("release", self.gpu))
        for key, block in list(self.sent.items()):
            if block.owner is self.actor and block.counter <= 0:
                del self.sent[key]

    def _share_among_ranks(self, buf, group=None):
        rank = self.actor.rank
        self.log.append(("bcast", self.gpu))
        if rank == 0:
            self.wire = buf.clone()
        else:
            buf.copy_(self.wire)
            self.nccl[rank] += buf.numel() * buf.element_size()

    def _copy_to_host(self, host, buf):
        self.log.append(("to_host", self.gpu))
        host.copy_(buf)
        self.to_host += buf.numel() * buf.element_size()

    def held(self) -> dict[str, int]:
        """Bytes of shared slots not freed, by GPU (after a push: leaked)."""
        out: dict[str, int] = defaultdict(int)
        for block in self.sent.values():
            out[block.gpu] += block.nbytes
        return dict(out)

    def source(self, view: torch.Tensor) -> str:
        """``ipc`` when ``view`` is memory of a shared slot, else ``host``."""
        ptr = view.untyped_storage().data_ptr()
        return "ipc" if any(b.tensor.untyped_storage().data_ptr() == ptr for b in self.sent.values()) else "host"


class TwinActor:
    """A Ray actor of the twin: ``sync.remote(op, *args)`` runs ``Endpoint.op`` "on" ``gpu``
    (``gpus``: every GPU of a replica whose engine spans several)."""

    def __init__(self, twin: IpcTwin, gpu: str, obj, gpus: list[str] | None = None):
        self.endpoint, self.gpu = ws.Endpoint(obj), gpu
        self.rank = getattr(obj, "rank", None)
        self.gpus = list(gpus) if gpus else [gpu]

        def remote(op, *args):
            saved = twin.gpu, twin.actor
            twin.gpu, twin.actor = gpu, self
            try:
                return getattr(self.endpoint, op)(*args)
            finally:
                twin.gpu, twin.actor = saved

        self.sync = type("Method", (), {"remote": staticmethod(remote)})


class LoggingTrainer(FakeTrainer):
    def __init__(self, shapes, rank: int, log: list):
        super().__init__(shapes)
        self.rank, self.log = rank, log

    def export_tensors(self, names):
        for name, full in super().export_tensors(names):
            self.log.append(("export", self.rank, name))
            yield name, (full if self.rank == 0 else None)


class LoggingRollout(FakeRollout):
    """Logs its loads and counts their bytes by where they come from (``twin.source``)."""

    def __init__(self, twin: IpcTwin, gpu: str):
        super().__init__()
        self.twin, self.log, self.gpu = twin, twin.log, gpu
        self.reads: dict[str, int] = defaultdict(int)

    def load_weight_bucket(self, weights):
        self.log.append(("load", self.gpu, tuple(n for n, _ in weights)))
        for _, view in weights:
            self.reads[self.twin.source(view)] += view.numel() * view.element_size()
        super().load_weight_bucket(weights)


class EngineRollout(LoggingRollout):
    """A replica whose engine spans ``gpus`` and whose workers map the slots themselves, one per
    GPU (as vLLM's ``WorkerExtension.chatlearn_ipc_attach`` / ``_load`` / ``_detach`` do)."""

    maps_weight_slots = True

    def __init__(self, twin: IpcTwin, gpus: list[str]):
        super().__init__(twin, gpus[0])
        self.gpus, self.workers = list(gpus), {}

    def attach_weight_slots(self, table: dict) -> None:
        for gpu in self.gpus:
            with self.twin.on(gpu):
                self.workers[gpu] = [wb.ipc_rebuild(h, None) for h in wb.slots_for_device(table, None)]

    def load_weight_slot(self, slot: int, rows: list) -> None:
        for gpu in self.gpus:
            with self.twin.on(gpu):
                views = wb.entry_views(rows, self.workers[gpu][slot])
                self.log.append(("load", gpu, tuple(n for n, _ in views)))
                for name, view in views:
                    self.reads[self.twin.source(view)] += view.numel() * view.element_size()
                    self.got[name] = view.clone()
                ws.device_stream(None).synchronize()

    def detach_weight_slots(self) -> None:
        self.workers = {}
        gc.collect()
