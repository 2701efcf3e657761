"""LoRA on the FSDP trainer (models.policy_trainer.lora, chatlearn/models/trainer/lora.py): what trains,
what the optimizer and the checkpoint hold, the reference log-probs with the adapters disabled, the
merged and adapter-only weight views, and 1 rank vs 2 ranks.

Two jobs run once per module (1 rank: the plain module; 2 gloo ranks: FSDP2-sharded), spawned as in
test_fsdp_trainer.py."""
from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest
import torch

from chatlearn.models.specs import LoraSpec
from tests.models.trainer.test_fsdp_trainer import (TEMPERATURE, add_logprobs, hf_logprobs, make_batch,
                                                    make_tiny_model, run_ranks, trainer_spec)

LORA = LoraSpec(rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear", modules_to_save=(), push="adapters")


def lora_spec(path: str, **over):
    # lr 1e-2: one step moves the adapters visibly; no KL term (the reference is tested on its own)
    return trainer_spec(path, lora=over.pop("lora", LORA), lr=1e-2, kl_coef=0.0, **over)


def _snapshot(trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _merged_matches_peft(trainer) -> dict:
    """The merged export against peft's own merge_and_unload of a copy; the adapter export against
    get_peft_model_state_dict (world 1: the plain module)."""
    import copy

    from peft import get_peft_model_state_dict

    merged = dict(trainer.export_tensors([s[0] for s in trainer.weight_specs()]))
    reference = copy.deepcopy(trainer.peft).merge_and_unload().state_dict()
    adapter = dict(trainer.export_adapter())
    peft_sd = get_peft_model_state_dict(trainer.peft)
    return {
        "merged_names": sorted(merged), "spec_names": [s[0] for s in trainer.weight_specs()],
        "merged_max_diff": max(float((merged[n] - reference[n].float()).abs().max()) for n in merged),
        "missing_from_merged": sorted(set(reference) - set(merged) - {"lm_head.weight"}),
        "adapter_names": sorted(adapter), "peft_names": sorted(peft_sd),
        "adapter_max_diff": max(float((adapter[n] - peft_sd[n]).abs().max()) for n in adapter),
        "adapter_bytes": sum(t.numel() * t.element_size() for t in adapter.values()),
        "merged_bytes": sum(t.numel() * t.element_size() for t in merged.values()),
        "any_delta": max(float((merged[n] - reference[n].float()).abs().max()) for n in merged),
    }


def job_one_rank(rank, world, path, batch, out):
    from chatlearn.errors import UserError
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    trainer = FSDPTrainer(lora_spec(path))
    res = {"trained": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)}
    res["optimizer_params"] = len(trainer.optimizer.param_groups[0]["params"])
    res["dtypes"] = sorted({str(p.dtype) for p in trainer.model.parameters()})
    before = _snapshot(trainer)
    res["logp_before"] = trainer.compute_logprobs(batch, TEMPERATURE)
    trainer.compute_grads(batch, TEMPERATURE)
    res["grads"] = sorted(trainer.full_grads())
    trainer.zero_grad()
    res["step"] = trainer.train(batch, TEMPERATURE)
    after = _snapshot(trainer)
    res["changed"] = sorted(n for n in before if not torch.equal(before[n], after[n]))
    res["optimizer_state"] = sorted(
        n for n, p in trainer.model.named_parameters() if p in trainer.optimizer.state)
    res["logp_after"] = trainer.compute_logprobs(batch, TEMPERATURE)
    res["ref_logp"] = trainer.ref_logprobs(batch, TEMPERATURE)
    res["logp_after_ref"] = trainer.compute_logprobs(batch, TEMPERATURE)  # adapters back on
    res.update(_merged_matches_peft(trainer))
    # checkpoint: only the trained tensors; a fresh trainer resumes to the same log-probs
    ckpt = os.path.join(out, "ckpt")
    trainer.save_checkpoint(ckpt)
    with open(os.path.join(ckpt, "chatlearn_checkpoint.json"), encoding="utf-8") as f:
        res["ckpt_tensors"] = sorted(json.load(f)["tensors"])
    from chatlearn.checkpoint import sharded
    res["dcp_keys"] = sorted(sharded.read_dcp_metadata(ckpt).state_dict_metadata)
    resumed = FSDPTrainer(lora_spec(path, seed=7))  # other initial adapters: all must come from the checkpoint
    resumed.load_checkpoint(ckpt)
    res["resumed_logp"] = resumed.compute_logprobs(batch, TEMPERATURE)
    res["resumed_step"] = resumed.train(batch, TEMPERATURE)
    res["continued_step"] = trainer.train(batch, TEMPERATURE)
    # refusals: another base model, other adapter settings, a full (non-LoRA) trainer
    other = os.path.join(out, "other_base")
    shutil.copytree(path, other)
    with open(os.path.join(other, "config.json"), encoding="utf-8") as f:
        conf = json.load(f)
    conf["rms_norm_eps"] = 1e-5
    with open(os.path.join(other, "config.json"), "w", encoding="utf-8") as f:
        json.dump(conf, f)
    res["refusals"] = {}
    for name, spec in (("base", lora_spec(other)),
                       ("rank", lora_spec(path, lora=LORA.replace(rank=2))),
                       ("full", trainer_spec(path, kl_coef=0.0))):
        try:
            FSDPTrainer(spec).load_checkpoint(ckpt)
            res["refusals"][name] = None
        except UserError as err:
            res["refusals"][name] = str(err)
    # save_hf: the merged model loads in plain transformers and gives the trained log-probs
    hf = os.path.join(out, "hf")
    trainer.save_hf(hf)
    res["save_hf_logp"] = hf_logprobs(hf, batch, TEMPERATURE)[0]
    res["trainer_logp_final"] = trainer.compute_logprobs(batch, TEMPERATURE)
    return res


def job_ranks(rank, world, path, batch, out):
    """The same step on 1 or 2 ranks, with a list of target modules: losses, merged and adapter weights."""
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    # meta_init: on 2 ranks the adapters' initial values come from rank 0's copy (1 rank ignores it)
    # modules_to_save: the final norm trained in full beside the adapters (peft matches name endings:
    # "norm" alone would also take every layer's input_layernorm)
    spec = lora_spec(path, lora=LORA.replace(target_modules=("q_proj", "v_proj", "down_proj"),
                                             modules_to_save=("model.norm",)), meta_init=True)
    trainer = FSDPTrainer(spec)
    step = trainer.train(batch, TEMPERATURE)
    merged = dict(trainer.export_tensors([s[0] for s in trainer.weight_specs()]))
    adapter = dict(trainer.export_adapter())
    return {"step": step, "merged": merged if rank == 0 else None, "adapter": adapter if rank == 0 else None,
            "sharded": trainer.sharded, "ref": trainer.ref_logprobs(batch, TEMPERATURE),
            "peft": _merged_matches_peft(trainer) if world == 1 else None}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoConfig

    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    batch = make_batch(AutoConfig.from_pretrained(path).vocab_size)
    base_logp, _ = hf_logprobs(path, batch, TEMPERATURE)
    return {"path": path, "batch": add_logprobs(batch, base_logp), "base_logp": base_logp}


@pytest.fixture(scope="module")
def one(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora_one")
    return run_ranks(job_one_rank, 1, out, setup["path"], setup["batch"], str(out))[0]


@pytest.mark.timeout(240)
def test_only_the_adapters_train(one):
    assert one["trained"] and all(".lora_A." in n or ".lora_B." in n for n in one["trained"])
    assert one["optimizer_params"] == len(one["trained"])
    assert one["optimizer_state"] == one["trained"]
    assert one["grads"] == one["trained"]
    # one step changes exactly the adapters' B (A's gradient is 0 while B is 0) and nothing of the base
    assert one["changed"] and set(one["changed"]) <= set(one["trained"])
    assert one["dtypes"] == ["torch.float32"]
    assert one["step"]["grad_norm"] > 0


def test_reference_is_the_base_model(setup, one):
    base = setup["base_logp"]
    np.testing.assert_allclose(one["logp_before"], base, atol=2e-5)  # B starts at 0
    assert np.abs(one["logp_after"] - base).max() > 1e-3  # the step moved the policy
    np.testing.assert_allclose(one["ref_logp"], base, atol=2e-5)  # adapters off: the base
    np.testing.assert_array_equal(one["logp_after_ref"], one["logp_after"])  # and back on after


def test_merged_and_adapter_views_match_peft(one):
    assert one["merged_names"] == sorted(one["spec_names"])
    assert not one["missing_from_merged"]
    assert all("lora" not in n and "base_layer" not in n for n in one["merged_names"])
    assert one["merged_max_diff"] < 1e-6
    assert one["adapter_names"] == one["peft_names"]
    assert one["adapter_max_diff"] == 0
    assert one["adapter_bytes"] < one["merged_bytes"] / 5
    print(f"tiny model, rank 4 all-linear: adapter {one['adapter_bytes']} bytes, merged {one['merged_bytes']} bytes")


def test_checkpoint_holds_only_adapters_and_resumes(one):
    assert one["ckpt_tensors"] == one["trained"]
    model_keys = [k for k in one["dcp_keys"] if k.startswith("model.")]
    assert sorted(k[len("model."):] for k in model_keys) == one["trained"]
    assert all(".lora_" in k for k in one["dcp_keys"] if k.startswith("optimizer.state."))
    np.testing.assert_array_equal(one["resumed_logp"], one["logp_after"])
    assert one["resumed_step"]["loss"] == one["continued_step"]["loss"]
    refusals = one["refusals"]
    assert "not the same model now" in refusals["base"] and "models.policy_trainer.load" in refusals["base"]
    assert "lora.rank 4" in refusals["rank"]
    assert "holds LoRA adapters" in refusals["full"]


def test_save_hf_writes_the_merged_model(one):
    np.testing.assert_allclose(one["save_hf_logp"], one["trainer_logp_final"], atol=2e-5)


@pytest.mark.timeout(300)
def test_two_ranks_match_one_rank(setup, tmp_path_factory):
    t0 = time.monotonic()
    out1, out2 = tmp_path_factory.mktemp("lora_w1"), tmp_path_factory.mktemp("lora_w2")
    (r1,) = run_ranks(job_ranks, 1, out1, setup["path"], setup["batch"], str(out1))
    r2a, r2b = run_ranks(job_ranks, 2, out2, setup["path"], setup["batch"], str(out2))
    print(f"1 + 2 rank LoRA jobs: {time.monotonic() - t0:.1f}s")
    assert r2a["sharded"] and not r1["sharded"]
    for key in ("loss", "policy_loss", "grad_norm"):
        assert r2a["step"][key] == pytest.approx(r1["step"][key], rel=1e-5, abs=1e-7), key
    assert r2a["step"]["loss"] == r2b["step"]["loss"]
    assert sorted(r2a["merged"]) == sorted(r1["merged"])
    for n, t in r1["merged"].items():
        torch.testing.assert_close(r2a["merged"][n], t, atol=1e-6, rtol=1e-5)
    assert sorted(r2a["adapter"]) == sorted(r1["adapter"])
    assert all(n.endswith(("q_proj.lora_A.weight", "q_proj.lora_B.weight", "v_proj.lora_A.weight",
                           "v_proj.lora_B.weight", "down_proj.lora_A.weight", "down_proj.lora_B.weight"))
               for n in r1["adapter"] if n != "base_model.model.model.norm.weight")
    assert "base_model.model.model.norm.weight" in r1["adapter"]  # the trained copy, under peft's name
    peft = r1["peft"]
    assert peft["adapter_names"] == peft["peft_names"] and peft["adapter_max_diff"] == 0
    assert peft["merged_max_diff"] < 1e-6 and not peft["missing_from_merged"]
    assert not torch.equal(r1["merged"]["model.norm.weight"], torch.ones_like(r1["merged"]["model.norm.weight"]))
    np.testing.assert_allclose(r2a["ref"], setup["base_logp"], atol=2e-5)
