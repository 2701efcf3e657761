"""Rollout backends (transformers, vLLM, SGLang) on a tiny random Qwen2 model, on CPU.

SGLang runs here against ``tests/support/fake_sglang`` (a CPU fake of its engine API, put on
``sys.path`` only inside the fixture); ``sglang_gpu`` (marked ``gpu``) runs the same tests
against the real engine where ``sglang`` and CUDA are present.

Every backend must return well-formed batches whose log-probs equal a fresh full-sequence
transformers forward (``log_softmax(logits / T)`` at the sampled tokens, no top-k/top-p
truncation), take new weights, offload and onload without changing a bit, and be
reproducible under a seed. One engine per backend is shared by the whole module.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import numpy as np
import pytest
import torch
from backend_specs import rollout_spec
from tiny_model import make_tiny_model  # tests/ is on sys.path (tests/conftest.py)

BACKENDS = ["hf", "vllm", "sglang", pytest.param("sglang_gpu", marks=pytest.mark.gpu)]
FAKE_SGLANG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "support", "fake_sglang")
MAX_PROMPT, MAX_RESPONSE = 32, 24
TOL = 1e-4


# -- fixtures ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two random models of the same shape: "old" (seed 0) and "new" (seed 1)."""
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_tiny_model(str(root / name), seed=seed)
            for name, seed in (("old", 0), ("new", 1))}


@pytest.fixture(scope="module")
def reference(model_dirs):
    """Full-sequence transformers forwards of either model, loaded once."""
    return Reference(model_dirs)


@pytest.fixture(scope="module")
def restore_threads():
    """The engines run with ``cpu_threads=1`` (on a shared machine, spinning OpenMP workers
    slow a CPU engine down several times over), and vLLM's in-process engine replaces
    ``torch.set_num_threads``: put both back for the tests that follow."""
    threads, setter = torch.get_num_threads(), torch.set_num_threads
    yield
    torch.set_num_threads = setter
    torch.set_num_threads(threads)


def _spec(load: str, **over):
    """The rollout tests' :class:`~chatlearn.models.specs.RolloutSpec` of the model at ``load``."""
    return rollout_spec(
        load,
        **{
            "trust_remote_code": False,
            "seed": 1234,
            "generation_batch_size": 16,
            "max_prompt_tokens_length": MAX_PROMPT,
            "max_response_tokens_length": MAX_RESPONSE,
            "seq_length": None,
            "dtype": "float32",
            "device": "cpu",
            "gpu_memory_utilization": 0.5, "kv_cache": "fit",
            "enforce_eager": True,
            "tensor_model_parallel_size": 1,
            "cpu_threads": 1,
            "max_num_batched_tokens": None,
            "deterministic_inference": True,
            **over,
        })


@pytest.fixture(scope="module")
def hf(model_dirs, restore_threads):
    from chatlearn.models.rollout.hf import HFRollout

    return HFRollout(_spec(model_dirs["old"]))


@pytest.fixture(scope="module")
def vllm(model_dirs, restore_threads):
    pytest.importorskip("vllm")
    from chatlearn.models.rollout.vllm import VLLMRollout

    rollout = VLLMRollout(_spec(model_dirs["old"]))
    yield rollout
    rollout.llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def fake_sglang():
    """``import sglang`` finds the fake inside the block, and only there."""
    def drop():
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            del sys.modules[name]

    drop()
    sys.path.insert(0, FAKE_SGLANG)
    try:
        yield
    finally:
        sys.path.remove(FAKE_SGLANG)
        drop()


@pytest.fixture(scope="module")
def sglang(model_dirs, restore_threads):
    from chatlearn.models.rollout.sglang import SGLangRollout

    with fake_sglang():
        rollout = SGLangRollout(_spec(model_dirs["old"]))
    yield rollout
    rollout.shutdown()


@pytest.fixture(scope="module")
def sglang_gpu(model_dirs):
    """The real SGLang engine (CUDA); skipped where either is missing."""
    if not torch.cuda.is_available() or importlib.util.find_spec("sglang") is None:
        pytest.skip("needs the sglang package and a CUDA GPU")
    from chatlearn.models.rollout.sglang import SGLangRollout

    rollout = SGLangRollout(_spec(model_dirs["old"]))
    yield rollout
    rollout.shutdown()


@pytest.fixture(params=BACKENDS)
def rollout(request, model_dirs):
    """A backend holding the "old" weights (whatever an earlier test pushed)."""
    engine = request.getfixturevalue(request.param)
    push(engine, model_dirs["old"])
    return engine


# -- helpers ----------------------------------------------------------------------------

class Reference:
    def __init__(self, model_dirs):
        from transformers import AutoModelForCausalLM

        self.models = {
            name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for name, path in model_dirs.items()}

    @torch.no_grad()
    def logits(self, name: str, batch: dict) -> list[torch.Tensor]:
        """Per sample: logits [response_len, vocab] predicting each response token."""
        out = []
        for sl, plen in zip(slices(batch), batch["prompt_lens"]):
            ids = torch.from_numpy(batch["tokens"][sl])[None]
            logits = self.models[name](ids).logits[0].float()
            out.append(logits[int(plen) - 1:-1])
        return out

    def logprobs(self, name: str, batch: dict, temperature: float) -> np.ndarray:
        """float32 [T] aligned with tokens, like rollout_logprobs."""
        out = np.zeros(len(batch["tokens"]), dtype=np.float32)
        for sl, plen, logits in zip(slices(batch), batch["prompt_lens"], self.logits(name, batch)):
            resp = torch.from_numpy(batch["tokens"][sl][int(plen):])
            lp = torch.log_softmax(logits / temperature, dim=-1).gather(1, resp[:, None])[:, 0]
            out[sl.start + int(plen):sl.stop] = lp.numpy()
        return out


def slices(batch):
    off = batch["offsets"]
    return [slice(int(off[i]), int(off[i + 1])) for i in range(len(off) - 1)]


def prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 290, size=int(rng.integers(3, 13))).tolist() for _ in range(n)]


def state_dict(path: str) -> list:
    from safetensors.numpy import load_file

    return list(load_file(os.path.join(path, "model.safetensors")).items())


def push(engine, path: str) -> None:
    """Push a model folder's weights as the weight push does (one update), in two buckets (split
    inside a layer), no lm_head."""
    weights = [(k, torch.from_numpy(v)) for k, v in state_dict(path) if k != "lm_head.weight"]
    cut = next(i for i, (k, _) in enumerate(weights) if k.endswith("self_attn.k_proj.weight"))
    engine.begin_weight_update()
    engine.load_weight_bucket(weights[:cut])
    engine.load_weight_bucket(weights[cut:])
    engine.finish_weight_update()


def eos_id(engine) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(engine.spec.load).eos_token_id


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key


# -- tests ------------------------------------------------------------------------------

@pytest.mark.timeout(240)
def test_batch_is_well_formed(rollout):
    ps = prompts()
    batch = rollout.generate(ps, {"temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                  "max_tokens": MAX_RESPONSE, "seed": 7})
    eos = eos_id(rollout)
    n = len(ps)
    assert batch["tokens"].dtype == np.int64 and batch["offsets"].dtype == np.int64
    assert batch["prompt_lens"].dtype == np.int64
    assert batch["rollout_logprobs"].dtype == np.float32
    assert batch["finish_reasons"].dtype == np.int8
    assert batch["offsets"].shape == (n + 1,) and batch["offsets"][0] == 0
    assert batch["offsets"][-1] == len(batch["tokens"]) == len(batch["rollout_logprobs"])
    assert batch["prompt_lens"].tolist() == [len(p) for p in ps]
    for i, (sl, plen) in enumerate(zip(slices(batch), batch["prompt_lens"])):
        tokens, lps = batch["tokens"][sl], batch["rollout_logprobs"][sl]
        assert tokens[:plen].tolist() == ps[i]
        resp = tokens[plen:]
        assert 1 <= len(resp) <= MAX_RESPONSE
        assert np.all(lps[:plen] == 0) and np.all(lps[plen:] <= 0)
        assert eos not in resp[:-1].tolist()  # nothing after an EOS
        if batch["finish_reasons"][i] == 1:
            assert resp[-1] == eos
        else:
            assert batch["finish_reasons"][i] == 0
            assert len(resp) == MAX_RESPONSE and resp[-1] != eos
    # The tiny model ends about half of its samples within MAX_RESPONSE tokens.
    assert set(batch["finish_reasons"].tolist()) == {0, 1}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_full_forward(rollout, reference, temperature):
    batch = rollout.generate(prompts(), {"temperature": temperature, "top_p": 1.0,
                                         "top_k": -1, "max_tokens": MAX_RESPONSE, "seed": 3})
    expected = reference.logprobs("old", batch, temperature)
    np.testing.assert_allclose(batch["rollout_logprobs"], expected, atol=TOL, rtol=0)


@pytest.mark.timeout(240)
def test_vllm_cpu_counts_token_ranks_without_compiling(vllm):
    """The sampler's token-rank count runs as the plain function torch.compile wrapped (compiling it
    took about 3 s of every engine's first generate); its counts are the compiled function's."""
    from vllm.v1.sample import sampler as sampler_module
    from vllm.v1.sample.ops import logprobs as compiled_module

    plain = sampler_module.batched_count_greater_than
    assert not hasattr(plain, "_torchdynamo_orig_callable")
    assert plain is compiled_module.batched_count_greater_than._torchdynamo_orig_callable
    x = torch.tensor([[0.1, 0.5, 0.3, 0.5], [2.0, -1.0, 0.0, 1.0]])
    values = torch.tensor([[0.3], [2.0]])
    assert plain(x, values).tolist() == [3, 1]  # elements >= the token's log-prob, itself included


@pytest.mark.timeout(240)
def test_logprobs_ignore_top_k_top_p_truncation(rollout, reference):
    """top-k/top-p shape what is sampled; the log-probs stay those of the full softmax."""
    batch = rollout.generate(prompts(), {"temperature": 0.7, "top_p": 0.9, "top_k": 5,
                                         "max_tokens": MAX_RESPONSE, "seed": 5})
    for sl, plen, logits in zip(slices(batch), batch["prompt_lens"],
                                reference.logits("old", batch)):
        resp = batch["tokens"][sl][int(plen):]
        top5 = torch.topk(logits, 5, dim=-1).indices.numpy()
        assert all(tok in row for tok, row in zip(resp, top5))
    expected = reference.logprobs("old", batch, 0.7)
    np.testing.assert_allclose(batch["rollout_logprobs"], expected, atol=TOL, rtol=0)


@pytest.mark.timeout(240)
def test_greedy_is_argmax_with_temperature_one_logprobs(rollout, reference):
    batch = rollout.generate(prompts(8), {"temperature": 0.0, "max_tokens": 12})
    for sl, plen, logits in zip(slices(batch), batch["prompt_lens"],
                                reference.logits("old", batch)):
        resp = batch["tokens"][sl][int(plen):]
        assert resp.tolist() == logits.argmax(-1).tolist()
    expected = reference.logprobs("old", batch, 1.0)
    np.testing.assert_allclose(batch["rollout_logprobs"], expected, atol=TOL, rtol=0)
    # top_k == 1 is greedy too
    assert_same(batch, rollout.generate(prompts(8), {"temperature": 0.9, "top_k": 1,
                                                     "max_tokens": 12}))


@pytest.mark.timeout(240)
def test_same_seed_same_outputs(rollout):
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": MAX_RESPONSE}
    a = rollout.generate(prompts(), dict(sampling, seed=11))
    b = rollout.generate(prompts(), dict(sampling, seed=11))
    c = rollout.generate(prompts(), dict(sampling, seed=12))
    assert_same(a, b)
    assert not np.array_equal(a["tokens"], c["tokens"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("offloaded", [("weights", "kv_cache"), ("kv_cache",)],
                         ids=["all", "kv_cache"])
def test_push_between_the_two_wake_steps(rollout, reference, model_dirs, offloaded):
    """offload -> onload(weights) -> push new weights -> onload(kv_cache) -> generate."""
    sampling = {"temperature": 0.7, "top_p": 1.0, "top_k": -1,
                "max_tokens": MAX_RESPONSE, "seed": 9}
    rollout.offload(offloaded)
    rollout.onload(["weights"])
    push(rollout, model_dirs["new"])
    if "kv_cache" in offloaded and hasattr(rollout, "llm"):
        with pytest.raises(RuntimeError):  # not before the KV cache is back
            rollout.generate(prompts(2), sampling)
    rollout.onload(["kv_cache"])
    batch = rollout.generate(prompts(), sampling)
    got = batch["rollout_logprobs"]
    np.testing.assert_allclose(got, reference.logprobs("new", batch, 0.7), atol=TOL, rtol=0)
    assert np.abs(got - reference.logprobs("old", batch, 0.7)).max() > 1e-2

    # and back, without sleeping in between
    push(rollout, model_dirs["old"])
    batch = rollout.generate(prompts(), sampling)
    np.testing.assert_allclose(batch["rollout_logprobs"],
                               reference.logprobs("old", batch, 0.7), atol=TOL, rtol=0)


@pytest.mark.timeout(240)
def test_offload_onload_is_bit_identical(rollout, model_dirs):
    """The scheduler's order: offload, wake the weights, push, wake the KV cache."""
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1,
                "max_tokens": MAX_RESPONSE, "seed": 21}
    before = rollout.generate(prompts(), sampling)
    out = rollout.offload(["weights", "kv_cache"])
    assert isinstance(out["bytes"], int)
    with pytest.raises(RuntimeError):
        rollout.generate(prompts(2), sampling)
    rollout.onload(["weights"])
    push(rollout, model_dirs["old"])  # the weights it held (a CPU engine keeps no copy)
    rollout.onload(["kv_cache"])
    assert_same(before, rollout.generate(prompts(), sampling))


@pytest.mark.timeout(240)
def test_hf_offload_frees_parameter_storage(hf, model_dirs):
    push(hf, model_dirs["old"])
    params = list(hf.model.parameters())
    weights = [p.detach().clone() for p in params]
    buffers = {n: b.clone() for n, b in hf.model.named_buffers()}
    total = sum(p.untyped_storage().nbytes() for p in params)  # tied: counted once below
    out = hf.offload(["weights"])
    assert 0 < out["bytes"] <= total
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    for name, buf in hf.model.named_buffers():  # rotary inv_freq and co. untouched
        assert torch.equal(buf, buffers[name])
    assert hf.offload(["weights"]) == {"bytes": 0}  # already off
    assert hf.onload(["weights"]) == out
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    assert hf.offload(["kv_cache"]) == {"bytes": 0} == hf.onload(["kv_cache"])


@pytest.mark.timeout(240)
def test_rejects_out_of_range_lengths(rollout):
    with pytest.raises(ValueError):
        rollout.generate([[5] * (MAX_PROMPT + 1)], {"temperature": 1.0, "max_tokens": 4})
    with pytest.raises(ValueError):
        rollout.generate([[5, 6]], {"temperature": 1.0, "max_tokens": MAX_RESPONSE + 1})


@pytest.mark.timeout(240)
def test_a_continuation_may_reach_into_the_response_budget(rollout):
    """A multi-turn rollout's trajectory so far (``continuation``) may be longer than a prompt, up to the
    context less one token; its new tokens stop at the context (prompt + response lengths)."""
    long = [5] * (MAX_PROMPT + 20)
    with pytest.raises(ValueError):
        rollout.generate([long], {"temperature": 1.0, "max_tokens": 4})
    out = rollout.generate([long], {"temperature": 1.0, "max_tokens": MAX_RESPONSE, "continuation": True, "seed": 3})
    assert out["prompt_lens"].tolist() == [len(long)]
    assert len(out["tokens"]) - len(long) <= MAX_PROMPT + MAX_RESPONSE - len(long)
    with pytest.raises(ValueError):
        rollout.generate([[5] * (MAX_PROMPT + MAX_RESPONSE)], {"temperature": 1.0, "max_tokens": 4,
                                                             "continuation": True})


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tags", [("weights",), ("kv_cache",)])
def test_release_and_resume_one_part_keeps_generations(rollout, model_dirs, tags):
    """Sleep and wake by tag under a fixed seed (the scheduler's order: wake the weights,
    push, wake the KV cache): the same samples and log-probs after."""
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1,
                "max_tokens": MAX_RESPONSE, "seed": 33}
    before = rollout.generate(prompts(), sampling)
    out = rollout.offload(tags)
    assert isinstance(out["bytes"], int)
    rollout.onload(["weights"])
    push(rollout, model_dirs["old"])
    rollout.onload(["kv_cache"])
    assert_same(before, rollout.generate(prompts(), sampling))


def policy_sampling(eval_mode: bool) -> dict:
    """The sampling dict the runtime sends, from the schema's defaults of models.policy."""
    from omegaconf import OmegaConf

    from chatlearn.config.schema import Policy
    from chatlearn.runtime.driver.sampling import Sampling

    policy = OmegaConf.structured(Policy)
    policy.max_response_tokens_length = MAX_RESPONSE
    cfg = OmegaConf.create({"models": {"policy": OmegaConf.to_container(policy, resolve=False)}})
    return Sampling(cfg, None, None, None, None).params(eval_mode=eval_mode, seed=17)


@pytest.mark.timeout(240)
def test_eval_and_train_sampling_reach_the_engine(rollout, reference):
    """Train sampling (T=1, no truncation) and eval sampling (T=0.6, top-p 0.95, top-k 20):
    every eval sample lies inside the top-k and top-p sets of the reference distribution at
    T=0.6 (independently recomputed), and each set's log-probs are the reference's."""
    train, evals = policy_sampling(False), policy_sampling(True)
    assert (train["temperature"], train["top_p"], train["top_k"]) == (1.0, 1.0, -1)
    assert (evals["temperature"], evals["top_p"], evals["top_k"]) == (0.6, 0.95, 20)
    batch = rollout.generate(prompts(), train)
    np.testing.assert_allclose(batch["rollout_logprobs"], reference.logprobs("old", batch, 1.0),
                               atol=TOL, rtol=0)
    batch = rollout.generate(prompts(), evals)
    np.testing.assert_allclose(batch["rollout_logprobs"], reference.logprobs("old", batch, 0.6),
                               atol=TOL, rtol=0)
    for sl, plen, logits in zip(slices(batch), batch["prompt_lens"], reference.logits("old", batch)):
        probs = torch.softmax(logits / 0.6, dim=-1)
        for tok, row in zip(batch["tokens"][sl][int(plen):], probs):
            assert int((row > row[tok]).sum()) < 20  # inside the top 20
            assert float(row[row > row[tok]].sum()) <= 0.95 + 1e-4  # inside the 0.95 nucleus


@pytest.mark.parametrize("read_every", [1, 4])
def test_hf_ended_sequences_leave_the_batch(hf, read_every):
    """The transformers engine drops a sequence from the batch (and its KV cache rows) when it ends:
    by budget at once (the host knows budgets), by EOS when it next reads which rows still run
    (every step on the CPU, every few on a GPU: ``read_every``); the tokens are those of
    ``generate`` (greedy), which keeps every row to the end, whichever the policy."""
    from chatlearn.models.rollout.common import parse_sampling

    ps = prompts(4)
    budgets = [2, 5, 9, 12]
    sizes = []
    hook = hf.model.register_forward_pre_hook(lambda m, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]),
                                              with_kwargs=True)
    old_eos, old_every = hf.eos_ids, hf.read_every
    hf.read_every = read_every
    try:
        sp = parse_sampling({"temperature": 0.0, "max_tokens": 12})
        tokens, logprobs, finished, _ = hf._generate_chunk(ps, sp, budgets)
        width = max(len(p) for p in ps)
        ids = torch.full((4, width), hf.pad_id, dtype=torch.long)
        mask = torch.zeros((4, width), dtype=torch.long)
        for i, p in enumerate(ps):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        hook.remove()
        with torch.no_grad():
            ref = hf.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                                    eos_token_id=None, pad_token_id=hf.pad_id)[:, width:]
        assert [t.tolist() for t in tokens] == [ref[i, :b].tolist() for i, b in enumerate(budgets)]
        assert [len(lp) for lp in logprobs] == budgets and finished == [False] * 4
        # prefill, then one forward per step for the rows still running
        assert sizes == [4, 4, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1]
        # an EOS ends a row: row 3's 4th greedy token made the EOS
        hf.eos_ids = [int(ref[3, 3])]
        sizes.clear()
        hook = hf.model.register_forward_pre_hook(
            lambda m, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
        tokens, _, finished, _ = hf._generate_chunk(ps, sp, [12] * 4)
        leaves = []  # the first decoding forward (1-based step) a row is no longer in
        for i in range(4):
            hits = (ref[i] == hf.eos_ids[0]).nonzero()
            length = int(hits[0]) + 1 if len(hits) else 12
            assert tokens[i].tolist() == ref[i, :length].tolist() and finished[i] == bool(len(hits))
            # an EOS is seen at the next read; a spent budget at once
            leaves.append(-(-length // read_every) * read_every if len(hits) else length)
        assert finished[3]
        want = [sum(k < leave for leave in leaves) for k in range(1, 12)]
        assert sizes[1:] == [w for w in want if w], (sizes, leaves)
    finally:
        hf.eos_ids, hf.read_every = old_eos, old_every
        hook.remove()


def test_hf_decoding_waits_for_the_device_once_per_read(hf):
    """On a GPU every host read of a device value stalls the device: the decoding loop reads which
    rows still run once per ``read_every`` steps and nothing else (the attention mask is handed to
    the model ready, so transformers does not read it either). Counted on the CPU by the ops that
    wait on a GPU (bench/hf_decode.py's counter); the loop before read twice per step and once more
    inside transformers' mask."""
    import sys

    from conftest import REPO

    sys.path.insert(0, os.path.join(REPO, "bench"))
    from hf_decode import sync_counter

    ps = prompts(6)  # prompts of several lengths: the steps have a padding mask
    assert len({len(p) for p in ps}) > 1
    old_every = hf.read_every
    try:
        for every in (1, 8):
            hf.read_every = every
            steps = []
            hook = hf.model.register_forward_pre_hook(lambda *a: steps.append(1))
            counter = sync_counter()
            try:
                with counter:
                    hf.generate(ps, {"temperature": 1.0, "max_tokens": MAX_RESPONSE, "seed": 3})
            finally:
                hook.remove()
            decode_steps = len(steps) - 1
            assert decode_steps >= 16
            # one read per read_every steps, plus the prefill's mask (transformers reads a 2D mask)
            assert counter.count <= decode_steps // every + 3, (every, counter.by_op, decode_steps)
    finally:
        hf.read_every = old_every


def test_hf_reserved_kv_cache_moves_only_the_rows_that_move(hf):
    """Rows leaving the batch: the rows past the new size move into their places (``move_rows``),
    and the cache then holds what ``DynamicCache.batch_select_indices`` of the same order holds;
    only the moved rows' positions are copied."""
    from transformers import DynamicCache

    from chatlearn.models.rollout.hf import reserved_kv_cache

    config = hf.model.config
    ours, ref = reserved_kv_cache(config, capacity=8), DynamicCache(config=config)
    g = torch.Generator().manual_seed(1)
    shape = (6, config.num_key_value_heads, 3, config.hidden_size // config.num_attention_heads)
    kv = torch.randn(shape, generator=g)
    for layer in range(len(ours.layers)):
        ours.update(kv, kv + 1, layer)
        ref.update(kv, kv + 1, layer)
    # rows 1 and 4 end: keep 0, 2, 3, 5 -> row 5 moves into row 1's place
    ref.batch_select_indices(torch.tensor([0, 5, 2, 3]))
    buffers = [layer._k.data_ptr() for layer in ours.layers]
    untouched = [layer._k[[0, 2, 3]].clone() for layer in ours.layers]
    for layer in ours.layers:
        layer.move_rows(torch.tensor([1]), torch.tensor([5]), 4)
    for a, b, ptr, rows in zip(ours.layers, ref.layers, buffers, untouched):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert a._k.data_ptr() == ptr and a._k.shape[0] == 6  # the buffers stay: nothing allocated
        # bit for bit: past the written positions the reserved buffer holds whatever memory held (NaN bits too)
        assert torch.equal(a._k[[0, 2, 3]].view(torch.int32), rows.view(torch.int32))
    step = torch.randn((4,) + shape[1:2] + (1,) + shape[3:], generator=g)
    for layer in range(len(ours.layers)):  # the next step writes the 4 remaining rows
        got, want = ours.update(step, step, layer), ref.update(step, step, layer)
        assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_hf_cpu_attention_takes_grouped_heads_with_a_mask():
    """On the CPU a decoding step with a mask gives SDPA the grouped KV heads as they are: the same
    output as transformers' SDPA attention (which repeats them), and prefill / unmasked calls are
    transformers' own."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from chatlearn.models.rollout.hf import cpu_gqa_sdpa

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 4, True
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 1, 16, generator=g)
    k, v = torch.randn(3, 2, 10, 16, generator=g), torch.randn(3, 2, 10, 16, generator=g)
    mask = torch.ones(3, 1, 1, 10, dtype=torch.bool)
    mask[0, ..., :4] = False
    got, _ = cpu_gqa_sdpa(module, q, k, v, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got.shape == (3, 1, 8, 16)


def test_hf_step_mask_is_none_without_padding():
    from chatlearn.models.rollout.hf import step_mask

    amask = torch.ones(2, 9, dtype=torch.bool)
    assert step_mask(amask, 5, "bool", torch.float32, padded=False) is None
    assert step_mask(amask, 5, "bool", torch.float32, padded=True).shape == (2, 1, 1, 5)
    assert step_mask(amask, 5, "2d", torch.float32, padded=False).shape == (2, 5)
    amask[0, 0] = False
    m = step_mask(amask, 5, "float", torch.float32, padded=True)
    assert m[0, 0, 0, 0] == torch.finfo(torch.float32).min and m[0, 0, 0, 1] == 0


def test_hf_onednn_linears_compute_the_same_logits_and_leave_nothing_behind(hf):
    """On the CPU a generate call runs the model's linear layers on weights reordered once for
    oneDNN; the logits equal the plain model's, and after the call (or an error inside it) every
    layer is a plain ``nn.Linear`` again."""
    from chatlearn.models.rollout.hf import onednn_linears, onednn_linears_available

    if not onednn_linears_available(hf.device, hf.dtype):
        pytest.skip("torch without oneDNN linear ops")
    ids = torch.tensor([p[:6] for p in prompts(3)])
    linears = [m for m in hf.model.modules() if type(m) is torch.nn.Linear]
    with torch.no_grad():
        want = hf.model(input_ids=ids).logits
        with onednn_linears(hf.model, rows=3, min_elements=0):
            assert all("forward" in m.__dict__ for m in linears)
            got = hf.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert linears and not any("forward" in m.__dict__ for m in linears)
    with pytest.raises(RuntimeError, match="inside"):
        with onednn_linears(hf.model, rows=3, min_elements=0):
            raise RuntimeError("inside")
    assert not any("forward" in m.__dict__ for m in linears)
    import chatlearn.models.rollout.hf as hf_module

    calls = []
    real = torch.ops.mkldnn._reorder_linear_weight
    limits = hf_module.PACK_MIN_STEPS, hf_module.PACK_MIN_ELEMENTS
    try:  # a call with budgets of at least PACK_MIN_STEPS reorders every large weight once
        hf_module.torch.ops.mkldnn._reorder_linear_weight = lambda w, rows: calls.append(rows) or real(w, rows)
        hf_module.PACK_MIN_STEPS = 4
        hf.generate(prompts(2), {"temperature": 1.0, "max_tokens": 3, "seed": 1})
        assert calls == []  # budgets below the limit
        hf_module.PACK_MIN_ELEMENTS = 0
        hf.generate(prompts(2), {"temperature": 1.0, "max_tokens": 4, "seed": 1})
    finally:
        hf_module.torch.ops.mkldnn._reorder_linear_weight = real
        hf_module.PACK_MIN_STEPS, hf_module.PACK_MIN_ELEMENTS = limits
    assert len(calls) == len(linears) and set(calls) == {2}


def test_hf_reserved_kv_cache_equals_the_dynamic_cache(hf):
    """The transformers engine's KV cache writes each step into reserved storage; what its layers
    hold after prefills, steps past the reserved capacity (it grows) and dropped rows is what
    ``DynamicCache`` holds after the same calls."""
    from transformers import DynamicCache

    from chatlearn.models.rollout.hf import reserved_kv_cache

    config = hf.model.config
    ours, ref = reserved_kv_cache(config, capacity=3), DynamicCache(config=config)
    assert all(type(layer).__name__ == "ReservedLayer" for layer in ours.layers)
    g = torch.Generator().manual_seed(0)
    shape = (4, config.num_key_value_heads, 2, config.hidden_size // config.num_attention_heads)
    steps = [torch.randn(shape, generator=g)] + [torch.randn(shape[:2] + (1,) + shape[3:], generator=g)
                                                 for _ in range(5)]
    rows = 4
    for i, kv in enumerate(steps):
        kv = kv[:rows]
        for layer in range(len(ours.layers)):
            got, want = ours.update(kv, kv * 2, layer), ref.update(kv, kv * 2, layer)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
        if i == 2:  # rows 0 and 2 end
            keep = torch.tensor([1, 3])
            ours.batch_select_indices(keep)
            ref.batch_select_indices(keep)
            rows = 2
    assert ours.get_seq_length() == ref.get_seq_length() == 7 and ours.layers[0].capacity >= 7
    for a, b in zip(ours.layers, ref.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    with pytest.raises(NotImplementedError):
        ours.crop(-1)
