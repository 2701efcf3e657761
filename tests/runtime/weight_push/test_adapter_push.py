"""The driver's side of a LoRA adapter push (chatlearn/runtime/weight_push/driver.py): a trainer whose
``push_view()`` carries a manifest makes every replica expect adapters, goes over host shared memory where a
full push would map CUDA IPC slots, and reports the adapters' bytes (``sync/bytes``) beside the merged
model's (``sync/full_bytes``). Ray is the stand-in of ``ipc_twin.py`` (calls run at once)."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from safetensors.torch import save_file

from chatlearn.runtime.weight_push import driver as wp
from chatlearn.runtime.weight_push import stream as ws

Q, K = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
A, B = "model.layers.0.self_attn.q_proj.lora_A.weight", "model.layers.0.self_attn.q_proj.lora_B.weight"


class AdapterTrainer:
    """Trainer rank 0 whose push view sends A and B of one adapted layer (q_proj, scale 2)."""

    def __init__(self, base: str):
        self.rank, self.device = 0, "cpu"
        g = torch.Generator().manual_seed(0)
        self.tensors = {A: torch.randn(2, 16, generator=g), B: torch.randn(16, 2, generator=g)}
        self.manifest = {"base": base, "layers": [[Q, A, B, 2.0, False]], "saved": [], "full_bytes": 4096,
                         "renames": {}}

    def push_view(self):
        return self

    def weight_specs(self):
        return [(n, "float32", tuple(t.shape), i) for i, (n, t) in enumerate(self.tensors.items())]

    def export_tensors(self, names):
        for name in names:
            yield name, self.tensors[name].clone()


class Rollout:
    maps_weight_slots = True  # with cuda_ipc its workers would map the slots: an adapter push must not

    def __init__(self):
        self.calls, self.got = [], {}

    def begin_partial_weight_update(self, modules):
        self.calls.append(("begin", tuple(modules)))

    def load_weight_bucket(self, weights):
        self.got.update({n: t.clone() for n, t in weights})

    def finish_weight_update(self):
        self.calls.append(("finish",))


class Actor:
    def __init__(self, obj):
        self.endpoint = ws.Endpoint(obj)
        self.sync = SimpleNamespace(remote=lambda op, *args: getattr(self.endpoint, op)(*args))


def test_adapter_push_expects_adapters_over_shm_and_reports_both_sizes(tmp_path, monkeypatch):
    base = {Q: torch.randn(16, 16), K: torch.randn(16, 16)}
    save_file(base, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(wp, "get", lambda x, timeout=None: x)
    trainer, rollouts = AdapterTrainer(str(tmp_path)), [Rollout(), Rollout()]
    cfg = SimpleNamespace(runtime_args=SimpleNamespace(coalesced_buffer_mb=1.0))
    sync = wp.WeightPush(SimpleNamespace(actors=[Actor(trainer)]), SimpleNamespace(actors=[Actor(r) for r in rollouts]),
                         None, cfg, transport="cuda_ipc")
    for _ in range(2):
        out = sync.push()
        assert sync.transport == "shm"
        assert out["sync/bytes"] == 2 * 16 * 2 * 4  # A and B, float32
        assert out["sync/full_bytes"] == 4096
        merged = base[Q] + (trainer.tensors[B] @ trainer.tensors[A]) * 2.0
        for r in rollouts:
            assert r.calls[-2:] == [("begin", ("model.layers.0.self_attn",)), ("finish",)]
            assert set(r.got) == {Q, K}  # the whole group: k_proj from the base folder
            assert torch.allclose(r.got[Q], merged, atol=1e-6) and torch.equal(r.got[K], base[K])


def test_full_push_reports_no_full_bytes():
    assert set(wp._push_metrics(100, 1.0)) == {"sync/bytes", "sync/push_gbps"}
    assert wp._push_metrics(100, 1.0, {"full_bytes": 400})["sync/full_bytes"] == 400.0
