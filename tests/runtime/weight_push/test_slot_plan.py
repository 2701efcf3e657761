"""The ``cuda_ipc`` push when trainer and rollout use different GPU counts (stream.py's docstring).

The slot plan (``chatlearn.models.weight_buckets.plan_slots``) as a pure function of the GPUs of
the trainer ranks and the replicas, then whole pushes through the real ``WeightPush`` on the CPU
twin of CUDA IPC (``ipc_twin.py``, strict about torch's IPC reference counting and about a process
mapping only its own GPU):

* fewer rollout GPUs than trainer ranks: the ranks on GPUs without a replica allocate, share and
  broadcast nothing, and no shared slot is left held after any push (before: each of them shared
  2 slots per push that no replica mapped, which torch never frees);
* more rollout GPUs than trainer ranks: the replicas on GPUs without a trainer rank read host
  shared memory that rank 0 fills with one device-to-host copy per bucket (before: the first
  push raised "no trainer rank on GPU ...");
* a tensor-parallel replica whose engine spans GPUs with and without a trainer rank.

The bytes each path moves are counted: this is the measure of the design in stream.py's docstring.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from ipc_twin import EngineRollout, IpcTwin, LoggingRollout, LoggingTrainer, TwinActor  # this folder

from chatlearn.models import weight_buckets as wb
from chatlearn.runtime.weight_push import driver as wp
from chatlearn.runtime.weight_push import stream as ws

SHAPES = [(32, 32)] * 6  # 4 KiB each in float32; 8 KiB buckets: 3 buckets of 2 tensors
MODEL_BYTES = 6 * 32 * 32 * 4
BUCKET_BYTES = 8 * 1024


# ------------------------------------------------------------------ the plan, a pure function

@pytest.mark.parametrize("trainers,replicas,owners,members,ipc,shm", [
    # one rank and one replica per GPU: every rank owns, every replica maps
    (["A", "B"], [["A"], ["B"]], (0, 1), (0, 1), (0, 1), ()),
    # fewer rollout GPUs: ranks 2 and 3 hold nothing and stay out of the broadcast
    (["A", "B", "C", "D"], [["A"], ["B"]], (0, 1), (0, 1), (0, 1), ()),
    # more rollout GPUs: the replicas on C and D read host memory
    (["A", "B"], [["A"], ["B"], ["C"], ["D"]], (0, 1), (0, 1), (0, 1), (2, 3)),
    # tensor parallel 2: replica 1 spans C (a trainer rank) and D (none): host memory, whole
    (["A", "B", "C"], [["A", "B"], ["C", "D"]], (0, 1), (0, 1), (0,), (1,)),
    # rank 0's GPU has no replica: it still gathers and broadcasts, but shares nothing
    (["A", "B"], [["B"]], (1,), (0, 1), (0,), ()),
    # two ranks on one GPU: the lower one owns the slots
    (["A", "A"], [["A"]], (0,), (0,), (0,), ()),
    # no GPU in common: no GPU slot anywhere, rank 0 gathers straight into host memory
    (["A"], [["B"]], (), (), (), (0,)),
])
def test_plan_slots(trainers, replicas, owners, members, ipc, shm):
    plan = wb.plan_slots(trainers, replicas)
    assert (plan.owners, plan.members, plan.ipc_replicas, plan.shm_replicas) == (owners, members, ipc, shm)


def test_plan_matches_torch_and_nvml_spellings_of_a_uuid():
    torch_uuid = "8e3e1d4f-0c2a-4b6e-9f10-123456789abc"  # str(get_device_properties(d).uuid)
    nvml_uuid = "GPU-8E3E1D4F-0C2A-4B6E-9F10-123456789ABC"  # nvmlDeviceGetUUID, as a vLLM actor reads it
    plan = wb.plan_slots([torch_uuid], [[nvml_uuid], ["GPU-ffffffff-0000-0000-0000-000000000000"]])
    assert plan.ipc_replicas == (0,) and plan.shm_replicas == (1,)


def test_visible_gpu_uuids_read_through_nvml_without_cuda(monkeypatch):
    from chatlearn.logging import gpu_memory

    handles = {"0": "GPU-aaa", "3": b"GPU-ddd"}  # older pynvml answers bytes
    nvml = SimpleNamespace(nvmlDeviceGetHandleByIndex=lambda i: str(i), nvmlDeviceGetUUID=handles.__getitem__)
    monkeypatch.setattr(gpu_memory, "load_nvml", lambda: nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,3")
    monkeypatch.setattr(ws, "device_uuid", lambda device: pytest.fail("torch asked: a CUDA context"))
    assert ws._visible_gpu_uuids() == ["GPU-aaa", "GPU-ddd"]


# ------------------------------------------------------------------ whole pushes on the CPU twin

def _push(monkeypatch, trainer_gpus: list[str], replicas: list, pushes: int = 2):
    """Run ``pushes`` pushes of ranks on ``trainer_gpus`` into ``replicas`` (``(gpu, rollout)`` or
    an EngineRollout's GPUs); after each, every replica holds the trainer's weights and no shared
    slot is left held. Returns the twin, the actors and the console lines."""
    twin = IpcTwin(monkeypatch)
    lines: list[str] = []
    monkeypatch.setattr(wp, "console_info", lines.append, raising=False)
    trainers = [TwinActor(twin, gpu, LoggingTrainer(SHAPES, r, twin.log)) for r, gpu in enumerate(trainer_gpus)]
    actors = []
    for spec in replicas:
        if isinstance(spec, list):  # an engine on several GPUs whose workers map the slots
            actors.append(TwinActor(twin, spec[0], EngineRollout(twin, spec), gpus=spec))
        else:
            actors.append(TwinActor(twin, spec, LoggingRollout(twin, spec)))
    cfg = SimpleNamespace(runtime_args=SimpleNamespace(coalesced_buffer_mb=BUCKET_BYTES / 2 ** 20))
    sync = wp.WeightPush(SimpleNamespace(actors=trainers), SimpleNamespace(actors=actors), None, cfg,
                         transport="cuda_ipc")
    weights = trainers[0].endpoint.obj.weights
    for _ in range(pushes):
        twin.log.clear()
        out = sync.push()
        assert out["sync/bytes"] == MODEL_BYTES and len(sync.buckets) == 3
        for actor in actors:
            got = actor.endpoint.obj.got
            assert set(got) == set(weights)
            assert all(torch.equal(got[n], t) for n, t in weights.items())
        assert twin.held() == {}  # every shared slot was mapped, released and collected
        assert all(not t.endpoint.slots for t in trainers)  # no GPU slot between pushes
    return twin, trainers, actors, lines


def test_fewer_rollout_gpus_than_trainer_ranks_share_no_unmapped_slot(monkeypatch):
    twin, trainers, actors, lines = _push(monkeypatch, ["GPU-0", "GPU-1", "GPU-2", "GPU-3"],
                                          ["GPU-0", "GPU-1"], pushes=3)
    assert twin.shared == 3 * 2 * wp.DEPTH  # 2 slots on GPU-0 and GPU-1 per push, none elsewhere
    # GPU-2 and GPU-3: no slot, no broadcast, no copy; they only took part in the gathers
    assert not any(e[1] in ("GPU-2", "GPU-3") for e in twin.log if e[0] in ("bcast", "sync", "release"))
    assert {e[1] for e in twin.log if e[0] == "export"} == {0, 1, 2, 3}
    assert dict(twin.nccl) == {1: 3 * MODEL_BYTES}  # the broadcast reaches rank 1 only, M per push
    assert twin.to_host == 0 and not lines
    assert [a.endpoint.obj.reads for a in actors] == [{"ipc": 3 * MODEL_BYTES}] * 2  # read in place


def test_more_rollout_gpus_than_trainer_ranks_read_host_memory(monkeypatch):
    twin, trainers, actors, lines = _push(monkeypatch, ["GPU-0", "GPU-1"],
                                          ["GPU-0", "GPU-1", "GPU-2", "GPU-3"], pushes=2)
    # the measure of the mixed push, per push of M bytes: M over NCCL into rank 1's slots, M device
    # to host once (for both host readers), M read in place per GPU-slot replica and M loaded from
    # host memory per replica on a GPU without a trainer rank
    assert dict(twin.nccl) == {1: 2 * MODEL_BYTES}
    assert twin.to_host == 2 * MODEL_BYTES
    reads = [dict(a.endpoint.obj.reads) for a in actors]
    assert reads == [{"ipc": 2 * MODEL_BYTES}] * 2 + [{"host": 2 * MODEL_BYTES}] * 2
    assert twin.shared == 2 * 2 * wp.DEPTH
    assert len(lines) == 1 and "replica(s) [2, 3]" in lines[0] and "host shared memory" in lines[0]
    # each bucket reaches the host before a host reader loads it
    for k, index in enumerate(trainers[0].endpoint.buckets):
        copied = [i for i, e in enumerate(twin.log) if e == ("to_host", "GPU-0")][k]
        loads = [i for i, e in enumerate(twin.log) if e[0] == "load" and e[1] in ("GPU-2", "GPU-3")
                 and e[2] == tuple(index.names)]
        assert len(loads) == 2 and copied < min(loads)
    # the host slots are made once (first push) and stay mapped; their files are gone
    host = trainers[0].endpoint.host_slots
    assert len(host) == wp.DEPTH and not any(os.path.exists(s.path) for s in host)
    assert all(a.endpoint.transport == "shm" for a in actors[2:])


def test_tensor_parallel_replica_partly_on_gpus_without_a_trainer_rank(monkeypatch):
    twin, trainers, actors, lines = _push(monkeypatch, ["GPU-0", "GPU-1", "GPU-2"],
                                          [["GPU-0", "GPU-1"], ["GPU-2", "GPU-3"]], pushes=2)
    # replica 0: each worker maps its own GPU's slots (ranks 0 and 1); replica 1: host memory
    maps = [e for e in twin.log if e[0] == "map"]
    assert sorted({(reader, owner) for _, reader, owner in maps}) == [("GPU-0", "GPU-0"), ("GPU-1", "GPU-1")]
    assert dict(actors[0].endpoint.obj.reads) == {"ipc": 2 * 2 * MODEL_BYTES}  # 2 workers, 2 pushes
    assert dict(actors[1].endpoint.obj.reads) == {"host": 2 * MODEL_BYTES}
    assert not any(e[1] == "GPU-2" for e in twin.log if e[0] in ("bcast", "release"))  # rank 2: nothing
    assert len(lines) == 1 and "replica(s) [1]" in lines[0]
