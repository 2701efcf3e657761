"""The transformers rollout gives offloaded memory back to the device: after its storages
are freed, ``torch.cuda.empty_cache()`` returns the caching allocator's blocks (a recorder
stands in for CUDA on this machine; the ``gpu`` test measures ``memory_reserved``)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_rollout_cpu import _spec, model_dirs, prompts, restore_threads  # noqa: F401
from tiny_model import make_tiny_model

SAMPLING = {"temperature": 0.7, "max_tokens": 8, "seed": 3}


def test_hf_offload_empties_the_cuda_cache_after_freeing(model_dirs, restore_threads, monkeypatch):  # noqa: F811
    from chatlearn.models.rollout.hf import HFRollout

    rollout = HFRollout(_spec(model_dirs["old"]))
    before = rollout.generate(prompts(), SAMPLING)
    calls = []

    def empty_cache():  # records whether the weights were already freed when called
        calls.append(all(p.untyped_storage().nbytes() == 0 for p in rollout.model.parameters()))

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(rollout, "device", torch.device("cuda", 0))
    assert rollout.offload(["weights", "kv_cache"])["bytes"] > 0
    assert calls == [True]
    monkeypatch.setattr(rollout, "device", torch.device("cpu"))
    rollout.onload(["weights", "kv_cache"])
    after = rollout.generate(prompts(), SAMPLING)
    for key in before:
        assert np.array_equal(before[key], after[key]), key
    rollout.offload(["weights"])  # on the CPU: nothing to empty
    rollout.onload(["weights"])
    assert calls == [True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hf_offload_returns_cuda_memory(tmp_path):
    """A model with 64 MiB of float32 weights (vocab 131072 x hidden 128, tied): after
    generate + offload, ``memory_reserved`` is back within 8 MiB of what it was before the
    model was loaded (the rotary buffers and allocator rounding stay); without
    ``empty_cache`` the freed weights and KV blocks would stay reserved (>= 64 MiB), and without
    clearing the cuBLAS workspace its 32 MiB (Hopper) would."""
    from chatlearn.models.rollout.hf import HFRollout

    path = make_tiny_model(str(tmp_path / "wide"), seed=0, vocab_size=131072)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    rollout = HFRollout(_spec(path, device="cuda"))
    loaded = torch.cuda.memory_reserved()
    assert loaded - base >= 64 * 2**20
    before = rollout.generate(prompts(), SAMPLING)
    rollout.offload(["weights", "kv_cache"])
    assert torch.cuda.memory_reserved() <= base + 8 * 2**20
    rollout.onload(["weights", "kv_cache"])
    after = rollout.generate(prompts(), SAMPLING)
    for key in before:
        assert np.array_equal(before[key], after[key]), key
