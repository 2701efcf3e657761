"""vLLM's CPU backend has no sleep mode: the rollout frees the storage itself.

After ``offload`` the named storage is really released (the KV cache tensors and every
parameter have no bytes left, the packed linear weights are dropped); after ``onload`` the
engine generates exactly what it generated before: reloaded from the model folder when it
never received weights, or from the next push when it did.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from backend_specs import rollout_spec
from tiny_model import make_tiny_model

pytest.importorskip("vllm")

MAX_PROMPT, MAX_RESPONSE = 16, 12
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": MAX_RESPONSE, "seed": 5}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from chatlearn.models.rollout.vllm import VLLMRollout

    threads, setter = torch.get_num_threads(), torch.set_num_threads
    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"), seed=3)
    rollout = VLLMRollout(rollout_spec(
        path, trust_remote_code=False, seed=7, generation_batch_size=4, max_prompt_tokens_length=MAX_PROMPT,
        max_response_tokens_length=MAX_RESPONSE, seq_length=None, dtype="float32", device="cpu",
        gpu_memory_utilization=0.5, kv_cache="fit", enforce_eager=True, tensor_model_parallel_size=1, cpu_threads=1,
        max_num_batched_tokens=None, deterministic_inference=True))
    if rollout._sleep_mode:
        pytest.skip("this vLLM has a sleep mode: the CPU path is not used")
    assert rollout._weight_path == "layerwise"  # the CPU backend repacks: vLLM's in-place reload
    yield rollout, path
    rollout.llm.llm_engine.engine_core.shutdown()
    torch.set_num_threads = setter
    torch.set_num_threads(threads)


def worker_state(rollout):
    """(parameter bytes, KV cache bytes, packed linear layers) inside the in-process worker."""
    runner = rollout.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    model = runner.get_model()
    from chatlearn.models.rollout.vllm import _released_linear, _storages

    params = sum(st.nbytes() for st in _storages(list(model.parameters())))
    params += sum(p.untyped_storage().nbytes() for p in model.parameters() if p.numel() == 0)
    kv = sum(st.nbytes() for st in _storages(runner.kv_caches))
    packed = sum(1 for m in model.modules()
                 if "cpu_linear" in m.__dict__ and m.cpu_linear is not _released_linear)
    return params, kv, packed


def same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in ("tokens", "offsets", "rollout_logprobs"))


def push(rollout, weights: list, bucket: int | None = None) -> None:
    """One weight push of ``(name, array)`` pairs, in buckets of ``bucket`` tensors (all: one)."""
    bucket = bucket or len(weights)
    rollout.begin_weight_update()
    for i in range(0, len(weights), bucket):
        rollout.load_weight_bucket([(k, torch.from_numpy(v)) for k, v in weights[i:i + bucket]])
    rollout.finish_weight_update()


def test_offload_releases_and_folder_reload_restores(engine):
    rollout, _ = engine
    before = rollout.generate(PROMPTS, SAMPLING)
    params, kv, packed = worker_state(rollout)
    assert params > 0 and kv > 0 and packed > 0

    out = rollout.offload(["kv_cache"])
    assert out["bytes"] >= kv
    assert worker_state(rollout)[1] == 0 and worker_state(rollout)[0] == params
    out = rollout.offload(["weights"])
    assert out["bytes"] >= params
    assert worker_state(rollout) == (0, 0, 0)
    assert rollout.offload(["weights", "kv_cache"]) == {"bytes": 0}  # already off
    with pytest.raises(RuntimeError):
        rollout.generate(PROMPTS, SAMPLING)

    assert rollout.onload(["weights"])["bytes"] > 0  # never pushed: reloaded from the folder
    assert rollout.onload(["kv_cache"])["bytes"] == kv
    assert worker_state(rollout) == (params, kv, packed)
    assert same(before, rollout.generate(PROMPTS, SAMPLING))


def test_after_a_push_the_next_push_restores(engine):
    from safetensors.numpy import load_file
    import os

    rollout, path = engine
    weights = [(k, v) for k, v in load_file(os.path.join(path, "model.safetensors")).items()
               if k != "lm_head.weight"]
    push(rollout, weights)
    before = rollout.generate(PROMPTS, SAMPLING)
    rollout.offload(["weights", "kv_cache"])
    rollout.onload(["weights"])
    rollout.onload(["kv_cache"])
    with pytest.raises(RuntimeError, match="push weights"):
        rollout.generate(PROMPTS, SAMPLING)  # no host copy: it needs the push
    push(rollout, weights)
    assert same(before, rollout.generate(PROMPTS, SAMPLING))


def test_reloads_leave_no_failed_load_warnings(engine):
    """A reload from the folder and pushes in one bucket and in several: vLLM warned "RotaryEmbedding:
    Failed to load weights" and "ParallelLMHead: ..." on each (layers no checkpoint has weights for: the
    rotary cache, the tied lm_head); those layers are now left out of the reload, and the engine still
    generates what it generated from the folder."""
    from safetensors.numpy import load_file
    import os

    import logging

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    records = Records()
    logging.getLogger("vllm").addHandler(records)  # vLLM's loggers do not propagate past "vllm"
    rollout, path = engine
    weights = [(k, v) for k, v in load_file(os.path.join(path, "model.safetensors")).items()
               if k != "lm_head.weight"]
    rollout.offload(["weights", "kv_cache"])
    rollout.onload(["weights"])  # from the folder, or awaiting the push when one came before
    if rollout._awaiting_push:
        push(rollout, weights)
    rollout.onload(["kv_cache"])
    before = rollout.generate(PROMPTS, SAMPLING)
    push(rollout, weights)  # one bucket
    assert same(before, rollout.generate(PROMPTS, SAMPLING))
    push(rollout, weights, bucket=3)  # bucket by bucket
    assert same(before, rollout.generate(PROMPTS, SAMPLING))
    rollout.offload(["weights"])
    rollout.onload(["weights", "kv_cache"])
    push(rollout, weights)
    assert same(before, rollout.generate(PROMPTS, SAMPLING))
    logging.getLogger("vllm").removeHandler(records)
    assert not [m for m in records.messages if "Failed to load weights" in m], records.messages


def test_kv_cache_fit_holds_every_sequence_and_no_more(engine):
    """kv_cache fit: generation_batch_size (4) sequences of 16 + 12 tokens, in vLLM's CPU blocks of 128."""
    from chatlearn.models.rollout import kv_cache

    rollout, path = engine
    per_token = kv_cache.bytes_per_token(kv_cache.text_config(path), "float32")
    assert rollout._part_bytes["kv_cache"] == kv_cache.fit_tokens(4, MAX_PROMPT + MAX_RESPONSE, 128) * per_token
    assert rollout._part_bytes["kv_cache"] < 2**20  # before: 1 GiB for a model of a few MB
