"""models.policy.kv_cache fit: the KV cache of generation_batch_size sequences at full length."""
from __future__ import annotations

import json

import pytest

from chatlearn.models.rollout import kv_cache

QWEN2_7B = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
            "hidden_size": 3584, "sliding_window": 131072, "max_window_layers": 28,
            "use_sliding_window": False, "layer_types": ["full_attention"] * 28}


def test_bytes_per_token_of_grouped_query_attention():
    # 2 (K, V) x 28 layers x 4 KV heads x 128 dims x 2 bytes = 57,344 bytes per token
    assert kv_cache.bytes_per_token(QWEN2_7B, "bfloat16") == 2 * 28 * 4 * 128 * 2 == 57344
    assert kv_cache.bytes_per_token(QWEN2_7B, "float32") == 2 * 57344
    assert kv_cache.bytes_per_token(QWEN2_7B, "bfloat16", tp=2) == 57344 // 2
    # more ranks than KV heads: each rank keeps one head
    assert kv_cache.bytes_per_token(QWEN2_7B, "bfloat16", tp=8) == 2 * 28 * 1 * 128 * 2
    assert kv_cache.bytes_per_token(dict(QWEN2_7B, head_dim=64), "bfloat16") == 57344 // 2
    no_gqa = {k: v for k, v in QWEN2_7B.items() if k != "num_key_value_heads"}
    assert kv_cache.bytes_per_token(no_gqa, "bfloat16") == 57344 * 7


@pytest.mark.parametrize("extra", [{"kv_lora_rank": 512}, {"layer_types": ["linear_attention", "full_attention"]}])
def test_caches_of_another_shape_are_left_to_the_engine(extra):
    assert kv_cache.bytes_per_token(dict(QWEN2_7B, **extra), "bfloat16") is None


def test_fit_tokens_round_every_sequence_to_whole_blocks():
    assert kv_cache.fit_tokens(256, 80, 128) == (256 * 1 + 1) * 128
    assert kv_cache.fit_tokens(4, 3072, 16) == (4 * 192 + 1) * 16
    assert kv_cache.fit_tokens(8, 100, 1) == 801


def test_fit_of_a_model_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": QWEN2_7B}))
    sized = kv_cache.fit(str(tmp_path), "bfloat16", 64, 1000, 1, 0.8)  # no CUDA here: no cap
    assert sized.tokens == (64 * 8 + 1) * 128 and sized.bytes == sized.tokens * 57344
    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN2_7B, kv_lora_rank=512)))
    sized = kv_cache.fit(str(tmp_path), "bfloat16", 64, 1000, 1, 0.8)
    assert sized.bytes is None and "not the standard" in sized.note


def test_fit_is_capped_by_what_the_device_has(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_7B))
    monkeypatch.setattr(kv_cache, "checkpoint_bytes", lambda path, dtype: 15 * 2**30)
    # 25 GiB left once the 15 GiB of weights and a quarter of them (activations) are set aside
    monkeypatch.setattr(kv_cache, "cuda_room", lambda util: 40 * 2**30 + 15 * 2**30 // 4)
    assert kv_cache.fit(str(tmp_path), "bfloat16", 64, 4096, 1, 0.8).bytes == (64 * 32 + 1) * 128 * 57344
    sized = kv_cache.fit(str(tmp_path), "bfloat16", 512, 4096, 1, 0.8)  # 112 GiB
    assert sized.bytes is None and "more than about 25.0 GiB" in sized.note
