"""The SGLang adapter's own contract with the engine, against the fake engine on CPU, and
the fake's faithfulness where the shared contract tests (test_rollout_cpu.py) rely on it.

Each behaviour of the fake checked here is one the adapter must handle: a test that the fake
drops weights or keeps stale KV shows that the shared tests would fail on an adapter that
ignored it.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from test_rollout_cpu import (MAX_PROMPT, MAX_RESPONSE, TOL, fake_sglang, model_dirs,  # noqa: F401
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
    assert (seen["base_gpu_id"], seen["gpu_id_step"]) == (0, 1)  # rank r on cuda:r, as the weight push assumes
    assert seen["max_running_requests"] == 8 and seen["mem_fraction_static"] == 0.4
    assert seen["disable_cuda_graph"] is False and seen["random_seed"] == 99
    # SGLang's scheduler admits inputs below context_length - 6 and cuts new tokens at context_length - 2
    assert seen["context_length"] == spec.max_prompt_tokens_length + spec.max_response_tokens_length + 6
    assert seen["dtype"] == "float32" and seen["skip_tokenizer_init"] is True
    assert seen["enable_memory_saver"] and seen["enable_weights_cpu_backup"]
    assert seen["enable_deterministic_inference"] is True and seen["attention_backend"] == "triton"
    # kv_cache fit: the pool holds the 8 running requests at the engine's context length (SGLang keeps the
    # smaller of this and what mem_fraction_static leaves); utilization: SGLang's own sizing
    assert seen["max_total_tokens"] == 8 * seen["context_length"] + 1
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


# -- lengths: a run may fill the model's context -------------------------------------------

def _model_of_context(src: str, dst, positions: int) -> str:
    """A copy of the model folder ``src`` whose config takes ``positions`` tokens."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path, encoding="utf-8") as f:
        conf = json.load(f)
    conf["max_position_embeddings"] = positions
    with open(path, "w", encoding="utf-8") as f:
        json.dump(conf, f)
    return str(dst)


def test_fake_models_upstream_length_rules(model_dirs, monkeypatch):  # noqa: F811
    """SGLang 0.5.3 on an engine of context_length 40 (the model takes 512): the tokenizer manager
    refuses input + max_new_tokens >= 40; the scheduler (max_req_len 39) aborts an input of 34 tokens
    or more and cuts max_new_tokens to 38 - input without a word; a context_length above the model's is
    refused unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set."""
    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    with fake_sglang():
        import sglang

        engine = sglang.Engine(model_path=model_dirs["old"], skip_tokenizer_init=True, context_length=40)
        with pytest.raises(ValueError, match="SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"):
            sglang.Engine(model_path=model_dirs["old"], skip_tokenizer_init=True, context_length=513)
        monkeypatch.setenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "1")
        longer = sglang.Engine(model_path=model_dirs["old"], skip_tokenizer_init=True, context_length=513)
    assert longer.context_length == 513
    longer.shutdown()
    greedy = {"temperature": 0.0, "ignore_eos": True}
    out = engine.generate(input_ids=[[5] * 10], sampling_params=[dict(greedy, max_new_tokens=29)])[0]
    assert len(out["output_ids"]) == 28 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 28}
    with pytest.raises(ValueError, match="maximum context length of 40 tokens"):
        engine.generate(input_ids=[[5] * 10], sampling_params=[dict(greedy, max_new_tokens=30)])
    with pytest.raises(ValueError, match=r"Input length \(34 tokens\) exceeds the maximum allowed length \(34"):
        engine.generate(input_ids=[[5] * 34], sampling_params=[dict(greedy, max_new_tokens=1)])
    assert len(engine.generate(input_ids=[[5] * 33], sampling_params=[dict(greedy, max_new_tokens=4)])[0][
        "output_ids"]) == 4
    engine.shutdown()


@pytest.mark.timeout(240)
def test_a_run_may_fill_the_model_context(model_dirs, reference, tmp_path, monkeypatch):  # noqa: F811
    """A model that takes exactly max prompt + max response tokens: the engine starts (SGLang's
    switch for a longer context_length is on only while it starts), a full-length prompt gets its
    whole response budget (none cut by the scheduler), a continuation of the context less one token
    gets its one token, and the log-probs are the model's."""
    from chatlearn.models.rollout.sglang import SGLangRollout

    monkeypatch.delenv("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", raising=False)
    short = _model_of_context(model_dirs["old"], tmp_path / "short", MAX_PROMPT + MAX_RESPONSE)
    with fake_sglang():
        engine = SGLangRollout(_spec(short))
    try:
        assert "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN" not in os.environ
        full = [[3 + (7 * i + j) % 280 for j in range(MAX_PROMPT)] for i in range(6)]
        batch = engine.generate(full, dict(SAMPLING, temperature=0.7, seed=11))
        lengths = np.diff(batch["offsets"]) - batch["prompt_lens"]
        assert all(done or n == MAX_RESPONSE for n, done in zip(lengths, batch["finish_reasons"]))
        assert (lengths == MAX_RESPONSE).any()  # some responses fill the model's context
        np.testing.assert_allclose(batch["rollout_logprobs"], reference.logprobs("old", batch, 0.7),
                                   atol=TOL, rtol=0)
        longest = engine.generate([[5] * (MAX_PROMPT + MAX_RESPONSE - 1)],
                                  {"temperature": 1.0, "max_tokens": MAX_RESPONSE, "continuation": True})
        assert len(longest["tokens"]) == MAX_PROMPT + MAX_RESPONSE
    finally:
        engine.shutdown()


def test_a_run_longer_than_the_model_is_a_user_error(model_dirs, tmp_path):  # noqa: F811
    from chatlearn.models.rollout.sglang import SGLangRollout

    short = _model_of_context(model_dirs["old"], tmp_path / "short", MAX_PROMPT + MAX_RESPONSE)
    with fake_sglang(), pytest.raises(UserError, match="max_position_embeddings") as info:
        SGLangRollout(_spec(short, max_response_tokens_length=MAX_RESPONSE + 1))
    assert info.value.key == "models.policy.max_response_tokens_length"


# -- weights with tensor parallelism: each rank gets a tensor on its own GPU -----------------------

def test_fake_tensor_parallel_ranks_take_tensors_on_their_own_gpu(model_dirs):  # noqa: F811
    """With tp_size 2 the fake's scheduler of rank r (on fake GPU r) takes only tensors on GPU r:
    one GPU's tensor for both ranks and a CPU tensor are refused, a LocalSerializedTensor made per
    rank is taken, unless its ranks' values differ; a tensor received from another process cannot
    be serialised again (torch's rule). (Inside ``fake_sglang()``: pickles name the fake's classes.)"""
    name, value = state_dict(model_dirs["new"])[1]
    value = torch.from_numpy(value.copy())
    with fake_sglang():
        import fake_sglang_cuda as gpus
        import sglang
        from sglang.srt.model_executor.model_runner import LocalSerializedTensor
        from sglang.srt.utils import MultiprocessingSerializer as serializer

        def on(gpu, tensor=value):
            return gpus.place(tensor.clone(), gpus.uuid_of(gpu))

        def per_rank(*tensors):
            return LocalSerializedTensor(values=[serializer.serialize(t) for t in tensors])

        engine = sglang.Engine(model_path=model_dirs["old"], skip_tokenizer_init=True, tp_size=2)
        with pytest.raises(RuntimeError, match="TP rank 1's scheduler"):
            engine.update_weights_from_tensor([(name, on(0))])
        with pytest.raises(RuntimeError, match="TP rank 0's scheduler .* on the CPU"):
            engine.update_weights_from_tensor([(name, value)])
        with pytest.raises(RuntimeError, match="TP rank 0's scheduler"):
            engine.update_weights_from_tensor([(name, per_rank(on(1), on(0)))])
        with pytest.raises(ValueError, match="TP rank 1 got other values"):
            engine.update_weights_from_tensor([(name, per_rank(on(0), on(1, value + 1)))])
        assert engine.update_weights_from_tensor([(name, per_rank(on(0), on(1)))])[0]
        assert torch.equal(dict(engine.model.named_parameters())[name], value)
        received = serializer.deserialize(serializer.serialize(on(0)))
        with pytest.raises(RuntimeError, match="received from another process"):
            serializer.serialize(received)
        engine.shutdown()


def _stand_in_gpus(monkeypatch) -> None:
    """torch's CUDA calls of a ``cuda_ipc`` weight push, for CPU tensors on the fake engine's GPUs
    (``fake_sglang_cuda``; call inside ``fake_sglang()``): ``cuda:i`` is fake GPU i, a slot handle is
    the trainer's slot tensor itself, mapped only on its own GPU, a copy to ``cuda:i`` is on GPU i."""
    from types import SimpleNamespace

    import fake_sglang_cuda as gpus

    from chatlearn.models import weight_buckets
    from chatlearn.models.rollout import sglang as adapter
    from chatlearn.runtime.weight_push import stream

    def ipc_rebuild(handle, device):
        if gpus.device_of(handle) != gpus.uuid_of(torch.device(device).index):
            raise RuntimeError(f"a slot of {gpus.device_of(handle)} mapped on {device}")
        return gpus.place(handle[:], gpus.device_of(handle), received=True)

    def stage(tensor, device):
        copy = tensor.clone()
        return gpus.place(copy, gpus.uuid_of(device.index)) if device.type == "cuda" else copy

    def synced(device):
        return SimpleNamespace(synchronize=lambda: None)

    monkeypatch.setattr(weight_buckets, "device_uuid", lambda device: gpus.uuid_of(torch.device(device).index))
    monkeypatch.setattr(stream, "_this_device", lambda: torch.device("cuda", 0))
    for module in (stream, adapter):  # raising=False: the adapter's names, for a run against older code
        monkeypatch.setattr(module, "ipc_rebuild", ipc_rebuild, raising=False)
        monkeypatch.setattr(module, "device_stream", synced, raising=False)
    monkeypatch.setattr(adapter, "stage", stage, raising=False)


@pytest.mark.timeout(300)
def test_tensor_parallel_push_gives_each_rank_its_own_gpu(model_dirs, reference, monkeypatch):  # noqa: F811
    """SGLang with tp_size 2 and the cuda_ipc weight push (chatlearn.runtime.weight_push.stream's
    Endpoint): the trainer's slots of both GPUs hold each bucket, and each TP rank's scheduler is
    handed a tensor on its own GPU (the fake refuses any other); the slots are refilled right after
    each load, and the engine then generates with the new weights. Buckets in host memory
    (load_weight_bucket: the host-slot and broadcast transports) reach each rank on its GPU too."""
    from chatlearn.models.rollout.sglang import SGLangRollout

    with fake_sglang():  # the whole push inside: its pickles name the fake's classes
        import fake_sglang_cuda as gpus

        rollout = SGLangRollout(_spec(model_dirs["old"], tensor_model_parallel_size=2))
        _stand_in_gpus(monkeypatch)
        try:
            _push_through_slots(rollout, gpus, model_dirs["new"])
            assert rollout._rank_slots == []  # the mappings are dropped after the push
            batch = rollout.generate(prompts(), SAMPLING)
            np.testing.assert_allclose(batch["rollout_logprobs"], reference.logprobs("new", batch, 0.7),
                                       atol=TOL, rtol=0)
            push(rollout, model_dirs["old"])  # buckets in host memory (load_weight_bucket): copied to each GPU
            batch = rollout.generate(prompts(), SAMPLING)
            np.testing.assert_allclose(batch["rollout_logprobs"], reference.logprobs("old", batch, 0.7),
                                       atol=TOL, rtol=0)
        finally:
            rollout.shutdown()


def _push_through_slots(rollout, gpus, path: str) -> None:
    """A ``cuda_ipc`` push of the model folder ``path`` into ``rollout`` by the weight push's receiving
    Endpoint, the trainer ranks of fake GPUs 0 and 1 filling their 2 slots each, and refilling a slot
    right after each load from it."""
    from chatlearn.models.weight_buckets import bucket_views, plan_buckets
    from chatlearn.runtime.weight_push.stream import Endpoint

    weights = {k: torch.from_numpy(v.copy()) for k, v in state_dict(path) if k != "lm_head.weight"}
    buckets = plan_buckets([(k, "float32", tuple(v.shape), k) for k, v in weights.items()], 200_000)
    assert len(buckets) > 2
    size = max(b.nbytes for b in buckets)
    slots = {gpu: [gpus.place(torch.zeros(size, dtype=torch.uint8), gpus.uuid_of(gpu)) for _ in range(2)]
             for gpu in (0, 1)}
    receiver = Endpoint(rollout)
    receiver.open_receiver("cuda_ipc", buckets, {gpus.uuid_of(g): s for g, s in slots.items()})
    receiver.begin()
    for k, index in enumerate(buckets):
        for gpu in (0, 1):  # the trainer ranks' copies of bucket k, one per GPU
            for name, view in bucket_views(index, slots[gpu][k % 2]):
                view.copy_(weights[name])
        receiver.recv(k, k % 2)
        for gpu in (0, 1):
            slots[gpu][k % 2].fill_(255)  # refilled with the next bucket but one
    receiver.finish()
    receiver.close_receiver()
