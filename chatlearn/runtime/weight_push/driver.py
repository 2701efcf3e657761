"""The driver's side of the streaming weight push (the protocol and the trainer/rollout sides are in
:mod:`chatlearn.runtime.weight_push.stream`): which transport a placement uses, and ``WeightPush``, which
plans the buckets and drives the trainers' sends and the replicas' loads (or, with a fused rollout,
``runtime_args.fuse_rollout``, the copy each trainer rank makes into the replica of its own process).
No torch here: the driver does not import it.
"""
from __future__ import annotations

import time


from chatlearn.calls import get
from chatlearn.logging.console import info as console_info
from chatlearn.models.weight_buckets import BucketIndex, SlotPlan, plan_buckets, plan_slots, slot_table

DEPTH = 2  # buckets in flight
TRANSPORTS = ("shm", "cuda_ipc", "broadcast")


def choose_transport(plan, device_type: str) -> str:
    """``shm`` / ``cuda_ipc`` when policy and policy_trainer share a device group (CPU / CUDA),
    ``broadcast`` when they are on different device groups (and, see ``WeightPush._setup``, when
    a replica runs on another node than trainer rank 0)."""
    same = plan.placements["policy"].device_group == plan.placements["policy_trainer"].device_group
    if same:
        return "cuda_ipc" if device_type == "cuda" else "shm"
    return "broadcast"



class WeightPush:
    """Pushes the trainer's weights into every rollout replica (see the module docstring).

    Set up once (bucket plan; ``shm`` slots, the broadcast group; ``cuda_ipc``: the slot plan
    from the GPUs of every trainer rank and replica, and the host slots of the replicas on GPUs
    without a trainer rank) on the first ``push`` and reused by every later one; ``cuda_ipc``
    GPU slots are made by each push and freed after it. ``transport`` overrides the choice by
    placement (tests, benchmarks).
    """

    def __init__(self, trainer_group, rollout_group, plan, cfg, transport: str | None = None,
                 depth: int = DEPTH):
        self.trainer, self.rollout = trainer_group, rollout_group
        self.plan, self.cfg = plan, cfg
        self.depth = depth
        self.transport = transport
        self.buckets: list[BucketIndex] | None = None
        self.slot_plan: SlotPlan | None = None  # cuda_ipc
        self.adapters: dict | None = None  # LoRA adapter push: the trainer's manifest (stream.adapter_manifest)
        self.fused_asked = False  # fuse_rollout: the manifest was asked for

    def _setup(self) -> None:
        trainers, replicas = self.trainer.actors, self.rollout.actors
        info = get(trainers[0].sync.remote("specs"))
        if self.transport is None:
            self.transport = choose_transport(self.plan, info["device"])
            if self.transport != "broadcast":
                # shared memory and CUDA IPC reach only processes of trainer rank 0's node
                nodes = get([a.address.remote() for a in [trainers[0], *replicas]])
                if any(host != nodes[0][0] for host, _ in nodes[1:]):
                    self.transport = "broadcast"
        self.adapters = info["adapters"]
        self._adapter_transport()
        if self.transport not in TRANSPORTS:
            raise ValueError(f"unknown weight-sync transport {self.transport!r}; use one of {TRANSPORTS}")
        self.buckets = plan_buckets(info["specs"], self._bucket_bytes())
        if self.adapters is not None:  # every replica merges the adapters it receives
            get([r.sync.remote("expect_adapters", self.adapters) for r in self.rollout.actors])
        addr = None
        if self.transport == "broadcast":
            host, port = get(trainers[0].address.remote())
            addr = (host, port, 1 + len(replicas))
        if self.transport == "cuda_ipc":  # GPU slots are opened by each push and freed after it
            self.slot_plan = self._plan_slots()
            return
        senders = [a.sync.remote("open_sender", self.transport, self.buckets, self.depth, addr)
                   for a in trainers]
        if self.transport == "broadcast":  # every member joins the group at the same time
            get(senders + [r.sync.remote("open_receiver", self.transport, self.buckets, {},
                                              addr, i + 1) for i, r in enumerate(replicas)])
            return
        attach = get(senders)[0]
        get([r.sync.remote("open_receiver", self.transport, self.buckets, attach)
                 for r in replicas])
        get(trainers[0].sync.remote("release_names"))

    def _adapter_transport(self) -> None:
        """A LoRA adapter push goes over host shared memory where a full push would map CUDA IPC slots:
        the adapters are a few MB (one device-to-host copy by trainer rank 0), no GPU slot is made and
        freed per push, and the replica merges them in its own process (``lora_push.AdapterMerge``)."""
        if self.adapters is not None and self.transport == "cuda_ipc":
            self.transport = "shm"

    def _plan_slots(self) -> SlotPlan:
        """``cuda_ipc``: ask every trainer rank and replica for its GPUs (:func:`plan_slots`); the
        replicas on a GPU without a trainer rank get host shared-memory slots that trainer rank 0
        fills (made here, once, and kept), with one line on the console saying so."""
        trainers, replicas = self.trainer.actors, self.rollout.actors
        plan = plan_slots(get([a.sync.remote("sender_gpu") for a in trainers]),
                          get([r.sync.remote("receiver_gpus") for r in replicas]))
        if plan.shm_replicas:
            console_info(f"weight push (cuda_ipc): rollout replica(s) {list(plan.shm_replicas)} use a GPU with "
                         "no trainer rank, so they read each bucket from host shared memory (one device-to-host "
                         f"copy by trainer rank 0); replica(s) {list(plan.ipc_replicas)} map the trainer ranks' "
                         "GPU slots")
            attach = get(trainers[0].sync.remote("open_host_slots", self.buckets, self.depth))
            get([replicas[i].sync.remote("open_receiver", "shm", self.buckets, attach)
                     for i in plan.shm_replicas])
            get(trainers[0].sync.remote("release_names"))
        return plan

    def _open_ipc(self) -> None:
        """Every trainer rank opens its part of the slot plan (all at once: the first push makes
        the broadcast's process group, a collective); the ``ipc_replicas`` map the owners' slots."""
        trainers, replicas = self.trainer.actors, self.rollout.actors
        table = slot_table(get([a.sync.remote("open_sender", self.transport, self.buckets, self.depth,
                                                  None, self.slot_plan) for a in trainers]))
        get([replicas[i].sync.remote("open_receiver", self.transport, self.buckets, table)
                 for i in self.slot_plan.ipc_replicas])

    def _close_ipc(self) -> None:
        """Receivers unmap first, then the ranks free their GPU slots (the host slots stay)."""
        replicas = self.rollout.actors
        get([replicas[i].sync.remote("close_receiver") for i in self.slot_plan.ipc_replicas])
        get([a.sync.remote("close_sender") for a in self.trainer.actors])

    def push(self) -> dict:
        """One full push; returns ``{"sync/bytes": bytes per replica, "sync/push_gbps": GB/s}``
        (1 GB = 1e9 bytes; the time covers gather, transport and the engines' loads)."""
        if self.plan is not None and self.plan.fused_rollout:
            return self._push_in_process()
        if self.buckets is None:
            self._setup()
        start = time.perf_counter()
        trainers, replicas = self.trainer.actors, self.rollout.actors
        ipc = self.transport == "cuda_ipc"
        if ipc:  # the owners' slots, mapped by the replicas on their GPUs
            self._open_ipc()
        get([r.sync.remote("begin") for r in replicas])
        loads: list[list] = []
        sends: list = []
        for k in range(len(self.buckets)):
            slot = k % self.depth
            if k >= self.depth:
                get(loads[k - self.depth])  # slot is free once every replica has loaded it
            refs = [a.sync.remote("send", k, slot) for a in trainers]
            after = [] if self.transport == "broadcast" else refs  # broadcast: meet in it
            loads.append([r.sync.remote("recv", k, slot, *after) for r in replicas])
            sends += refs
        get([ref for refs in loads for ref in refs])
        get(sends)
        get([r.sync.remote("finish") for r in replicas])
        if ipc:
            self._close_ipc()
        return _push_metrics(sum(b.nbytes for b in self.buckets), time.perf_counter() - start, self.adapters)

    def _push_in_process(self) -> dict:
        """``runtime_args.fuse_rollout``: each trainer rank loads the replica in its own process
        (``chatlearn.runtime.weight_push.stream.local_push``, one call on every rank)."""
        start = time.perf_counter()
        loaded = get([a.push_weights_local.remote("policy", self._bucket_bytes()) for a in self.trainer.actors])
        if not self.fused_asked:  # once: whether the trainer pushes adapters (for sync/full_bytes)
            self.adapters = get(self.trainer.actors[0].sync.remote("specs"))["adapters"]
            self.fused_asked = True
        return _push_metrics(loaded[0], time.perf_counter() - start, self.adapters)

    def _bucket_bytes(self) -> int:
        return int(float(self.cfg.runtime_args.coalesced_buffer_mb) * 2 ** 20)


def _push_metrics(nbytes: int, seconds: float, adapters: dict | None = None) -> dict:
    """``sync/bytes`` (per replica) and ``sync/push_gbps`` (1 GB = 1e9 bytes) of one push; with a LoRA
    adapter push also ``sync/full_bytes``, what a push of the merged weights would have sent."""
    out = {"sync/bytes": float(nbytes), "sync/push_gbps": nbytes / max(seconds, 1e-9) / 1e9}
    if adapters is not None:
        out["sync/full_bytes"] = float(adapters["full_bytes"])
    return out
