"""The ``cuda_ipc`` weight push on a real GPU: a sender process (one trainer rank) and a receiver
process (one rollout replica) on the same device, started with ``torch.multiprocessing`` spawn.
The sender writes every bucket into its slot and hands it over; the receiver checks the bytes it
loads, bucket by bucket, against its own copy of the weights. After the push the receiver has
unmapped the slots and the sender has freed them: the sender's allocated and reserved CUDA memory
are back where they were before the push, and so is the device's free memory.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = [(1024, 4096)] * 8  # 16 MiB each in float32
BUCKET_BYTES = 32 * 2 ** 20
TIMEOUT = 300


def _weights(device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(s, generator=g).to(device) for i, s in enumerate(SHAPES)}


class Trainer:
    rank = 0
    device = "cuda:0"

    def __init__(self):
        self.weights = _weights(self.device)

    def weight_specs(self):
        return [(n, "float32", tuple(t.shape), i) for i, (n, t) in enumerate(self.weights.items())]

    def export_tensors(self, names):
        for name in names:
            yield name, self.weights[name] * 1.0  # a fresh "gathered" tensor, as FSDP's full_tensor


class Rollout:
    maps_weight_slots = False  # the receiving process maps the slots (as for HF and SGLang)

    def __init__(self):
        self.expected = _weights("cuda:0")
        self.checked: list[str] = []

    def begin_weight_update(self):
        pass

    def load_weight_bucket(self, weights):
        for name, view in weights:
            assert view.device.type == "cuda"
            assert torch.equal(view, self.expected[name]), name  # no half-written bytes
            self.checked.append(name)

    def finish_weight_update(self):
        pass


def _sender(to_recv, from_recv, result):
    from chatlearn.runtime.weight_push import driver as wp
    from chatlearn.runtime.weight_push import stream as ws

    torch.cuda.set_device(0)
    trainer = Trainer()
    torch.cuda.synchronize()
    assert from_recv.get(timeout=TIMEOUT) == "ready"  # the receiver's own memory is taken
    alloc0, reserved0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    free0 = torch.cuda.mem_get_info()[0]
    endpoint = ws.Endpoint(trainer)
    buckets = ws.plan_buckets(trainer.weight_specs(), BUCKET_BYTES)
    opened = endpoint.open_sender("cuda_ipc", buckets, wp.DEPTH)
    to_recv.put((buckets, ws.slot_table([opened])))
    assert from_recv.get(timeout=TIMEOUT) == "attached"
    for k in range(len(buckets)):
        if k >= wp.DEPTH:
            assert from_recv.get(timeout=TIMEOUT) == ("loaded", k - wp.DEPTH)
        endpoint.send(k, k % wp.DEPTH)
        to_recv.put(("sent", k))
    for k in range(max(0, len(buckets) - wp.DEPTH), len(buckets)):
        assert from_recv.get(timeout=TIMEOUT) == ("loaded", k)
    during = torch.cuda.mem_get_info()[0]
    to_recv.put("close")
    assert from_recv.get(timeout=TIMEOUT) == "closed"
    endpoint.close_sender()
    torch.cuda.synchronize()
    result.put({"buckets": len(buckets), "slot_bytes": wp.DEPTH * max(b.nbytes for b in buckets),
                "alloc": (alloc0, torch.cuda.memory_allocated()),
                "reserved": (reserved0, torch.cuda.memory_reserved()),
                "free": (free0, during, torch.cuda.mem_get_info()[0])})


def _receiver(to_recv, from_recv, result):
    from chatlearn.runtime.weight_push import driver as wp
    from chatlearn.runtime.weight_push import stream as ws

    torch.cuda.set_device(0)
    rollout = Rollout()
    endpoint = ws.Endpoint(rollout)
    torch.cuda.synchronize()
    from_recv.put("ready")
    buckets, table = to_recv.get(timeout=TIMEOUT)
    endpoint.open_receiver("cuda_ipc", buckets, table)
    from_recv.put("attached")
    endpoint.begin()
    for k in range(len(buckets)):
        assert to_recv.get(timeout=TIMEOUT) == ("sent", k)
        endpoint.recv(k, k % wp.DEPTH)
        from_recv.put(("loaded", k))
    endpoint.finish()
    assert to_recv.get(timeout=TIMEOUT) == "close"
    endpoint.close_receiver()
    torch.cuda.synchronize()
    from_recv.put("closed")
    result.put({"checked": sorted(rollout.checked)})


def _run(fn, *args):
    """Run ``fn`` and report an exception through the last queue instead of hanging the peer."""
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001
        args[-1].put({"error": repr(e)})
        raise


@pytest.mark.timeout(600)
def test_cuda_ipc_push_between_processes_and_memory_returns():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    to_recv, from_recv, sent, got = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_run, args=(_sender, to_recv, from_recv, sent)),
             ctx.Process(target=_run, args=(_receiver, to_recv, from_recv, got))]
    for p in procs:
        p.start()
    try:
        sender, receiver = sent.get(timeout=TIMEOUT), got.get(timeout=TIMEOUT)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert "error" not in sender and "error" not in receiver, (sender, receiver)
    assert receiver["checked"] == sorted(f"w{i}" for i in range(len(SHAPES)))
    assert sender["buckets"] >= 4
    alloc0, alloc1 = sender["alloc"]
    reserved0, reserved1 = sender["reserved"]
    assert alloc1 == alloc0 and reserved1 <= reserved0  # slots and gathered tensors are freed
    free0, during, after = sender["free"]
    assert free0 - during >= sender["slot_bytes"]  # the measure sees the slots
    assert after >= free0 - 8 * 2 ** 20  # and they are gone from the device after the push
