"""The ``cuda_ipc`` weight push on a real GPU: a sender process (trainer ranks) and a receiver
process (one rollout replica) on the same device, started with ``torch.multiprocessing`` spawn.

The sender holds two trainer ranks: rank 0, whose GPU the replica maps, and rank 1, planned on a
GPU without a replica (``plan_slots``), which must allocate and share nothing: a slot shared but
never mapped is never freed by torch (the leak of more trainer ranks than rollout GPUs). Every push
writes other weights (scaled by the push's number), and the receiver checks the bytes it loads,
bucket by bucket, against its own copy.

Memory. Device free memory (``torch.cuda.mem_get_info``) is what a leak shows in, but it also
counts what is no slot: the receiver's caching allocator (the comparisons allocate), the kernels
that CUDA loads into device memory the first time each process uses them (lazy module loading),
and the receiver's IPC mappings. So the first push is a warm-up (same kernels, same caches) and is
not measured; after each later push the receiver has unmapped the slots and emptied its cache (its
reserved memory is back to its baseline, checked), the sender has freed its slots (allocated and
reserved back), and free memory is back to where it was before that push and before the first
measured push (no growth over pushes), within ``LEAK_BOUND``, far below one slot.

With ``expandable_segments:True`` in the sender (``use_expandable_segments``) the slots must still
be segments of their own (shared by ``cudaIpcGetMemHandle``, not ``pidfd_getfd``, which
unprivileged containers refuse), and the sender's other allocations stay expandable.
"""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(1024, 4096)] * 8  # 16 MiB each in float32
BUCKET_BYTES = 32 * 2 ** 20  # 4 buckets of 2 tensors: 2 slots of 32 MiB, 64 MiB per push
PUSHES = 4  # push 0 warms up; pushes 1..3 are measured
# Free memory is counted in 2 MiB pages; besides, torch's receiver opens one CUDA IPC event per
# mapped slot and never closes it (THPStorage_newSharedCuda), a few bytes each. 8 MiB is well
# below one slot (32 MiB): a single slot left behind in any measured push fails the test.
LEAK_BOUND = 8 * 2 ** 20
TIMEOUT = 300


def _weights(device, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(s, generator=g).to(device) * scale for i, s in enumerate(SHAPES)}


class Trainer:
    device = "cuda:0"

    def __init__(self, rank: int):
        self.rank, self.scale = rank, 1.0
        self.weights = _weights(self.device) if rank == 0 else {}

    def weight_specs(self):
        return [(f"w{i}", "float32", s, i) for i, s in enumerate(SHAPES)]

    def export_tensors(self, names):
        for name in names:  # a fresh "gathered" tensor on rank 0, as FSDP's full_tensor
            yield name, (self.weights[name] * self.scale if self.rank == 0 else None)


class Rollout:
    maps_weight_slots = False  # the receiving process maps the slots (as for HF and SGLang)

    def __init__(self):
        self.expected = _weights("cuda:0")
        self.scale = 1.0
        self.checked: list[str] = []

    def begin_weight_update(self):
        self.checked = []

    def load_weight_bucket(self, weights):
        for name, view in weights:
            assert view.device.type == "cuda"
            assert torch.equal(view, self.expected[name] * self.scale), name  # this push's bytes, whole
            self.checked.append(name)

    def finish_weight_update(self):
        pass


def _expandable(tensors) -> list[bool]:
    """Whether each tensor lies in an expandable segment (the allocator's snapshot)."""
    segments = torch.cuda.memory._snapshot()["segments"]
    out = []
    for t in tensors:
        ptr = t.data_ptr()
        seg = next(s for s in segments if s["address"] <= ptr < s["address"] + s["total_size"])
        out.append(bool(seg["is_expandable"]))
    return out


def _one_push(p, endpoints, plan, buckets, to_recv, from_recv) -> dict:
    """Push ``p`` from both ranks; returns its memory readings."""
    from chatlearn.runtime.weight_push import driver as wp
    from chatlearn.runtime.weight_push import stream as ws

    for e in endpoints:
        e.obj.scale = float(p + 1)
    alloc0, reserved0, free0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]
    opened = [e.open_sender("cuda_ipc", buckets, wp.DEPTH, None, plan) for e in endpoints]
    assert opened[1] == {} and not endpoints[1].slots  # rank 1: no replica on its GPU, no slot
    slots_expandable = _expandable(endpoints[0].slots)
    to_recv.put((p, buckets, ws.slot_table(opened)))
    assert from_recv.get(timeout=TIMEOUT) == ("attached", p)
    for k in range(len(buckets)):
        if k >= wp.DEPTH:
            assert from_recv.get(timeout=TIMEOUT) == ("loaded", p, k - wp.DEPTH)
        for e in endpoints:  # the ranks' sends run at once in a real run; in order is the same here
            e.send(k, k % wp.DEPTH)
        to_recv.put(("sent", p, k))
    for k in range(max(0, len(buckets) - wp.DEPTH), len(buckets)):
        assert from_recv.get(timeout=TIMEOUT) == ("loaded", p, k)
    during = torch.cuda.mem_get_info()[0]
    to_recv.put(("close", p))
    assert from_recv.get(timeout=TIMEOUT) == ("closed", p)
    for e in endpoints:
        e.close_sender()
    torch.cuda.synchronize()
    return {"alloc": (alloc0, torch.cuda.memory_allocated()), "reserved": (reserved0, torch.cuda.memory_reserved()),
            "free": (free0, during, torch.cuda.mem_get_info()[0]), "slots_expandable": slots_expandable}


def _sender(expandable, to_recv, from_recv, result):
    assert ("expandable_segments:True" in os.environ["PYTORCH_CUDA_ALLOC_CONF"]) == expandable
    from chatlearn.models import weight_buckets as wb
    from chatlearn.runtime.weight_push import driver as wp
    from chatlearn.runtime.weight_push import stream as ws

    torch.cuda.set_device(0)
    endpoints = [ws.Endpoint(Trainer(0)), ws.Endpoint(Trainer(1))]
    torch.cuda.synchronize()
    weights_expandable = _expandable([endpoints[0].obj.weights["w0"]])
    assert from_recv.get(timeout=TIMEOUT) == "ready"  # the receiver's own memory is taken
    gpu = wb.device_uuid(torch.device("cuda", 0))
    plan = wb.plan_slots([gpu, "GPU-without-a-replica"], [[gpu]])
    assert (plan.owners, plan.members) == ((0,), (0,))
    buckets = ws.plan_buckets(endpoints[0].obj.weight_specs(), BUCKET_BYTES)
    pushes = [_one_push(p, endpoints, plan, buckets, to_recv, from_recv) for p in range(PUSHES)]
    to_recv.put("done")
    probe = torch.empty(16 * 2 ** 20, dtype=torch.uint8, device="cuda:0")  # after the pushes
    result.put({"buckets": len(buckets), "slot_bytes": wp.DEPTH * max(b.nbytes for b in buckets),
                "pushes": pushes, "weights_expandable": weights_expandable,
                "probe_expandable": _expandable([probe])})


def _receiver(to_recv, from_recv, result):
    from chatlearn.runtime.weight_push import driver as wp
    from chatlearn.runtime.weight_push import stream as ws

    torch.cuda.set_device(0)
    rollout = Rollout()
    endpoint = ws.Endpoint(rollout)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the temporaries of _weights: the baseline is the weights alone
    alloc0, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    from_recv.put("ready")
    checked, after = [], []
    while (msg := to_recv.get(timeout=TIMEOUT)) != "done":
        p, buckets, table = msg
        rollout.scale = float(p + 1)
        endpoint.open_receiver("cuda_ipc", buckets, table)
        from_recv.put(("attached", p))
        endpoint.begin()
        for k in range(len(buckets)):
            assert to_recv.get(timeout=TIMEOUT) == ("sent", p, k)
            endpoint.recv(k, k % wp.DEPTH)
            from_recv.put(("loaded", p, k))
        endpoint.finish()
        assert to_recv.get(timeout=TIMEOUT) == ("close", p)
        endpoint.close_receiver()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # what the comparisons cached goes back to the device
        checked.append(sorted(rollout.checked))
        after.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
        from_recv.put(("closed", p))
    result.put({"checked": checked, "baseline": (alloc0, reserved0), "after": after})


def _run(fn, *args):
    """Run ``fn`` and report an exception through the last queue instead of hanging the peer."""
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001
        args[-1].put({"error": repr(e)})
        raise


@pytest.mark.timeout(600)
@pytest.mark.parametrize("expandable", [False, True], ids=["plain", "expandable_segments"])
def test_cuda_ipc_push_between_processes_and_memory_returns(expandable, monkeypatch):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    to_recv, from_recv, sent, got = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_run, args=(_sender, expandable, to_recv, from_recv, sent)),
             ctx.Process(target=_run, args=(_receiver, to_recv, from_recv, got))]
    # the sender's environment, as worker_env gives a trainer with use_expandable_segments (the
    # allocator reads it when CUDA starts); the receiver's without it, as a rollout's
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True" if expandable else "")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    procs[0].start()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    procs[1].start()
    try:
        sender, receiver = sent.get(timeout=TIMEOUT), got.get(timeout=TIMEOUT)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert "error" not in sender and "error" not in receiver, (sender, receiver)
    assert receiver["checked"] == [sorted(f"w{i}" for i in range(len(SHAPES)))] * PUSHES
    assert sender["buckets"] >= 4
    # the setting took effect in the sender, the slots avoided it, and it is back on afterwards
    assert sender["weights_expandable"] == [expandable] and sender["probe_expandable"] == [expandable]
    assert all(push["slots_expandable"] == [False] * 2 for push in sender["pushes"])
    assert all(after == receiver["baseline"] for after in receiver["after"])  # unmapped, cache emptied
    first = sender["pushes"][1]["free"][0]  # before the first measured push
    for p, push in enumerate(sender["pushes"]):
        alloc0, alloc1 = push["alloc"]
        reserved0, reserved1 = push["reserved"]
        assert alloc1 == alloc0 and reserved1 <= reserved0, p  # slots and gathered tensors freed
        free0, during, after = push["free"]
        assert free0 - during >= sender["slot_bytes"], p  # the measure sees the slots
        if p >= 1:  # after the warm-up: back where it was, and no growth over the pushes
            assert after >= free0 - LEAK_BOUND, (p, (free0 - after) / 2 ** 20)
            assert after >= first - LEAK_BOUND, (p, (first - after) / 2 ** 20)
