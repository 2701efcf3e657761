"""share_prompt: samples of a micro-batch that start with the same prompt compute it once.

The trainer's log-probs, entropies, gradients and step with sharing equal those without it and
plain transformers' per sample (1 and 2 ranks, padded and packed plans, gradient checkpointing, a
multi-turn loss mask); the micro-batch plan keeps groups together and counts what it saved; the
attention function is that of the samples one by one (grouped-query heads included); settings
that cannot be honoured are refused naming the key.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from test_fsdp_trainer import (add_logprobs, hf_logprobs, make_tiny_model, run_ranks, trainer_spec,
                               with_observations)

from chatlearn.errors import ConfigError, UserError
from chatlearn.models.trainer import shared_prompt
from chatlearn.models.trainer.packing import plan_shared_micro_batches

TEMPERATURE = 0.8


def grouped_batch(vocab: int, groups: int = 4, per_group: int = 4, seed: int = 0) -> dict:
    """``groups`` prompts of 3..9 tokens, each followed by ``per_group`` responses of 1..7 tokens;
    groups in order (as a rollout returns them), the last group split by one foreign sample."""
    rng = np.random.default_rng(seed)
    seqs, plens = [], []
    for _ in range(groups):
        prompt = rng.integers(0, vocab, rng.integers(3, 10))
        for _ in range(per_group):
            seqs.append(np.concatenate([prompt, rng.integers(0, vocab, rng.integers(1, 8))]))
            plens.append(len(prompt))
    seqs.insert(len(seqs) - 2, seqs.pop(0))  # group 0's first sample among the last group's
    plens.insert(len(plens) - 2, plens.pop(0))
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum([len(s) for s in seqs], out=offsets[1:])
    return {"tokens": np.concatenate(seqs).astype(np.int64), "offsets": offsets,
            "prompt_lens": np.asarray(plens, np.int64),
            "advantages": rng.normal(size=len(seqs)).astype(np.float32)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoConfig

    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    batch = grouped_batch(AutoConfig.from_pretrained(path).vocab_size)
    logp, ent = hf_logprobs(path, batch, TEMPERATURE)
    return {"path": path, "batch": add_logprobs(batch, logp), "logp": logp, "entropy": ent}


def _job(rank, world, path, batch) -> dict:
    """Every variant's log-probs, entropies, gradients (before a step), then one step's metrics."""
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    out = {}
    variants = {"plain": dict(share_prompt=False), "shared": dict(share_prompt=True),
                "shared_packed": dict(share_prompt=True, packing=True, max_token_in_packing=40),
                "shared_ckpt": dict(share_prompt=None, gradient_checkpointing=True),
                "shared_units": dict(share_prompt=True),
                "shared_obs": dict(share_prompt=True), "plain_obs": dict(share_prompt=False)}
    from chatlearn.models.trainer import shared_prompt as sp

    default = sp.MASK_ELEMENTS
    if world > 1:  # the ranks' parity on the main forms; the others against one rank's plain trainer
        variants = {k: v for k, v in variants.items() if k in ("plain", "shared", "shared_packed")}
    for name, over in variants.items():
        sp.MASK_ELEMENTS = 0 if name == "shared_units" else default  # 0: the per-unit form, without masks
        trainer = FSDPTrainer(trainer_spec(path, train_micro_batch_size=6, logprob_micro_batch_size=5, **over))
        b = with_observations(batch) if name.endswith("_obs") else batch
        logp, ent = trainer.compute_logprobs(b, temperature=TEMPERATURE, with_entropy=True)
        stats = trainer.logprob_stats()
        metrics = trainer.compute_grads(b, temperature=TEMPERATURE)
        grads = trainer.full_grads()
        trainer.zero_grad()
        step = trainer.train(b, temperature=TEMPERATURE)
        out[name] = {"logp": logp, "entropy": ent, "stats": stats, "metrics": metrics, "step": step,
                     "grads": grads if rank == 0 else None, "on": trainer.share_prompt}
    return out


@pytest.fixture(scope="module")
def one(setup, tmp_path_factory):
    return run_ranks(_job, 1, tmp_path_factory.mktemp("one"), setup["path"], setup["batch"])[0]


@pytest.fixture(scope="module")
def two(setup, tmp_path_factory):
    return run_ranks(_job, 2, tmp_path_factory.mktemp("two"), setup["path"], setup["batch"])


def _close_metrics(a: dict, b: dict) -> None:
    for key in ("loss", "policy_loss", "kl", "entropy", "clip_frac", "num_tokens", "grad_norm"):
        if key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


@pytest.mark.timeout(300)
def test_shared_prompt_gives_the_samples_own_values(setup, one, two):
    from chatlearn.models.base import response_mask

    mask = response_mask(setup["batch"])
    assert not one["plain"]["on"] and one["shared"]["on"] and one["shared_ckpt"]["on"]  # null: on here
    for res in (one, *two):
        for name in [n for n in ("shared", "shared_packed", "shared_ckpt", "shared_units") if n in res]:
            r = res[name]
            np.testing.assert_allclose(r["logp"][mask], setup["logp"][mask], rtol=0, atol=2e-5)
            np.testing.assert_allclose(r["entropy"][mask], setup["entropy"][mask], rtol=0, atol=2e-5)
            assert np.all(r["logp"][~mask] == 0)
            _close_metrics(r["metrics"], one["plain"]["metrics"])
            _close_metrics(r["step"], one["plain"]["step"])
    _close_metrics(one["shared_obs"]["metrics"], one["plain_obs"]["metrics"])
    np.testing.assert_allclose(one["shared_obs"]["logp"], one["plain_obs"]["logp"], rtol=0, atol=2e-5)
    for name in ("shared", "shared_packed", "shared_ckpt", "shared_units", "shared_obs"):
        for res in [r for r in (one, two[0]) if name in r]:
            plain = one["plain_obs" if name.endswith("_obs") else "plain"]["grads"]
            for key, g in res[name]["grads"].items():
                torch.testing.assert_close(g, plain[key], rtol=1e-4, atol=2e-6, msg=f"{name} {key}")


@pytest.mark.timeout(300)
def test_shared_prompt_stats_count_the_tokens_not_computed(setup, one, two):
    b = setup["batch"]
    lens, plen = np.diff(b["offsets"]), b["prompt_lens"]
    assert one["plain"]["stats"]["pad_token_frac"] > 0 and "shared_token_frac" not in one["plain"]["stats"]
    for res in (one, two[0]):
        stats = res["shared"]["stats"]
        assert stats["pad_token_frac"] == 0.0 and 0 < stats["shared_token_frac"] < 1
        assert res["shared"]["step"]["shared_token_frac"] > 0
    # one rank, micro-batches of 5 samples in group order: recompute the saving by hand
    groups = shared_prompt.prompt_group_ids(b)
    order = np.argsort(groups, kind="stable")
    computed = 0
    for mb in np.array_split(order, range(5, len(order), 5)):
        seen = set()
        for i in mb:
            computed += lens[i] - (plen[i] if groups[i] in seen else 0)
            seen.add(groups[i])
    assert one["shared"]["stats"]["shared_token_frac"] == pytest.approx(1 - computed / lens.sum())


def test_plan_keeps_groups_together_and_respects_the_limits():
    lens = np.array([10, 12, 9, 11, 20, 21, 8, 30])
    plen = np.array([6, 6, 6, 6, 15, 15, 6, 25])
    groups = np.array([0, 0, 0, 0, 1, 1, 0, 2])
    plans, stats = plan_shared_micro_batches(lens, plen, groups, [np.arange(8)], 4, False, 0)
    assert [list(mb) for mb in plans[0]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    computed = (10 + 6 + 3 + 5) + (20 + 6 + 8 + 30)
    assert stats == {"pad_token_frac": 0.0, "micro_steps": 2.0, "shared_token_frac": 1 - computed / lens.sum()}
    # packed: at most 40 computed tokens per micro-batch; group 0 then group 1 then group 2
    plans, stats = plan_shared_micro_batches(lens, plen, groups, [np.arange(8)], 1, True, 40)
    assert [list(mb) for mb in plans[0]] == [[0, 1, 2, 3, 6], [4, 5], [7]]
    assert stats["micro_steps"] == 3.0
    # two ranks: dummy micro-steps make the counts equal
    plans, stats = plan_shared_micro_batches(lens, plen, groups, [np.arange(4), np.arange(4, 8)], 2, False, 0)
    assert [len(p) for p in plans] == [2, 2] and all(len(mb) for p in plans for mb in p)
    plans, _ = plan_shared_micro_batches(lens, plen, groups, [np.arange(6), np.arange(6, 8)], 4, False, 0)
    assert [len(mb) for mb in plans[1]] == [2, 0]
    with pytest.raises(ConfigError) as err:
        plan_shared_micro_batches(lens, plen, groups, [np.arange(8)], 4, True, 25)
    assert err.value.key == "models.policy_trainer.max_token_in_packing"


@pytest.mark.parametrize("mask_elements", [1 << 22, 0], ids=["batched", "per_unit"])
def test_attention_equals_each_sample_alone_with_grouped_query_heads(mask_elements):
    """Random q/k/v of two units (4 query heads on 2 key/value heads): each token's output equals
    causal SDPA over its own sample, and so do the gradients of q, k and v; in both forms (batched
    with masks, per unit without)."""
    torch.manual_seed(0)

    class Module:
        num_key_value_groups = 2
        is_causal = True

    units, total, samples = [], 0, []
    for p, conts in ((3, [2, 4, 1]), (5, [3])):
        unit = shared_prompt.Unit(total, p, [])
        prompt = list(range(total, total + p))
        total += p
        for n in conts:
            unit.conts.append((total, n))
            samples.append(prompt + list(range(total, total + n)))
            total += n
        units.append(unit)
    q = torch.randn(1, 4, total, 8, requires_grad=True)
    k = torch.randn(1, 2, total, 8, requires_grad=True)
    v = torch.randn(1, 2, total, 8, requires_grad=True)
    layout = shared_prompt.build_layout(units, total, "cpu", mask_elements)
    assert (layout.units is None) == (mask_elements > 0)
    out, _ = shared_prompt.shared_prompt_attention(Module(), q, k, v, None, scaling=0.3,
                                                   **{shared_prompt.KWARG: layout})
    weights = torch.randn_like(out)
    gq, gk, gv = torch.autograd.grad((out * weights).sum(), (q, k, v))
    ref = torch.zeros_like(out)
    total_loss = 0
    done = set()
    for s in samples:
        idx = torch.tensor(s)
        kk, vv = k[0][:, idx].repeat_interleave(2, 0), v[0][:, idx].repeat_interleave(2, 0)
        o = torch.nn.functional.scaled_dot_product_attention(q[0][:, idx], kk, vv, is_causal=True, scale=0.3)
        o = o.transpose(0, 1)  # [len, H, d]
        fresh = [j for j, t in enumerate(s) if t not in done]  # a prompt token's output counts once
        ref[0, idx[fresh]] = o[fresh].detach()
        total_loss = total_loss + (o[fresh] * weights[0, idx[fresh]]).sum()
        done.update(s)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    rq, rk, rv = torch.autograd.grad(total_loss, (q, k, v))
    for a, b in ((gq, rq), (gk, rk), (gv, rv)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def _refusals(rank, world, path, sliding) -> dict:
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    out = {}
    try:
        FSDPTrainer(trainer_spec(sliding, share_prompt=True))
    except UserError as e:
        out["refused"] = (e.key, str(e))
    out["sliding_null"] = FSDPTrainer(trainer_spec(sliding, share_prompt=None, trainable=False)).share_prompt
    out["seq_length_null"] = FSDPTrainer(trainer_spec(path, share_prompt=None, seq_length=64)).share_prompt
    out["ref_null"] = FSDPTrainer(trainer_spec(path, share_prompt=None, trainable=False)).share_prompt
    return out


def test_settings_that_cannot_be_honoured_are_refused(setup, tmp_path):
    """true on a sliding-window model: a UserError naming the key; null there, or with a fixed
    seq_length: off. The config refuses true with the Megatron backend or a fixed seq_length."""
    import json
    import os

    from transformers import AutoModelForCausalLM

    sliding = str(tmp_path / "sliding")
    AutoModelForCausalLM.from_pretrained(setup["path"]).save_pretrained(sliding)
    with open(os.path.join(sliding, "config.json")) as f:
        conf = json.load(f)
    conf.update(use_sliding_window=True, sliding_window=4, max_window_layers=0,
                layer_types=["sliding_attention"] * conf["num_hidden_layers"])
    with open(os.path.join(sliding, "config.json"), "w") as f:
        json.dump(conf, f)
    res = run_ranks(_refusals, 1, tmp_path, setup["path"], sliding)[0]
    key, message = res["refused"]
    assert key == "models.policy_trainer.share_prompt" and "not full attention" in message
    assert res["sliding_null"] is False and res["seq_length_null"] is False and res["ref_null"] is True


def test_config_refuses_true_where_it_cannot_act(paths_overrides, monkeypatch):
    from conftest import REPO

    from chatlearn.config.load import load_config
    from chatlearn.config.plan import make_plan
    from chatlearn.models.specs import TrainerSpec

    monkeypatch.chdir(REPO)

    def load(*over):
        return load_config("template/grpo_fsdp.yaml", paths_overrides + list(over))

    cfg = load()
    assert cfg.models.policy_trainer.share_prompt is None and cfg.models.ref_policy.share_prompt is None
    assert load("models.policy_trainer.share_prompt=false").models.ref_policy.share_prompt is False
    with pytest.raises(ConfigError) as err:
        load("models.policy_trainer.share_prompt=true", "models.policy_trainer.seq_length=300")
    assert err.value.key == "models.policy_trainer.share_prompt" and "seq_length" in str(err.value)
    load("models.policy_trainer.share_prompt=true", "models.policy_trainer.seq_length=300",
         "models.policy_trainer.packing=true")  # seq_length is ignored with packing
    assert TrainerSpec.from_config(cfg, "policy_trainer", make_plan(cfg)).share_prompt is None
    if importlib.util.find_spec("megatron") is not None:
        with pytest.raises(ConfigError) as err:
            load("runtime_args.train_backend=megatron", "models.policy_trainer.share_prompt=true")
        assert err.value.key == "models.policy_trainer.share_prompt" and "FSDP" in str(err.value)
        mcfg = load("runtime_args.train_backend=megatron")
        assert TrainerSpec.from_config(mcfg, "policy_trainer", make_plan(mcfg)).share_prompt is False
