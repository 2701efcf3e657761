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
from test_rollout_cpu import (MAX_RESPONSE, TOL, fake_sglang, model_dirs,  # noqa: F401
                              prompts, push, reference, restore_threads, state_dict)
from test_rollout_cpu import _spec as _shared_spec

from chatlearn.errors import UserError

SAMPLING = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_tokens": MAX_RESPONSE, "seed": 5}


def _spec(load: str, **over):
    """The shared rollout settings, with deterministic inference on (the CPU default)."""
    return _shared_spec(load, **{"deterministic_inference": True, **over})


@pytest.fixture(scope="module")
def rollout(model_dirs, restore_threads):  # noqa: F811
    from chatlearn.models.rollout.sglang import SGLangRollout

    with fake_sglang():
        engine = SGLangRollout(_spec(model_dirs["old"]))
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

    spec = _spec(model_dirs["old"], generation_batch_size=8, gpu_memory_utilization=0.4, enforce_eager=False,
                 seed=99)
    with fake_sglang():
        import sglang

        seen = {}
        real = sglang.Engine

        class Recording(real):
            def __init__(self, **kwargs):
                seen.update(kwargs)
                super().__init__(**kwargs)

        monkeypatch.setattr(sglang, "Engine", Recording)
        engine = SGLangRollout(spec)
    engine.shutdown()
    assert seen["model_path"] == spec.load and seen["tp_size"] == 1
    assert seen["max_running_requests"] == 8 and seen["mem_fraction_static"] == 0.4
    assert seen["disable_cuda_graph"] is False and seen["random_seed"] == 99
    # one token more than a sequence takes: SGLang refuses input + max_new_tokens >= context_length
    assert seen["context_length"] == spec.max_prompt_tokens_length + spec.max_response_tokens_length + 1
    assert seen["dtype"] == "float32" and seen["skip_tokenizer_init"] is True
    assert seen["enable_memory_saver"] and seen["enable_weights_cpu_backup"]
    assert seen["enable_deterministic_inference"] is True and seen["attention_backend"] == "triton"
    # kv_cache fit: the pool holds the 8 running requests at full length (SGLang keeps the smaller of
    # this and what mem_fraction_static leaves); utilization: SGLang's own sizing
    assert seen["max_total_tokens"] == 8 * (seen["context_length"] - 1) + 1
    seen.clear()
    with fake_sglang():
        import sglang

        monkeypatch.setattr(sglang, "Engine", Recording)
        SGLangRollout(spec.replace(kv_cache="utilization")).shutdown()
    assert "max_total_tokens" not in seen and seen["mem_fraction_static"] == 0.4


def _recording_engine(monkeypatch, spec):
    """An SGLangRollout built with ``spec`` whose engine records its arguments and requests."""
    from chatlearn.models.rollout.sglang import SGLangRollout

    seen, requests = {}, []
    with fake_sglang():
        import sglang

        class Recording(sglang.Engine):
            def __init__(self, **kwargs):
                seen.update(kwargs)
                super().__init__(**kwargs)

            def generate(self, **kwargs):
                requests.append(kwargs["sampling_params"])
                return super().generate(**kwargs)

        monkeypatch.setattr(sglang, "Engine", Recording)
        engine = SGLangRollout(spec)
    return engine, seen, requests


def test_deterministic_inference_off_sends_no_seeds(model_dirs, monkeypatch):  # noqa: F811
    """deterministic_inference false: SGLang's batch-invariant mode stays off, no
    sampling_seed is sent (SGLang would ignore it), and the same seed does not reproduce
    the samples (the engine draws from its own generator, as SGLang does)."""
    engine, seen, requests = _recording_engine(
        monkeypatch, _spec(model_dirs["old"], deterministic_inference=False))
    try:
        assert seen["enable_deterministic_inference"] is False and "attention_backend" not in seen
        sampling = dict(SAMPLING, temperature=1.0)
        a, b = engine.generate(prompts(), sampling), engine.generate(prompts(), sampling)
        assert all("sampling_seed" not in p for call in requests for p in call)
        assert not all(np.array_equal(a[k], b[k]) for k in ("tokens", "offsets"))
    finally:
        engine.shutdown()


def test_deterministic_inference_on_reproduces_seeds(model_dirs, monkeypatch):  # noqa: F811
    engine, seen, requests = _recording_engine(monkeypatch, _spec(model_dirs["old"]))
    try:
        assert seen["enable_deterministic_inference"] is True
        sampling = dict(SAMPLING, temperature=1.0)
        a, b = engine.generate(prompts(), sampling), engine.generate(prompts(), sampling)
        assert [p["sampling_seed"] for p in requests[0]] == list(range(5, 5 + len(prompts())))
        for key in a:
            assert np.array_equal(a[key], b[key]), key
    finally:
        engine.shutdown()


def test_fake_models_upstream_seed_and_backend_rules(model_dirs):  # noqa: F811
    """SGLang 0.5.3: deterministic inference without a supported attention backend is
    refused at start; ``sampling_seed=None`` is refused; a seed is ignored when off."""
    with fake_sglang():
        import sglang

        with pytest.raises(ValueError, match="attention"):
            sglang.Engine(model_path=model_dirs["old"], skip_tokenizer_init=True,
                          enable_deterministic_inference=True)
        engine = sglang.Engine(model_path=model_dirs["old"], skip_tokenizer_init=True, random_seed=3)
        again = sglang.Engine(model_path=model_dirs["old"], skip_tokenizer_init=True, random_seed=3)
    with pytest.raises(ValueError, match="sampling_seed"):
        engine.generate(input_ids=[[5, 6]], sampling_params=[{"sampling_seed": None}])
    params = {"max_new_tokens": 6, "temperature": 1.0}
    seeded = engine.generate(input_ids=[[5, 6]], sampling_params=[dict(params, sampling_seed=11)])
    plain = again.generate(input_ids=[[5, 6]], sampling_params=[params])
    assert seeded[0]["output_ids"] == plain[0]["output_ids"]  # same engine stream: seed ignored
    engine.shutdown()
    again.shutdown()


def test_offload_and_push_end_release_the_cuda_cache(rollout, monkeypatch):
    """On CUDA the adapter's staged push tensors stay in torch's caching allocator after use:
    ``finish_weight_update`` and ``offload`` empty it (a recorder stands in for CUDA)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(rollout, "_device", torch.device("cuda", 0))
    rollout.finish_weight_update()
    assert calls == ["empty_cache"]
    rollout.offload(["kv_cache"])
    assert calls == ["empty_cache"] * 2
    monkeypatch.setattr(rollout, "_device", torch.device("cpu"))
    rollout.onload(["kv_cache"])
    rollout.offload(["kv_cache"])
    rollout.onload(["kv_cache"])
    assert calls == ["empty_cache"] * 2  # nothing to release on the CPU


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
    rollout.begin_weight_update()
    rollout.load_weight_bucket([("lm_head.weight", torch.zeros((300, 128)))])
    rollout.finish_weight_update()
    assert sent == []


def test_missing_sglang_is_a_user_error(monkeypatch, model_dirs):  # noqa: F811
    from chatlearn.models.rollout.sglang import SGLangRollout

    monkeypatch.setitem(__import__("sys").modules, "sglang", None)  # import fails
    with pytest.raises(UserError, match=r"pip install -e '\.\[sglang\]'") as info:
        SGLangRollout(_spec(model_dirs["old"]))
    assert info.value.key == "runtime_args.rollout_backend"


def test_original_logprob_switch_is_refused(monkeypatch, model_dirs):  # noqa: F811
    from chatlearn.models.rollout.sglang import SGLangRollout

    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    with fake_sglang(), pytest.raises(UserError, match="SGLANG_RETURN_ORIGINAL_LOGPROB"):
        SGLangRollout(_spec(model_dirs["old"]))


def test_streamed_push_copies_the_views(rollout, reference, model_dirs):  # noqa: F811
    """begin/load/finish as ``chatlearn.runtime.weight_push.stream`` calls them; each bucket's
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
