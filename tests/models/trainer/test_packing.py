"""Sequence packing in the FSDP trainer's log-prob and training passes.

Packed passes must give the same log-probs, entropy, loss, gradients and optimizer step as
padded passes (float32, within 1e-5), with 1 rank and with 2 ranks whose shares pack into
different numbers of micro-batches (so that the rank with fewer runs dummy micro-steps).
Two jobs (1 and 2 ranks, spawned processes) run once per module.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import REPO
from test_fsdp_trainer import add_logprobs, hf_logprobs, make_tiny_model, run_ranks, trainer_spec

from chatlearn.errors import ConfigError
from chatlearn.models.trainer.packing import pack_first_fit_decreasing, plan_micro_batches

TEMPERATURE = 0.8
LR = 1e-4  # Adam's first step moves weights by ~lr whatever the gradient: keeps rounding small
MAX_TOKENS = 16
FIXED_WIDTH = 20  # seq_length: every unpacked micro-batch padded to this width (longest sample: 13)
# rank 0 of 2 gets the four long samples (one bin each), rank 1 the four short ones (one bin)
PROMPT_LENS = [3, 5, 2, 4, 1, 1, 2, 2]
RESPONSE_LENS = [9, 8, 9, 8, 2, 1, 2, 1]


# --------------------------------------------------------------------------- planning


def test_first_fit_decreasing_bins():
    lens = np.array([12, 13, 11, 12, 3, 2, 4, 3])
    bins = pack_first_fit_decreasing(lens, 16)
    # by hand: 13 | 12 | 12 | 11 open four bins, then 4 -> the first 12, 3 -> 13, 3 -> the
    # second 12 (the first 12 is full), 2 -> 11
    assert [b.tolist() for b in bins] == [[1, 4], [0, 6], [3, 7], [2, 5]]
    assert sorted(np.concatenate(bins).tolist()) == list(range(len(lens)))
    assert all(lens[b].sum() <= 16 for b in bins)
    assert [b.tolist() for b in pack_first_fit_decreasing(np.array([1, 1, 1]), 16)] == [[0, 1, 2]]


def test_a_sample_longer_than_max_token_in_packing_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        pack_first_fit_decreasing(np.array([5, 17, 3]), 16)
    msg = str(info.value)
    assert "max_token_in_packing" in msg and "17" in msg and "16" in msg and "\n" not in msg


def test_plan_pads_ranks_with_dummy_steps_and_counts_padding():
    lens = np.array(PROMPT_LENS) + np.array(RESPONSE_LENS)  # 12 13 11 12 3 2 4 3
    shares = [np.arange(0, 4), np.arange(4, 8)]
    plans, stats = plan_micro_batches(lens, shares, 2, packing=True, max_tokens=MAX_TOKENS)
    assert [len(p) for p in plans] == [4, 4] and stats == {"pad_token_frac": 0.0, "micro_steps": 4.0}
    assert [mb.tolist() for mb in plans[1]] == [[4, 5, 6, 7], [], [], []]
    plans, stats = plan_micro_batches(lens, shares, 3, packing=False, max_tokens=MAX_TOKENS)
    # longest first (ties in batch order): samples of similar length share a micro-batch
    assert [[mb.tolist() for mb in p] for p in plans] == [[[1, 0, 3], [2]], [[6, 4, 7], [5]]]
    computed = 3 * 13 + 11 + 3 * 4 + 2  # rows x longest sample, per micro-batch
    assert stats["micro_steps"] == 2.0
    assert stats["pad_token_frac"] == pytest.approx(1 - lens.sum() / computed)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_transformers_confines_attention_to_each_packed_sample(tmp_path, attn):
    """What the packed forward relies on (transformers' masking_utils): without an attention
    mask, position ids that restart at 0 start a new sample. Reference: each sample alone."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(str(tmp_path / "m"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=attn).eval()
    rng = np.random.default_rng(0)
    samples = [torch.from_numpy(rng.integers(0, 300, n)) for n in (5, 1, 7, 3)]
    ids = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(len(s)) for s in samples])[None]
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=s[None]).logits[0] for s in samples])
        wrong = model(input_ids=ids, position_ids=positions).logits[0]  # with a KV cache (use_cache
        # defaults to True) transformers does not look for packed samples: attention crosses them
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
    assert (wrong - alone).abs().max() > 1e-3


# --------------------------------------------------------------------------- trainer jobs


def make_batch(vocab: int) -> dict:
    rng = np.random.default_rng(5)
    plen, rlen = np.array(PROMPT_LENS), np.array(RESPONSE_LENS)
    offsets = np.zeros(len(plen) + 1, np.int64)
    np.cumsum(plen + rlen, out=offsets[1:])
    return {"tokens": rng.integers(0, vocab, int(offsets[-1])).astype(np.int64),
            "offsets": offsets, "prompt_lens": plen.astype(np.int64),
            "advantages": rng.normal(size=len(plen)).astype(np.float32)}


def _pass(trainer, batch) -> dict:
    logp, ent = trainer.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
    stats = trainer.logprob_stats()
    plan, _ = trainer._micro_batches(batch, trainer.spec.train_micro_batch_size)
    metrics = trainer.compute_grads(batch, TEMPERATURE)
    grads = trainer.full_grads()
    trainer.zero_grad()
    step = trainer.train(batch, TEMPERATURE)
    weights = {k: v for b in trainer.export_weights(bucket_mb=64) for k, v in b}
    return {"logp": logp, "entropy": ent, "logprob_stats": stats, "metrics": metrics,
            "real_micro_batches": sum(len(mb) > 0 for mb in plan), "step": step,
            "grads": grads if trainer.rank == 0 else None,
            "weights": weights if trainer.rank == 0 else None}


def job(rank, world, path, batch):
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    common = dict(lr=LR, train_micro_batch_size=4 // world, logprob_micro_batch_size=3,
                  max_token_in_packing=MAX_TOKENS)
    padded = _pass(FSDPTrainer(trainer_spec(path, packing=False, **common)), batch)
    packed = _pass(FSDPTrainer(trainer_spec(path, packing=True, **common)), batch)
    fixed = _pass(FSDPTrainer(trainer_spec(path, packing=False, seq_length=FIXED_WIDTH, **common)), batch)
    short = FSDPTrainer(trainer_spec(path, packing=False, seq_length=12, **common))
    try:
        short.compute_logprobs(batch, temperature=TEMPERATURE)
        too_long = None
    except ConfigError as err:
        too_long = (err.key, str(err))
    return {"padded": padded, "packed": packed, "fixed": fixed, "too_long": too_long}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoConfig

    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    batch = make_batch(AutoConfig.from_pretrained(path).vocab_size)
    logp, _ = hf_logprobs(path, batch)
    return {"path": path, "batch": add_logprobs(batch, logp)}


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def ranks(request, setup, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"world{request.param}")
    return request.param, run_ranks(job, request.param, out, setup["path"], setup["batch"])


METRICS = ("loss", "policy_loss", "kl", "entropy", "clip_frac", "num_tokens")


@pytest.mark.timeout(300)
def test_packed_logprobs_and_entropy_match_padded_and_transformers(setup, ranks):
    world, results = ranks
    ref_logp, ref_ent = hf_logprobs(setup["path"], setup["batch"], TEMPERATURE)
    for res in results:
        for mode in ("padded", "packed"):
            np.testing.assert_allclose(res[mode]["logp"], ref_logp, rtol=0, atol=1e-5)
            np.testing.assert_allclose(res[mode]["entropy"], ref_ent, rtol=0, atol=1e-5)
        np.testing.assert_allclose(res["packed"]["logp"], res["padded"]["logp"], rtol=0, atol=1e-5)


@pytest.mark.timeout(300)
def test_packed_gradients_loss_and_step_match_padded(ranks):
    world, results = ranks
    if world == 2:  # rank 1's share packs into 1 bin, rank 0's into 4: 3 dummy micro-steps
        assert [r["packed"]["real_micro_batches"] for r in results] == [4, 1]
    else:
        assert results[0]["packed"]["real_micro_batches"] == 4  # 8 samples in 4 rows
    for res in results:
        packed, padded = res["packed"], res["padded"]
        assert packed["metrics"]["micro_steps"] == 4.0
        for name in METRICS:
            assert packed["metrics"][name] == pytest.approx(padded["metrics"][name], abs=1e-6), name
            assert packed["step"][name] == pytest.approx(padded["step"][name], abs=1e-6), name
        assert packed["step"]["grad_norm"] == pytest.approx(padded["step"]["grad_norm"], rel=1e-5)
    packed, padded = results[0]["packed"], results[0]["padded"]
    assert packed["grads"].keys() == padded["grads"].keys()
    for name, g in padded["grads"].items():
        assert g.abs().max() > 0 or "embed" in name, name
        torch.testing.assert_close(packed["grads"][name], g, rtol=0, atol=1e-5, msg=name)
    for name, w in padded["weights"].items():
        np.testing.assert_allclose(packed["weights"][name], w, rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.timeout(300)
def test_padding_share_is_reported_and_zero_with_packing(setup, ranks):
    world, results = ranks
    lens = np.diff(setup["batch"]["offsets"])
    share = len(lens) // world
    for res in results:
        assert res["packed"]["metrics"]["pad_token_frac"] == 0.0
        assert res["packed"]["logprob_stats"] == {"pad_token_frac": 0.0, "micro_steps": 4.0}
        # padded: micro-batches of train_micro_batch_size (4 // world), logprob size 3, each rank's
        # samples longest first
        for size, got in ((4 // world, res["padded"]["metrics"]),
                          (3, res["padded"]["logprob_stats"])):
            ranked = [np.sort(lens[r:r + share])[::-1] for r in range(0, len(lens), share)]
            computed = sum(len(mine[s:s + size]) * mine[s:s + size].max()
                           for mine in ranked for s in range(0, share, size))
            assert got["pad_token_frac"] == pytest.approx(1 - lens.sum() / computed) and computed > lens.sum()
            assert got["micro_steps"] == -(-share // size)


@pytest.mark.timeout(300)
def test_fixed_seq_length_pads_to_it_and_changes_no_value(ranks):
    """``seq_length`` pads every unpacked micro-batch to exactly that width: log-probs, loss,
    gradients and the step are those of per-micro-batch padding; the padding share counts the
    fixed width; a sample longer than it is a ConfigError naming the key."""
    world, results = ranks
    lens = np.diff(make_batch(1000)["offsets"])
    for res in results:
        fixed, padded = res["fixed"], res["padded"]
        np.testing.assert_allclose(fixed["logp"], padded["logp"], rtol=0, atol=1e-5)
        np.testing.assert_allclose(fixed["entropy"], padded["entropy"], rtol=0, atol=1e-5)
        for name in METRICS:
            assert fixed["metrics"][name] == pytest.approx(padded["metrics"][name], abs=1e-6), name
            assert fixed["step"][name] == pytest.approx(padded["step"][name], abs=1e-6), name
        assert fixed["step"]["grad_norm"] == pytest.approx(padded["step"]["grad_norm"], rel=1e-5)
        assert fixed["metrics"]["pad_token_frac"] == pytest.approx(1 - lens.sum() / (len(lens) * FIXED_WIDTH))
        assert fixed["logprob_stats"]["pad_token_frac"] == pytest.approx(1 - lens.sum() / (len(lens) * FIXED_WIDTH))
        key, msg = res["too_long"]
        assert key == "models.policy_trainer.seq_length" and "13 tokens" in msg and "(12)" in msg
    if world == 1:
        for name, g in results[0]["padded"]["grads"].items():
            torch.testing.assert_close(results[0]["fixed"]["grads"][name], g, rtol=0, atol=1e-5, msg=name)


def test_new_metrics_are_documented():
    from metrics_doc import undocumented

    assert not undocumented(["train/pad_token_frac", "train/micro_steps",
                             "perf/logprob_pad_token_frac", "perf/logprob_micro_steps"])


def test_packing_with_the_megatron_backend_reaches_both_trainers(paths_overrides, monkeypatch):
    """The Megatron trainer packs too (tests/models/trainer/test_megatron_trainer.py); a
    non-positive max_token_in_packing is still a config error naming the key."""
    from chatlearn.config import load as config_load
    from chatlearn.config.plan import make_plan
    from chatlearn.models.specs import TrainerSpec

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(config_load, "_importable", lambda module: True)
    over = paths_overrides + ["runtime_args.train_backend=megatron",
                              "models.policy_trainer.packing=true"]
    cfg = config_load.load_config("template/grpo_fsdp.yaml",
                                  over + ["models.policy_trainer.max_token_in_packing=64"])
    for name in ("policy_trainer", "ref_policy"):
        spec = TrainerSpec.from_config(cfg, name, make_plan(cfg))
        assert spec.packing is True and spec.max_token_in_packing == 64, name
    with pytest.raises(ConfigError) as info:
        config_load.load_config("template/grpo_fsdp.yaml",
                                over + ["models.policy_trainer.max_token_in_packing=0"])
    assert info.value.key.endswith(".max_token_in_packing")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_short_run_with_packing():
    """The embedded default, shortened, with packing on (hf rollout): the suite's shared ``short_hf`` run
    (tests/support/shared_runs.py)."""
    from shared_runs import finished

    rows = finished("short_hf").check().rows()
    assert [r["episode"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        assert r["train/pad_token_frac"] == 0.0 and r["perf/logprob_pad_token_frac"] == 0.0
        assert r["train/micro_steps"] >= 1 and r["perf/logprob_micro_steps"] >= 1
        assert np.isfinite(r["train/loss"]) and r["train/logprob_diff_rollout_vs_trainer_max"] < 1e-4
