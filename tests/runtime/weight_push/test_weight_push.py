"""Streamed weight push (chatlearn/runtime/weight_push/stream.py).

Unit tests: the bucket plan against an independent layout, the transport chosen by placement,
the trainer-side memory bound through an instrumented export, and the ``cuda_ipc`` push on its CPU
twin (``ipc_twin.py``; other GPU counts: ``test_slot_plan.py``). End to end (Ray, 2 FSDP
ranks on gloo): a push through each CPU transport (shared memory, gloo broadcast) into the hf
and vllm rollouts, after which the rollout's log-probs equal the trainer's within 1e-4 (fp32),
where before the push they differed by far more.
"""
from __future__ import annotations

import gc
import os

import backend_specs
import numpy as np
import pytest
import torch
from ipc_twin import FakeRollout, FakeTrainer, IpcTwin, LoggingRollout, LoggingTrainer, TwinActor  # this folder
from tiny_model import make_tiny_model  # tests/ is on sys.path (tests/conftest.py)

from chatlearn.models import weight_buckets as wb
from chatlearn.runtime.weight_push import driver as wp
from chatlearn.runtime.weight_push import stream as ws
from conftest import REPO

TOL = 1e-4
TEMPLATE = os.path.join(REPO, "template", "grpo_fsdp.yaml")


# ------------------------------------------------------------------ bucket plan

def test_plan_keeps_groups_whole_and_aligns_offsets():
    specs = [("a", "float32", (10,), 0), ("b", "float32", (3, 5), 1), ("c", "bfloat16", (7,), 1),
             ("d", "float32", (100,), 2), ("e", "float32", (2,), 3)]
    buckets = ws.plan_buckets(specs, bucket_bytes=200)
    # independent layout: a 40 B -> 64; group {b 60 -> 64, c 14} = 128 fits (192 <= 200);
    # d 400 B overflows -> own bucket; e next
    assert [b.names for b in buckets] == [["a", "b", "c"], ["d"], ["e"]]
    offsets = {e.name: e.offset for b in buckets for e in b.entries}
    assert offsets == {"a": 0, "b": 64, "c": 128, "d": 0, "e": 0}
    assert [b.nbytes for b in buckets] == [128 + 14, 400, 8]
    big = [("x", "float32", (4,), 0), ("y", "float32", (4,), 0)]  # one group, never split
    assert [b.names for b in ws.plan_buckets(big, bucket_bytes=8)] == [["x", "y"]]


def test_itemsize_of_dtypes_outside_the_table():
    import torch

    assert wb.itemsize("bfloat16") == 2
    for name in ("complex64", "float8_e4m3fnuz", "uint32"):  # not in ITEMSIZE: torch's own size
        assert wb.itemsize(name) == getattr(torch, name).itemsize
    with pytest.raises(ValueError, match="'float5' is not a torch dtype"):
        wb.itemsize("float5")


def test_bucket_views_round_trip():
    rng = np.random.default_rng(0)
    tensors = {"w": torch.from_numpy(rng.normal(size=(3, 4)).astype(np.float32)),
               "h": torch.from_numpy(rng.normal(size=5).astype(np.float16)),
               "b": torch.randn(6).to(torch.bfloat16)}
    specs = [(n, str(t.dtype).replace("torch.", ""), tuple(t.shape), i)
             for i, (n, t) in enumerate(tensors.items())]
    (index,) = ws.plan_buckets(specs, 1 << 20)
    buf = torch.zeros(index.nbytes, dtype=torch.uint8)
    for name, view in ws.bucket_views(index, buf):
        view.copy_(tensors[name])
    for e in index.entries:  # the bytes are where the index says, bit for bit
        raw = buf[e.offset:e.offset + e.nbytes].numpy().tobytes()
        assert raw == tensors[e.name].contiguous().view(torch.uint8).numpy().tobytes()


# ------------------------------------------------------------------ transport by placement

@pytest.mark.parametrize("colocation,device,expected", [
    ("[policy,policy_trainer,ref_policy]", "cpu", "shm"),
    ("[policy,policy_trainer,ref_policy]", "cuda", "cuda_ipc"),
    ("[policy_trainer,ref_policy]", "cpu", "broadcast"),
    ("[]", "cuda", "broadcast"),
])
def test_transport_follows_placement(paths_overrides, colocation, device, expected):
    from chatlearn.config.load import load_config
    from chatlearn.config.plan import make_plan

    cfg = load_config(TEMPLATE, paths_overrides + [f"runtime_args.colocation={colocation}"])
    plan = make_plan(cfg)
    same = plan.placements["policy"].device_group == plan.placements["policy_trainer"].device_group
    assert same == ("policy," in colocation)
    assert wp.choose_transport(plan, device) == expected


# ------------------------------------------------------------------ trainer-side memory bound

def test_sender_holds_two_buckets_beyond_its_shards():
    shapes = [(64, 64)] * 12 + [(256, 64)]  # 16 KiB each, one 64 KiB
    trainer, rollout = FakeTrainer(shapes), FakeRollout()
    model_bytes = sum(t.numel() * 4 for t in trainer.weights.values())
    bucket_bytes = 40 * 1024
    sender, receiver = ws.Endpoint(trainer), ws.Endpoint(rollout)
    buckets = ws.plan_buckets(trainer.weight_specs(), bucket_bytes)
    assert len(buckets) >= 4
    attach = sender.open_sender("shm", buckets, wp.DEPTH)
    slot_bytes = sum(os.stat(p).st_size for p in attach["paths"])
    receiver.open_receiver("shm", buckets, attach)
    sender.release_names()
    assert not any(os.path.exists(p) for p in attach["paths"])  # unlinked, still mapped
    receiver.begin()
    peak_total = 0
    for k in range(len(buckets)):
        sender.send(k, k % wp.DEPTH)
        gc.collect()
        peak_total = max(peak_total, slot_bytes + trainer.peak)
        receiver.recv(k, k % wp.DEPTH)
    receiver.finish()
    largest = max(b.nbytes for b in buckets)
    assert slot_bytes == wp.DEPTH * largest
    assert trainer.peak == 64 * 1024  # one gathered tensor at a time (the largest one)
    assert peak_total <= 2 * largest + 64 * 1024 < model_bytes + 64 * 1024
    for name, t in trainer.weights.items():
        assert torch.equal(rollout.got[name], t), name


# ------------------------------------------------------------------ cuda_ipc, CPU twin

def test_slot_table_one_owner_per_gpu(monkeypatch):
    table = ws.slot_table([{"uuid": "GPU-a", "handles": ["a0", "a1"]}, {},  # rank 1 shares no slots
                           {"uuid": "GPU-b", "handles": ["b0", "b1"]}])
    assert table == {"GPU-a": ["a0", "a1"], "GPU-b": ["b0", "b1"]}
    with pytest.raises(RuntimeError, match="rank 1 shares slots on GPU GPU-a, where another rank"):
        ws.slot_table([{"uuid": "GPU-a", "handles": []}, {"uuid": "GPU-a", "handles": []}])
    monkeypatch.setattr(wb, "device_uuid", lambda device: {0: "GPU-b", 1: "GPU-c"}[device])
    assert ws.slots_for_device(table, 0) == ["b0", "b1"]  # a receiver reads its own GPU's slots
    with pytest.raises(RuntimeError, match="no slots on GPU GPU-c .*host-memory slots"):
        ws.slots_for_device(table, 1)


def test_ipc_rebuild_puts_in_the_receivers_device_index():
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    seen = {}

    def fake_rebuild(tensor_cls, tensor_size, tensor_stride, tensor_offset, storage_cls, dtype,
                     storage_device, *rest):
        seen["device"] = storage_device
        return "tensor"

    fake_rebuild.__signature__ = __import__("inspect").signature(rebuild_cuda_tensor)
    handle = (fake_rebuild, (torch.Tensor, (4,), (1,), 0, None, torch.uint8, 3, b"h", 4, 0,
                             False, b"r", 0, b"e", True))
    assert ws.ipc_rebuild(handle, torch.device("cuda", 1)) == "tensor"
    assert seen["device"] == 1  # the sender called it 3; this process numbers it 1


def test_cuda_ipc_push_per_device_slots_sync_and_release(monkeypatch):
    from types import SimpleNamespace

    twin = IpcTwin(monkeypatch)
    shapes = [(32, 32)] * 6
    trainers = [TwinActor(twin, f"GPU-{r}", LoggingTrainer(shapes, r, twin.log)) for r in range(2)]
    rollouts = [LoggingRollout(twin, f"GPU-{r}") for r in range(2)]
    replicas = [TwinActor(twin, f"GPU-{r}", rollouts[r]) for r in range(2)]
    cfg = SimpleNamespace(runtime_args=SimpleNamespace(coalesced_buffer_mb=8 * 1024 / 2 ** 20))
    sync = wp.WeightPush(SimpleNamespace(actors=trainers), SimpleNamespace(actors=replicas), None,
                         cfg, transport="cuda_ipc")
    weights = trainers[0].endpoint.obj.weights
    for push in range(2):
        twin.log.clear()
        sync.push()
        assert len(sync.buckets) == 3
        for rollout in rollouts:
            assert set(rollout.got) == set(weights)
            for name, t in weights.items():
                assert torch.equal(rollout.got[name], t), name
        # each replica mapped the slots of its own GPU, i.e. those of the trainer rank there
        maps = [e for e in twin.log if e[0] == "map"]
        assert maps and all(reader == owner for _, reader, owner in maps)
        assert {reader for _, reader, _ in maps} == {"GPU-0", "GPU-1"}
        # per bucket, per rank: its copies, the broadcast, then the stream sync, before any load
        for k, index in enumerate(sync.buckets):
            first_load = min(i for i, e in enumerate(twin.log) if e[0] == "load" and e[2] == tuple(index.names))
            for rank in range(2):
                gpu = f"GPU-{rank}"
                exports = [i for i, e in enumerate(twin.log)
                           if e[0] == "export" and e[1] == rank and e[2] in index.names]
                bcast = [i for i, e in enumerate(twin.log) if e == ("bcast", gpu)][k]
                synced = [i for i, e in enumerate(twin.log) if e == ("sync", gpu)]
                sender_sync = [i for i in synced if bcast < i][0]
                assert max(exports) < bcast < sender_sync < first_load
        # each replica synchronizes after loading a bucket, before the slot can be refilled
        for gpu in ("GPU-0", "GPU-1"):
            loads = [i for i, e in enumerate(twin.log) if e[0] == "load" and e[1] == gpu]
            assert all(twin.log[i + 1] == ("sync", gpu) for i in loads)
        # released after the push: receivers unmap, then every rank frees its slots
        releases = [i for i, e in enumerate(twin.log) if e[0] == "release"]
        assert sorted(twin.log[i][1] for i in releases) == ["GPU-0", "GPU-1"]
        assert releases[0] > max(i for i, e in enumerate(twin.log) if e[0] == "load")
        assert all(not t.endpoint.slots for t in trainers + replicas)
        assert twin.held() == {}  # every shared slot mapped, released and collected
        gc.collect()
        assert all(ref() is None for ref in twin.mapped + twin.slots)  # nothing left allocated
        twin.mapped.clear()
        twin.slots.clear()
        assert twin.shared == 4 * (push + 1)  # 2 ranks x 2 slots, new ones every push


# ------------------------------------------------------------------ end to end on Ray

def trainer_spec(path: str):
    return backend_specs.trainer_spec(
        path, trust_remote_code=False, seed=0, trainable=True, lr=1e-3, weight_decay=0.0, adam_beta1=0.9,
        adam_beta2=0.999, adam_eps=1e-8, clip_grad=1.0, train_micro_batch_size=4, logprob_micro_batch_size=8,
        pos_clip_ratio=0.2, neg_clip_ratio=0.2, kl_coef=0.0, entropy_coef=0.0, gradient_checkpointing=False,
        bf16=False, packing=False, max_token_in_packing=32768, seq_length=None, train_global_batch_size=8,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, sequence_parallel=False,
        use_distributed_optimizer=False, meta_init=False, logprob_chunk_tokens=1024, share_prompt=None)


def rollout_spec(path: str):
    return backend_specs.rollout_spec(
        path, trust_remote_code=False, seed=1234, generation_batch_size=16, max_prompt_tokens_length=32,
        max_response_tokens_length=16, seq_length=None, dtype="float32", device="cpu", gpu_memory_utilization=0.5,
        kv_cache="fit", enforce_eager=True, tensor_model_parallel_size=1, max_num_batched_tokens=None,
        cpu_threads=1, deterministic_inference=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray
    from omegaconf import OmegaConf

    from chatlearn.runtime.cluster.group import create_group

    root = tmp_path_factory.mktemp("sync")
    old, new = make_tiny_model(str(root / "old"), seed=0), make_tiny_model(str(root / "new"), seed=1)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    common = dict(pg=None, bundles=[], gpu_fraction=0, cpus=0, threads=1)
    groups = {"trainer": create_group("policy_trainer", "chatlearn.models.trainer.fsdp:FSDPTrainer",
                                      trainer_spec(new), num_actors=2, distributed=True, **common)}
    for backend, factory in (("hf", "chatlearn.models.rollout.hf:HFRollout"),
                             ("vllm", "chatlearn.models.rollout.vllm:VLLMRollout")):
        if backend == "vllm" and not _has_vllm():
            continue
        groups[backend] = create_group("policy", factory, rollout_spec(old), num_actors=1,
                                       distributed=False, **common)
    cfg = OmegaConf.create({"runtime_args": {"coalesced_buffer_mb": 0.02}})  # ~20 KiB: many buckets
    yield {"groups": groups, "old": old, "cfg": cfg}
    ray.shutdown()


def _has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
        return True
    except ImportError:
        return False


def _load_old_weights(rollout, path: str) -> None:
    """Put the model folder's weights back into the rollout group, as one update of one bucket."""
    from safetensors.torch import load_file

    weights = [(k, v) for k, v in load_file(os.path.join(path, "model.safetensors")).items()
               if k != "lm_head.weight"]
    rollout.call("begin_weight_update")
    rollout.call("load_weight_bucket", weights)
    rollout.call("finish_weight_update")


def _prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 290, size=int(rng.integers(3, 10))).tolist() for _ in range(8)]


def _gap(groups, rollout) -> float:
    """max |rollout log-prob - trainer log-prob| over the sampled tokens of a fresh batch."""
    batch = rollout.call("generate", _prompts(), {"temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                                  "max_tokens": 16, "seed": 5})[0][0]
    logp = groups["trainer"].call("compute_logprobs", batch, 1.0)[0][0]
    off, plen = batch["offsets"], batch["prompt_lens"]
    mask = np.zeros(len(logp), bool)
    for i in range(len(plen)):
        mask[off[i] + plen[i]:off[i + 1]] = True
    return float(np.abs(batch["rollout_logprobs"][mask] - logp[mask]).max())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["shm", "broadcast"])
@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_push_reproduces_trainer_logprobs(cluster, backend, transport):
    groups = cluster["groups"]
    if backend not in groups:
        pytest.skip("vllm is not installed")
    rollout = groups[backend]
    _load_old_weights(rollout, cluster["old"])  # back to the "old" weights
    assert _gap(groups, rollout) > 1e-2  # the trainer holds other weights
    sync = wp.WeightPush(groups["trainer"], rollout, plan=None, cfg=cluster["cfg"], transport=transport)
    out = sync.push()
    assert len(sync.buckets) > 5
    specs = groups["trainer"].actors[0].sync.remote("specs")
    import ray

    names = [s[0] for s in ray.get(specs)["specs"]]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied: once
    assert out["sync/bytes"] == sum(b.nbytes for b in sync.buckets) > 0
    assert out["sync/push_gbps"] > 0
    assert _gap(groups, rollout) < TOL  # tied lm_head, q/k/v (GQA) all in place
    # the transport is set up once and reused: a second push after a reset works too
    _load_old_weights(rollout, cluster["old"])
    sync.push()
    assert _gap(groups, rollout) < TOL


# ------------------------------------------------------------------ mismatch metric

def test_mismatch_kl_is_the_k3_estimator_and_documented():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "metrics_doc", os.path.join(REPO, "tests", "support", "metrics_doc.py"))
    metrics_doc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(metrics_doc)
    undocumented = metrics_doc.undocumented

    from chatlearn.runtime.driver.observe import mismatch_kl

    rng = np.random.default_rng(0)
    rollout = -rng.uniform(0.1, 3.0, 1000).astype(np.float32)
    old = (rollout + rng.normal(0, 0.2, 1000)).astype(np.float32)
    # reference: sum over tokens of r - log r - 1 with r = p_trainer / p_rollout, in float64
    ratio = np.exp(old.astype(np.float64)) / np.exp(rollout.astype(np.float64))
    expected = float(np.mean(ratio - np.log(ratio) - 1))
    assert mismatch_kl(old, rollout) == pytest.approx(expected, rel=1e-9)
    assert mismatch_kl(rollout, rollout) == 0.0 and mismatch_kl(old[:0], rollout[:0]) == 0.0
    assert not undocumented(["train/mismatch_kl", "sync/bytes", "sync/push_gbps"])
