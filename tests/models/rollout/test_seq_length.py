"""``seq_length`` with ChatLearn's meaning.

* ``models.policy.seq_length``: the rollout engine's tokens per sequence, prompt + response
  (vLLM ``max_model_len``, SGLang ``context_length``): a response stops at ``seq_length`` minus
  its prompt's length. Checked on the transformers and vLLM engines and the strict SGLang fake:
  under greedy decoding a capped response is the uncapped one cut at its budget.
* ``models.policy_trainer.seq_length``: the fixed width of unpacked micro-batches (the trainer
  side is tested in test_packing.py and test_megatron_trainer.py).
* Validation and the packing warning.
"""
from __future__ import annotations

import pytest
from test_rollout_cpu import (MAX_PROMPT, MAX_RESPONSE, _spec, fake_sglang, model_dirs,  # noqa: F401
                              prompts, restore_threads)

from chatlearn.config.load import load_config
from chatlearn.config.schema import compat_warning
from chatlearn.errors import ConfigError

SEQ_LENGTH = 20  # prompts of 3 to 12 tokens: budgets of 8 to 17 new tokens, below MAX_RESPONSE (24)
GREEDY = {"temperature": 0.0, "max_tokens": MAX_RESPONSE}


def _engine(backend: str, load: str, seq_length):
    spec = _spec(load, seq_length=seq_length)
    if backend == "hf":
        from chatlearn.models.rollout.hf import HFRollout

        return HFRollout(spec)
    if backend == "vllm":
        pytest.importorskip("vllm")
        from chatlearn.models.rollout.vllm import VLLMRollout

        return VLLMRollout(spec)
    from chatlearn.models.rollout.sglang import SGLangRollout

    with fake_sglang():
        return SGLangRollout(spec)


def _close(backend: str, engine) -> None:
    if backend == "vllm":
        engine.llm.llm_engine.engine_core.shutdown()
    elif backend == "sglang":
        engine.shutdown()


def _samples(batch):
    off, plen = batch["offsets"], batch["prompt_lens"]
    return [(batch["tokens"][off[i] + plen[i]:off[i + 1]].tolist(), bool(batch["finish_reasons"][i]))
            for i in range(len(plen))]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["hf", "vllm", "sglang"])
def test_a_response_stops_at_seq_length(backend, model_dirs, restore_threads):  # noqa: F811
    ps = prompts(12, seed=3)
    full_engine = _engine(backend, model_dirs["old"], None)
    try:
        full = _samples(full_engine.generate(ps, GREEDY))
    finally:
        _close(backend, full_engine)
    capped_engine = _engine(backend, model_dirs["old"], SEQ_LENGTH)
    try:
        if backend == "vllm":
            assert capped_engine.llm.llm_engine.model_config.max_model_len == SEQ_LENGTH
        if backend == "sglang":  # more: SGLang's scheduler keeps a few tokens of its context to itself
            from chatlearn.models.rollout.sglang import engine_context_length

            assert capped_engine.engine.context_length == engine_context_length(SEQ_LENGTH) > SEQ_LENGTH
        capped = _samples(capped_engine.generate(ps, GREEDY))
        with pytest.raises(ValueError, match="below seq_length"):  # no room left for a response
            capped_engine.generate([[5] * SEQ_LENGTH], GREEDY)
    finally:
        _close(backend, capped_engine)
    cut_short = 0
    for p, (want, want_done), (got, done) in zip(ps, full, capped):
        budget = SEQ_LENGTH - len(p)
        assert len(p) + len(got) <= SEQ_LENGTH
        assert got == want[:budget]
        assert done == (want_done and len(want) <= budget)
        cut_short += len(want) > budget
    assert cut_short  # the cap acted on some responses


def _load(paths_overrides, *over):
    return load_config("template/grpo_fsdp.yaml", paths_overrides + list(over))


def test_policy_seq_length_is_checked(paths_overrides, monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)
    ok = _load(paths_overrides, "models.policy.seq_length=200", "models.policy.max_prompt_tokens_length=64",
               "models.policy.max_response_tokens_length=512")
    assert ok.models.policy.seq_length == 200
    with pytest.raises(ConfigError) as err:
        _load(paths_overrides, "models.policy.seq_length=64", "models.policy.max_prompt_tokens_length=64")
    assert err.value.key == "models.policy.seq_length" and "room for a response" in str(err.value)
    with pytest.raises(ConfigError) as err:  # the tiny model takes 512 tokens
        _load(paths_overrides, "models.policy.seq_length=100000")
    assert err.value.key == "models.policy.seq_length" and "more than the" in str(err.value)


def test_sglang_may_use_the_whole_model_context(paths_overrides, monkeypatch):
    """The SGLang engine is given a few tokens more than a sequence takes (its scheduler's reserve;
    ``chatlearn.models.rollout.sglang.engine_context_length``) without them counting against the
    model's context: a run may fill the model's 512 tokens with either engine, and not more."""
    from conftest import REPO

    monkeypatch.chdir(REPO)
    sglang = ["runtime_args.rollout_backend=sglang", "models.policy.max_prompt_tokens_length=64"]
    assert _load(paths_overrides, *sglang, "models.policy.seq_length=512").models.policy.seq_length == 512
    _load(paths_overrides, *sglang, "models.policy.max_response_tokens_length=448")
    with pytest.raises(ConfigError) as err:
        _load(paths_overrides, *sglang, "models.policy.max_response_tokens_length=449")
    assert err.value.key == "models.policy.max_response_tokens_length"


def test_trainer_seq_length_must_hold_the_longest_sequence(paths_overrides, monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)
    base = ["models.policy.max_prompt_tokens_length=64", "models.policy.max_response_tokens_length=100"]
    assert _load(paths_overrides, *base, "models.policy_trainer.seq_length=164").models.ref_policy.seq_length == 164
    with pytest.raises(ConfigError) as err:
        _load(paths_overrides, *base, "models.policy_trainer.seq_length=150")
    assert err.value.key == "models.policy_trainer.seq_length" and "up to 164 tokens" in str(err.value)
    # a policy seq_length below prompt + response lowers the longest sequence
    _load(paths_overrides, *base, "models.policy.seq_length=150", "models.policy_trainer.seq_length=150")
    with pytest.raises(ConfigError) as err:
        _load(paths_overrides, *base, "models.policy.seq_length=150", "models.policy_trainer.seq_length=149")
    assert "models.policy.seq_length (150)" in str(err.value)


def test_trainer_seq_length_with_packing_is_named_as_ignored(paths_overrides, monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)
    assert compat_warning(_load(paths_overrides)) is None
    cfg = _load(paths_overrides, "models.policy_trainer.packing=true", "models.policy_trainer.seq_length=64")
    warning = compat_warning(cfg)
    assert "models.policy_trainer.seq_length=64 (ignored with packing" in warning
    assert "models.ref_policy.seq_length" not in warning  # follows the trainer's: named once
    assert compat_warning(_load(paths_overrides, "models.policy_trainer.seq_length=300")) is None
    with pytest.raises(ConfigError) as err:  # padded past the tiny model's 512 positions
        _load(paths_overrides, "models.policy_trainer.seq_length=600")
    assert err.value.key == "models.policy_trainer.seq_length" and "512" in str(err.value)
