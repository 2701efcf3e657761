"""The SGLang adapter's own contract with the engine, against the fake engine on CPU, and
the fake's faithfulness where the shared contract tests (test_rollout_cpu.py) rely on it.

Each behaviour of the fake checked here is one the adapter must handle: a test that the fake
drops weights or keeps stale KV shows that the shared tests would fail on an adapter that
ignored it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_rollout_cpu import (MAX_RESPONSE, TOL, _cfg, fake_sglang, model_dirs,  # noqa: F401
                              prompts, push, reference, restore_threads, state_dict)

from chatlearn.errors import UserError

SAMPLING = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_tokens": MAX_RESPONSE, "seed": 5}


@pytest.fixture(scope="module")
def rollout(model_dirs, restore_threads):  # noqa: F811
    from chatlearn.models.rollout.sglang import SGLangRollout

    with fake_sglang():
        engine = SGLangRollout(_cfg(model_dirs["old"]))
    yield engine
    engine.shutdown()


@pytest.fixture
def spy(rollout, monkeypatch):
    """Records the keyword arguments of every ``engine.generate`` call."""
    calls = []
    real = rollout.engine.generate

    def generate(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(rollout.engine, "generate", generate)
    return calls


def test_engine_arguments_follow_the_config(model_dirs, monkeypatch):  # noqa: F811
    from chatlearn.models.rollout.sglang import SGLangRollout

    cfg = dict(_cfg(model_dirs["old"]), generation_batch_size=8, gpu_memory_utilization=0.4,
               enforce_eager=False, seed=99)
    with fake_sglang():
        import sglang

        seen = {}
        real = sglang.Engine

        class Recording(real):
            def __init__(self, **kwargs):
                seen.update(kwargs)
                super().__init__(**kwargs)

        monkeypatch.setattr(sglang, "Engine", Recording)
        engine = SGLangRollout(cfg)
    engine.shutdown()
    assert seen["model_path"] == cfg["load"] and seen["tp_size"] == 1
    assert seen["max_running_requests"] == 8 and seen["mem_fraction_static"] == 0.4
    assert seen["disable_cuda_graph"] is False and seen["random_seed"] == 99
    assert seen["context_length"] == cfg["max_prompt_tokens_length"] + cfg["max_response_tokens_length"]
    assert seen["dtype"] == "float32" and seen["skip_tokenizer_init"] is True
    assert seen["enable_memory_saver"] and seen["enable_weights_cpu_backup"]
    assert seen["enable_deterministic_inference"]


def test_sampling_parameters_per_request(rollout, spy):
    rollout.generate(prompts(3), {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 7,
                                  "seed": 40})
    rollout.generate(prompts(2), {"temperature": 0.0, "max_tokens": 5, "seed": 1})
    sampled, greedy = spy[0]["sampling_params"], spy[1]["sampling_params"]
    assert spy[0]["return_logprob"] is True and spy[0]["input_ids"] == prompts(3)
    assert [p["sampling_seed"] for p in sampled] == [40, 41, 42]
    assert {(p["temperature"], p["top_p"], p["top_k"], p["max_new_tokens"]) for p in sampled} == {
        (0.6, 0.95, 20, 7)}
    assert {(p["temperature"], p["top_k"], p["max_new_tokens"]) for p in greedy} == {(0.0, -1, 5)}
    assert all(p["stop_token_ids"] == rollout.eos_ids != [] for p in sampled + greedy)


def test_fake_rejects_unknown_arguments(model_dirs):  # noqa: F811
    with fake_sglang():
        import sglang

        with pytest.raises(TypeError):
            sglang.Engine(model_path=model_dirs["old"], skip_tokenizer_init=True, max_num_seqs=4)
        engine = sglang.Engine(model_path=model_dirs["old"], skip_tokenizer_init=True)
    with pytest.raises(TypeError):
        engine.generate(input_ids=[[5, 6]], sampling_params=[{"max_tokens": 4}])
    with pytest.raises(TypeError):
        engine.generate(input_ids=[[5, 6]], sampling_params=[{}], logprobs=True)
    with pytest.raises(TypeError):
        engine.update_weights_from_tensor([], flush=True)
    out = engine.generate(input_ids=[[5, 6]], sampling_params=[{"max_new_tokens": 3, "temperature": 0}],
                          return_logprob=True)[0]
    assert len(out["output_ids"]) == len(out["meta_info"]["output_token_logprobs"])
    assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    engine.shutdown()


def test_weights_survive_release_without_a_push(rollout):
    """The adapter starts the engine with a CPU copy of released weights (SGLang's
    ``enable_weights_cpu_backup``): generations after release/resume are identical."""
    before = rollout.generate(prompts(), SAMPLING)
    assert rollout.offload(["weights", "kv_cache"])["bytes"] > 0
    rollout.onload(["weights", "kv_cache"])
    after = rollout.generate(prompts(), SAMPLING)
    for key in before:
        assert np.array_equal(before[key], after[key]), key


def test_fake_release_really_drops_weights(model_dirs):  # noqa: F811
    with fake_sglang():
        import sglang

        engine = sglang.Engine(model_path=model_dirs["old"], skip_tokenizer_init=True,
                               enable_memory_saver=True)
    engine.release_memory_occupation(tags=["weights"])
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    engine.resume_memory_occupation(tags=["weights"])
    assert all(torch.isnan(p).all() for p in engine.model.parameters())  # no CPU backup
    engine.shutdown()


def test_stale_prefix_cache_is_flushed_after_a_push(rollout, reference, model_dirs):  # noqa: F811
    """The fake keeps each prompt's KV across calls and the adapter pushes with
    ``flush_cache=False``; without the flush before the next generation, the prompts'
    KV would come from the old weights."""
    rollout.generate(prompts(), SAMPLING)  # fills the cache under the old weights
    push(rollout, model_dirs["new"])
    batch = rollout.generate(prompts(), SAMPLING)
    np.testing.assert_allclose(batch["rollout_logprobs"], reference.logprobs("new", batch, 0.7),
                               atol=TOL, rtol=0)

    # the same push straight to the engine, without the flush: stale KV, wrong log-probs
    rollout.engine.update_weights_from_tensor(named_tensors=[
        (k, torch.from_numpy(v.copy())) for k, v in state_dict(model_dirs["old"])], flush_cache=False)
    stale = rollout.generate(prompts(), SAMPLING)
    assert np.abs(stale["rollout_logprobs"] - reference.logprobs("old", stale, 0.7)).max() > 1e-2
    rollout.engine.flush_cache()
    push(rollout, model_dirs["old"])


def test_tied_lm_head_is_not_sent(rollout, spy, monkeypatch):
    sent = []
    real = rollout.engine.update_weights_from_tensor

    def update(**kwargs):
        sent.extend(name for name, _ in kwargs["named_tensors"])
        return real(**kwargs)

    monkeypatch.setattr(rollout.engine, "update_weights_from_tensor", update)
    assert rollout._tied
    rollout.update_weights([("lm_head.weight", np.zeros((300, 128), np.float32))])
    assert sent == []


def test_missing_sglang_is_a_user_error(monkeypatch, model_dirs):  # noqa: F811
    from chatlearn.models.rollout.sglang import SGLangRollout

    monkeypatch.setitem(__import__("sys").modules, "sglang", None)  # import fails
    with pytest.raises(UserError, match=r"pip install -e '\.\[sglang\]'") as info:
        SGLangRollout(_cfg(model_dirs["old"]))
    assert info.value.key == "runtime_args.rollout_backend"


def test_original_logprob_switch_is_refused(monkeypatch, model_dirs):  # noqa: F811
    from chatlearn.models.rollout.sglang import SGLangRollout

    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with fake_sglang(), pytest.raises(UserError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        SGLangRollout(_cfg(model_dirs["old"]))


def test_streamed_push_copies_the_views(rollout, reference, model_dirs):  # noqa: F811
    """begin/load/finish as ``chatlearn.runtime.weight_sync`` calls them; each bucket's
    buffer is overwritten right after its load, as the sender reuses its slots."""
    weights = [(k, torch.from_numpy(v.copy())) for k, v in state_dict(model_dirs["new"])]
    rollout.begin_weight_update()
    for start in range(0, len(weights), 5):
        bucket = weights[start:start + 5]
        rollout.load_weight_bucket(bucket)
        for _, tensor in bucket:
            tensor.fill_(float("nan"))  # the slot is refilled with the next bucket
    rollout.finish_weight_update()
    batch = rollout.generate(prompts(), SAMPLING)
    np.testing.assert_allclose(batch["rollout_logprobs"], reference.logprobs("new", batch, 0.7),
                               atol=TOL, rtol=0)
    push(rollout, model_dirs["old"])
