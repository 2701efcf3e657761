"""The FSDP2 trainer on a mixture-of-experts model (the MoE toy ``assets/tiny_qwen3_moe``: Qwen3-MoE,
8 experts, top-2, transformers 5's fused 3D expert tensors): 2 ranks = 1 rank (log-probs, loss,
gradients, one optimizer step, the MoE metrics) with the router's aux and z-losses on; the trainer's
log-probs = plain transformers' = the hf rollout's; the weight push into the hf rollout; offload and
onload; exact resume (with forced load balancing, whose noise comes from the checkpointed RNG);
``chatlearn merge`` of the checkpoint into a folder transformers loads with the same logits; the MoE
keys acting (grouped GEMM, layer recompute, forced balancing); a checkpoint of another expert count.

Two jobs run once per module (2 ranks and 1 rank, processes with a hard deadline); the tests compare
what they return.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import backend_specs
import numpy as np
import pytest
import torch

from tests.models.trainer.test_fsdp_trainer import (TEMPERATURE, add_logprobs, hf_logprobs, make_batch,
                                                    probe_logits, run_ranks, trainer_spec)

ASSET = str(Path(__file__).resolve().parents[3] / "assets" / "tiny_qwen3_moe")
# the router's losses on, so that their gradients are part of every parity below
MOE = backend_specs.MOE_DEFAULTS.replace(aux_loss_coeff=0.05, z_loss_coeff=1e-3)
MOE_METRICS = ("moe/aux_loss", "moe/z_loss", "moe/load_imbalance")
METRICS = ("loss", "policy_loss", "kl", "entropy", "clip_frac", "num_tokens") + MOE_METRICS


def moe_spec(path, **over):
    """One sample per micro-batch: the router's losses are means over micro-batches of a nonlinear
    function of their tokens, the same on 1 and 2 ranks only when the micro-batches are."""
    return trainer_spec(path, **{"moe": MOE, "train_micro_batch_size": 1, **over})


def _params(trainer) -> dict:
    from chatlearn.models.trainer.fsdp import _full_tensor

    return {n: _full_tensor(p).detach().clone() for n, p in trainer.model.named_parameters()}


def _parity_part(trainer, batch) -> dict:
    logp, ent = trainer.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
    metrics = trainer.compute_grads(batch)
    grads = trainer.full_grads()
    trainer.zero_grad()
    step = trainer.train(batch)
    return {"logp": logp, "entropy": ent, "metrics": metrics, "step_metrics": step,
            "grads": grads if trainer.rank == 0 else None, "after_step": _params(trainer)}


def job_two_ranks(rank, world, path, batch, probe, out):
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    trainer = FSDPTrainer(moe_spec(path))
    res = _parity_part(trainer, batch)
    res["sharded"] = trainer.sharded
    buckets = list(trainer.export_weights(bucket_mb=1))
    res["exported"] = {k: v for b in buckets for k, v in b}
    res["probe_logits"] = probe_logits(trainer, probe)
    trainer.save_hf(os.path.join(out, "saved"))
    trainer.save_checkpoint(os.path.join(out, "ckpt"))
    return res


def job_one_rank(rank, world, path, batch, probe, out, other_path, rollout_batch):
    from chatlearn.errors import UserError
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    trainer = FSDPTrainer(moe_spec(path))
    res = {"on_rollout_batch": trainer.compute_logprobs(rollout_batch, temperature=ROLLOUT_TEMPERATURE)}
    res.update(_parity_part(trainer, batch))
    res["implementation"] = trainer.model.config._experts_implementation
    # offload / onload: bit for bit
    logits0 = probe_logits(trainer, probe)
    trainer.offload(["weights", "optimizer", "grads"])
    trainer.onload(["weights", "optimizer", "grads"])
    res["onload_logits_equal"] = torch.equal(probe_logits(trainer, probe), logits0)
    # grouped GEMM: the same log-probs and gradients as one matmul per expert
    grouped = FSDPTrainer(moe_spec(path, moe=MOE.replace(groupgemm=True)))
    res["grouped_implementation"] = grouped.model.config._experts_implementation
    res["grouped_logp"] = grouped.compute_logprobs(batch, temperature=TEMPERATURE)
    res["grouped_metrics"] = grouped.compute_grads(batch)
    res["grouped_grads"] = grouped.full_grads()
    # MoE layer recompute, and whole-layer gradient checkpointing: the same gradients and router losses
    for name, over in (("recompute", dict(moe=MOE.replace(layer_recompute=True))),
                       ("ckpt", dict(gradient_checkpointing=True))):
        t = FSDPTrainer(moe_spec(path, **over))
        calls = []  # the first router's forwards: with recomputation once more in backward
        t.moe.routers[0].register_forward_hook(lambda *a: calls.append(1))
        res[f"{name}_metrics"] = t.compute_grads(batch)
        res[f"{name}_grads"] = t.full_grads()
        res[f"{name}_router_calls"] = len(calls)
    # the router losses off: the gradients change (the coefficients act)
    plain = FSDPTrainer(moe_spec(path, moe=MOE.replace(aux_loss_coeff=0.0, z_loss_coeff=0.0)))
    res["no_router_loss_metrics"] = plain.compute_grads(batch)
    res["no_router_loss_grads"] = plain.full_grads()
    # forced load balancing: random routing, an even spread of the tokens; exact resume with it on
    forced_spec = moe_spec(path, moe=MOE.replace(force_load_balancing=True))
    forced = FSDPTrainer(forced_spec)
    res["forced_metrics"] = forced.train(batch)
    forced.save_checkpoint(os.path.join(out, "forced_ckpt"))
    res["forced_second"] = forced.train(batch)
    res["forced_second_params"] = _params(forced)
    resumed = FSDPTrainer(forced_spec)
    resumed.load_checkpoint(os.path.join(out, "forced_ckpt"))
    res["resumed_second"] = resumed.train(batch)
    res["resumed_second_params"] = _params(resumed)
    # LoRA: on the attention's linear layers it trains (the experts stay the base's); all-linear is refused
    from chatlearn.models.specs import LoraSpec

    lora = dict(rank=4, alpha=8.0, dropout=0.0, modules_to_save=(), push="merged")
    adapted = FSDPTrainer(moe_spec(path, lora=LoraSpec(target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
                                                       **lora)))
    res["lora_step"] = adapted.train(batch)
    res["lora_names"] = [name for name, *_ in adapted.weight_specs()]
    try:
        FSDPTrainer(moe_spec(path, lora=LoraSpec(target_modules="all-linear", **lora)))
        res["lora_all_linear_error"] = None
    except UserError as err:
        res["lora_all_linear_error"] = (err.key, str(err))
    # the critic: Qwen3MoeForTokenClassification (the MoE backbone, a value head) gives values and trains
    critic = FSDPTrainer(moe_spec(path, role="critic"))
    res["critic_values"] = critic.compute_values(batch)
    res["critic_step"] = critic.train(dict(batch, returns=np.ones_like(batch["old_logprobs"]),
                                           values=res["critic_values"]))
    # a checkpoint of a model with another expert count: refused before any collective
    other = FSDPTrainer(moe_spec(other_path))
    try:
        other.load_checkpoint(os.path.join(out, "forced_ckpt"))
        res["other_experts_error"] = None
    except UserError as err:
        res["other_experts_error"] = str(err)
    return res


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(ASSET).vocab_size
    batch = make_batch(vocab)
    logp, _ = hf_logprobs(ASSET, batch)
    batch = add_logprobs(batch, logp)
    probe = torch.from_numpy(np.random.default_rng(3).integers(0, vocab, (2, 9)))
    other = str(tmp_path_factory.mktemp("other_experts"))
    make_other_experts(other, 4)
    return {"path": ASSET, "batch": batch, "probe": probe, "hf_logp": logp, "other": other,
            "rollout_batch": rollout_batch()}


ROLLOUT_TEMPERATURE = 0.8


def rollout_batch() -> dict:
    """Samples of the hf rollout on the MoE toy (its grouped_mm experts, its KV cache), with its log-probs."""
    from chatlearn.models.rollout.hf import HFRollout

    rollout = HFRollout(backend_specs.rollout_spec(ASSET, generation_batch_size=8))
    prompts = [[1, 30 + i, 40, 50 + i, 2] for i in range(6)]
    batch = rollout.generate(prompts, {"temperature": ROLLOUT_TEMPERATURE, "top_p": 1.0, "top_k": -1,
                                       "max_tokens": 8, "seed": 3})
    return {k: np.asarray(v) for k, v in batch.items()}


def make_other_experts(path: str, experts: int) -> None:
    """The MoE toy's config and tokenizer with ``experts`` experts, random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ASSET)
    config.num_experts = experts
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(ASSET, name), os.path.join(path, name))


@pytest.fixture(scope="module")
def two(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("two")
    t0 = time.monotonic()
    results = run_ranks(job_two_ranks, 2, out, setup["path"], setup["batch"], setup["probe"], str(out))
    print(f"2-rank job: {time.monotonic() - t0:.1f}s")
    return results, out


@pytest.fixture(scope="module")
def one(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    return run_ranks(job_one_rank, 1, out, setup["path"], setup["batch"], setup["probe"], str(out),
                     setup["other"], setup["rollout_batch"], timeout=240)[0]


@pytest.mark.timeout(400)
def test_two_ranks_match_one_rank_on_moe(two, one):
    (r0, r1), _ = two
    assert r0["sharded"] and "gate_up_proj" in " ".join(r0["after_step"])  # the fused 3D experts
    np.testing.assert_allclose(r0["logp"], one["logp"], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(r0["logp"], r1["logp"])
    for name in METRICS:
        assert r0["metrics"][name] == r1["metrics"][name], name
        assert r0["metrics"][name] == pytest.approx(one["metrics"][name], abs=1e-5), name
    for name in METRICS + ("grad_norm", "lr"):
        assert r0["step_metrics"][name] == pytest.approx(one["step_metrics"][name], rel=1e-5, abs=1e-6), name
    assert r0["metrics"]["moe/aux_loss"] > 1.0 and r0["metrics"]["moe/load_imbalance"] > 1.0
    g2, g1 = r0["grads"], one["grads"]
    assert g2.keys() == g1.keys()
    assert g1["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3
    assert g1["model.layers.0.mlp.gate.weight"].abs().sum() > 0
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=0, atol=2e-6, msg=name)
    for name, p in one["after_step"].items():
        torch.testing.assert_close(r0["after_step"][name], p, rtol=0, atol=1e-6, msg=name)


@pytest.mark.timeout(400)
def test_moe_logprobs_match_plain_transformers(setup, one):
    logp, _ = hf_logprobs(setup["path"], setup["batch"], TEMPERATURE)
    np.testing.assert_allclose(one["logp"], logp, atol=1e-5, rtol=0)


@pytest.mark.timeout(400)
def test_grouped_gemm_gives_the_same_logprobs_and_gradients(one):
    assert one["implementation"] == "eager" and one["grouped_implementation"] == "grouped_mm"
    np.testing.assert_allclose(one["grouped_logp"], one["logp"], atol=1e-5, rtol=0)
    for name, g in one["grads"].items():
        torch.testing.assert_close(one["grouped_grads"][name], g, rtol=0, atol=1e-6, msg=name)


@pytest.mark.timeout(400)
def test_layer_recompute_and_checkpointing_give_the_same_gradients(one):
    micro_steps = one["metrics"]["micro_steps"]
    assert one["recompute_router_calls"] == one["ckpt_router_calls"] == 2 * micro_steps  # recomputed in backward
    for name in ("recompute", "ckpt"):
        for m in METRICS:
            assert one[f"{name}_metrics"][m] == pytest.approx(one["metrics"][m], abs=1e-6), (name, m)
        for p, g in one["grads"].items():
            torch.testing.assert_close(one[f"{name}_grads"][p], g, rtol=0, atol=1e-6, msg=(name, p))


@pytest.mark.timeout(400)
def test_router_losses_act_on_the_gradients(one):
    plain, full = one["no_router_loss_grads"], one["grads"]
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(plain[router], full[router], atol=1e-7)
    # the policy loss itself does not change; the metrics are measured either way
    assert one["no_router_loss_metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], abs=1e-6)
    assert one["no_router_loss_metrics"]["moe/aux_loss"] == pytest.approx(one["metrics"]["moe/aux_loss"])


@pytest.mark.timeout(400)
def test_forced_balancing_spreads_tokens_and_resumes_exactly(one):
    assert one["forced_metrics"]["moe/load_imbalance"] < one["metrics"]["moe/load_imbalance"]
    for name in METRICS + ("grad_norm",):
        assert one["resumed_second"][name] == one["forced_second"][name], name
    for name, p in one["forced_second_params"].items():
        assert torch.equal(one["resumed_second_params"][name], p), name


@pytest.mark.timeout(400)
def test_a_checkpoint_of_another_expert_count_is_refused(one):
    err = one["other_experts_error"]
    assert err is not None and "8 experts" in err and "4" in err and "num_experts" in err


@pytest.mark.timeout(400)
def test_export_and_save_hf_of_moe_load_in_transformers_and_the_hf_rollout(setup, two):
    from transformers import AutoModelForCausalLM

    from chatlearn.models.rollout.hf import HFRollout

    (r0, r1), out = two
    assert r1["exported"] == {}
    assert r0["exported"]["model.layers.1.mlp.experts.down_proj"].shape == (8, 128, 64)
    saved = AutoModelForCausalLM.from_pretrained(out / "saved", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(saved(input_ids=setup["probe"]).logits, r0["probe_logits"], rtol=0, atol=1e-5)
    # the weight push into the hf rollout: its log-probs are then the trained model's
    rollout = HFRollout(backend_specs.rollout_spec(setup["path"], generation_batch_size=8))
    rollout.begin_weight_update()
    rollout.load_weight_bucket(list(r0["exported"].items()))
    rollout.finish_weight_update()
    with torch.no_grad():
        logits = rollout.model(input_ids=setup["probe"]).logits
    torch.testing.assert_close(logits, r0["probe_logits"], rtol=0, atol=1e-5)


@pytest.mark.timeout(400)
def test_merge_of_the_moe_checkpoint_loads_with_the_trainers_logits(two, tmp_path, setup):
    from transformers import AutoModelForCausalLM

    from chatlearn.checkpoint.merge import merge_checkpoint

    (r0, _), out = two
    summary = merge_checkpoint(str(out / "ckpt"), str(tmp_path / "merged"))
    assert summary["num_tensors"] > 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["num_local_experts"] == 8 and config["architectures"] == ["Qwen3MoeForCausalLM"]
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=setup["probe"]).logits, r0["probe_logits"], rtol=0, atol=1e-5)
    # the config of a model with another expert count: refused, naming the expert tensors' shapes
    from chatlearn.errors import UserError

    with pytest.raises(UserError, match=r"experts\.gate_up_proj.*\[4, 128, 128\].*\[8, 128, 128\]"):
        merge_checkpoint(str(out / "ckpt"), str(tmp_path / "other"), hf_config=setup["other"])


@pytest.mark.timeout(400)
def test_trainer_logprobs_match_the_hf_rollouts_on_moe(setup, one):
    """The hf rollout's sampled log-probs (transformers' default grouped_mm experts, its KV cache) = the
    trainer's (eager experts) of the same tokens, with the asset's weights."""
    batch = setup["rollout_batch"]
    assert (batch["rollout_logprobs"] != 0).sum() >= 6
    np.testing.assert_allclose(one["on_rollout_batch"], batch["rollout_logprobs"], atol=2e-5, rtol=0)


@pytest.mark.timeout(400)
def test_lora_on_moe_takes_linear_layers_and_refuses_the_fused_experts(one, two):
    (r0, _), _ = two
    assert one["lora_names"] == list(r0["exported"]) or set(one["lora_names"]) == set(r0["exported"])
    assert one["lora_step"]["skipped_steps"] == 0.0 and one["lora_step"]["grad_norm"] > 0
    key, text = one["lora_all_linear_error"]
    assert key == "models.policy_trainer.lora.target_modules"
    assert "ParamWrapper" in text and "q_proj" in text and "experts" in text


@pytest.mark.timeout(400)
def test_the_critic_on_moe_gives_values_and_trains(setup, one):
    from chatlearn.models.base import response_mask

    mask = response_mask(setup["batch"])
    assert np.all(one["critic_values"][~mask] == 0) and np.any(one["critic_values"][mask] != 0)
    assert one["critic_step"]["skipped_steps"] == 0.0 and one["critic_step"]["value_loss"] > 0
