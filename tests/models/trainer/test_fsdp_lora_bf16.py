"""LoRA with bfloat16 compute (``bf16`` on CUDA): the frozen base stored in bfloat16, the adapters and the
``modules_to_save`` copies in float32 (the only master weights and Adam state), FSDP2's mixed-precision policy
around both (chatlearn/models/trainer/fsdp.py ``param_dtype``, ``bf16_compute``; lora.py ``float32_trained``).

There is no GPU here: the job builds the real trainer on the CPU (gloo, world 1) with only the device-type
decision patched (``fsdp.bf16_compute`` also answers yes for the CPU), so that ``_build_model`` takes its CUDA
path: the bfloat16 load (``meta_init``: the meta model and rank 0's copy), the float32 adapters, FSDP2's
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (bfloat16 matmuls run on the CPU)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from chatlearn.models.specs import LoraSpec
from tests.models.trainer.test_fsdp_trainer import (TEMPERATURE, add_logprobs, hf_logprobs, make_batch,
                                                    make_tiny_model, run_ranks, trainer_spec)

# norms trained in full: modules_to_save copies, which peft leaves in the base's dtype; those of the decoder
# layers share an FSDP group with the float32 adapters (a bfloat16 copy there fails FSDP2's _init_mp_dtypes)
LORA = LoraSpec(rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear",
                modules_to_save=("model.norm", "post_attention_layernorm"), push="adapters")


def test_param_dtype_decision():
    from chatlearn.models.trainer.fsdp import bf16_compute, param_dtype

    bf16, f32 = torch.bfloat16, torch.float32
    table = {  # (trainable, lora, bf16, device type): dtype the model is loaded and its frozen weights kept in
        (True, False, True, "cuda"): f32,   # full fine-tuning: float32 master weights
        (True, True, True, "cuda"): bf16,   # LoRA: the frozen base in the compute dtype
        (False, False, True, "cuda"): bf16,  # a frozen reference model
        (False, True, True, "cuda"): bf16,
        (True, True, False, "cuda"): f32,   # bf16 off
        (False, False, False, "cuda"): f32,
        (True, True, True, "cpu"): f32,     # the CPU computes in float32
        (False, False, True, "cpu"): f32,
        (True, True, None, "cpu"): f32,
    }
    for (trainable, lora, on, device), want in table.items():
        assert param_dtype(trainable, lora, on, device) is want, (trainable, lora, on, device)
    assert bf16_compute(True, "cuda") and not bf16_compute(True, "cpu") and not bf16_compute(None, "cuda")


def _full(trainer) -> dict:
    """Every parameter's whole tensor, a CPU copy in its own dtype."""
    from chatlearn.models.trainer.fsdp import _full_tensor

    return {n: _full_tensor(p).detach().to("cpu", copy=True) for n, p in trainer.model.named_parameters()}


def _fsdp_groups(model) -> list[dict]:
    """What FSDP2's ``_init_mp_dtypes`` checks, per parameter group: the dtypes of its trainable and of its
    frozen parameters, its policy, and (after a forward) the group's resolved original and reduce dtypes."""
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        if group is None:
            continue
        params = [fp.sharded_param for fp in group.fsdp_params]
        groups.append({"trainable": {str(p.dtype) for p in params if p.requires_grad},
                       "frozen": {str(p.dtype) for p in params if not p.requires_grad},
                       "policy": (str(group.mp_policy.param_dtype), str(group.mp_policy.reduce_dtype)),
                       "orig": str(getattr(group, "_orig_dtype", None)),
                       "reduce": str(getattr(group, "_reduce_dtype", None))})
    return groups


def _merged_from(snapshot: dict, scale: float) -> dict:
    """``W + B @ A x scale`` in float32 from a snapshot of the bfloat16 base and the float32 adapters, under
    the base model's names (the modules_to_save copy under its module's name)."""
    out = {}
    for n, w in snapshot.items():
        if ".lora_" in n or ".original_module." in n:
            continue
        if n.endswith(".base_layer.weight"):
            owner = n.removesuffix(".base_layer.weight")
            a, b = snapshot[f"{owner}.lora_A.default.weight"], snapshot[f"{owner}.lora_B.default.weight"]
            out[f"{owner}.weight"] = w.float() + (b.float() @ a.float()) * scale
        else:  # a bias of an adapted layer, a layer without adapters, the trained copy of model.norm
            out[n.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")] = w.float()
    return out


def job_bf16(rank, world, path, batch, out):
    from transformers import AutoModelForCausalLM

    from chatlearn.checkpoint import sharded
    from chatlearn.models.trainer import fsdp

    fsdp.bf16_compute = lambda bf16, device_type: bool(bf16)  # the CPU as a bfloat16 device: CUDA's path
    spec = trainer_spec(path, lora=LORA, lr=1e-2, kl_coef=0.0, bf16=True, meta_init=True)
    trainer = fsdp.FSDPTrainer(spec)
    res = {"sharded": trainer.sharded, "groups_before": _fsdp_groups(trainer.model)}
    params = dict(trainer.model.named_parameters())
    res["trained"] = sorted(n for n, p in params.items() if p.requires_grad)
    res["dtypes"] = {n: str(p.dtype) for n, p in params.items()}
    res["optimizer"] = sorted({str(p.dtype) for p in trainer.optimizer.param_groups[0]["params"]})
    res["optimizer_n"] = len(trainer.optimizer.param_groups[0]["params"])
    # rank 0's bfloat16 copy reached the meta model: the base is the checkpoint rounded to bfloat16 once
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
    before = _full(trainer)
    res["base_mismatch"] = [n for n, t in before.items() if ".lora_" not in n and
                            not torch.equal(t.to(torch.bfloat16), hf[n.replace(".base_layer.", ".").replace(
                                ".modules_to_save.default.", ".").replace(".original_module.", ".")])]
    res["logp_before"] = trainer.compute_logprobs(batch, TEMPERATURE)
    res["ref_before"] = trainer.ref_logprobs(batch, TEMPERATURE)
    res["step"] = trainer.train(batch, TEMPERATURE)
    res["groups_after"] = _fsdp_groups(trainer.model)
    after = _full(trainer)
    res["changed"] = sorted(n for n in before if not torch.equal(before[n], after[n]))
    res["adam_state"] = sorted({str(v.dtype) for s in trainer.optimizer.state.values() for k, v in s.items()
                                if k != "step"})
    res["logp_after"] = trainer.compute_logprobs(batch, TEMPERATURE)
    res["ref_after"] = trainer.ref_logprobs(batch, TEMPERATURE)
    # the merged export against W + B @ A x alpha / r computed here in float32 from the bfloat16 base
    merged = dict(trainer.export_tensors([s[0] for s in trainer.weight_specs()]))
    expected = _merged_from(after, LORA.alpha / LORA.rank)
    res["merged_names"] = (sorted(merged), sorted(expected))
    res["merged_dtypes"] = sorted({str(t.dtype) for t in merged.values()})
    res["merged_max_diff"] = max(float((merged[n] - expected[n]).abs().max()) for n in merged)
    res["merged_delta"] = float((merged["model.layers.0.self_attn.q_proj.weight"]
                                 - after["model.layers.0.self_attn.q_proj.base_layer.weight"].float()).abs().max())
    view = trainer.push_view()
    pushed = dict(view.export_tensors([s[0] for s in view.weight_specs()]))
    res["push_specs"] = sorted({s[1] for s in view.weight_specs()})
    res["push_dtypes"] = sorted({str(t.dtype) for t in pushed.values()})
    res["push_mismatch"] = [n for n, p in view.sources.items() if not torch.equal(pushed[n], after[p])]
    # checkpoint round trip: a trainer with other initial adapters (seed 7), built without meta_init
    ckpt = os.path.join(out, "ckpt")
    trainer.save_checkpoint(ckpt)
    res["ckpt_tensors"] = sharded.read_meta(ckpt)["tensors"]
    resumed = fsdp.FSDPTrainer(trainer_spec(path, lora=LORA, lr=1e-2, kl_coef=0.0, bf16=True, seed=7))
    res["resumed_differs_before_load"] = not torch.equal(
        _full(resumed)["model.layers.0.self_attn.q_proj.lora_A.default.weight"],
        after["model.layers.0.self_attn.q_proj.lora_A.default.weight"])
    resumed.load_checkpoint(ckpt)
    restored = _full(resumed)
    res["restored_mismatch"] = [n for n in after if not (restored[n].dtype == after[n].dtype
                                                         and torch.equal(restored[n], after[n]))]
    res["resumed_logp"] = resumed.compute_logprobs(batch, TEMPERATURE)
    # save_hf: the merged weights in float32, config.json saying so
    folder = os.path.join(out, "hf")
    trainer.save_hf(folder)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        res["hf_config_dtype"] = json.load(f)["dtype"]
    from safetensors.torch import load_file

    saved = load_file(os.path.join(folder, "model.safetensors"))
    res["hf_mismatch"] = [n for n in saved if not torch.equal(saved[n], merged[n])]
    res["hf_missing"] = sorted(set(merged) - set(saved))
    return res


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    from transformers import AutoConfig

    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny_bf16")))
    batch = make_batch(AutoConfig.from_pretrained(path).vocab_size)
    base_logp, _ = hf_logprobs(path, batch, TEMPERATURE)
    out = tmp_path_factory.mktemp("lora_bf16")
    return run_ranks(job_bf16, 1, out, path, add_logprobs(batch, base_logp), str(out))[0]


@pytest.mark.timeout(240)
def test_base_bf16_adapters_float32(bf16_run):
    r = bf16_run
    assert r["sharded"]  # one rank is still wrapped for the mixed-precision policy
    trained = r["trained"]
    assert any(".lora_A." in n for n in trained) and "model.norm.modules_to_save.default.weight" in trained
    for n, dtype in r["dtypes"].items():
        assert dtype == ("torch.float32" if n in trained else "torch.bfloat16"), (n, dtype)
    assert not r["base_mismatch"]  # the meta model holds rank 0's bfloat16 load
    assert r["optimizer"] == ["torch.float32"] and r["optimizer_n"] == len(trained)
    assert r["adam_state"] == ["torch.float32"]
    # FSDP2's _init_mp_dtypes: one original dtype among the trainable parameters of a group (float32), the
    # frozen bfloat16 base beside them; bfloat16 compute, float32 gradient reduction
    assert r["groups_before"] and r["groups_before"] == [{**g, "orig": "None", "reduce": "None"}
                                                         for g in r["groups_after"]]
    for g in r["groups_after"]:
        assert g["trainable"] == {"torch.float32"} and g["frozen"] == {"torch.bfloat16"}, g
        assert g["policy"] == ("torch.bfloat16", "torch.float32")
        assert (g["orig"], g["reduce"]) == ("torch.float32", "torch.float32")


def test_step_moves_only_the_adapters(bf16_run):
    r = bf16_run
    assert r["step"]["grad_norm"] > 0 and np.isfinite(r["step"]["loss"])
    assert r["changed"] and set(r["changed"]) <= set(r["trained"])
    assert any(".lora_B." in n for n in r["changed"])
    assert np.abs(r["logp_after"] - r["logp_before"]).max() > 1e-3
    # the reference is the bfloat16 base with the adapters off: what the policy computed while B was 0
    np.testing.assert_array_equal(r["ref_before"], r["logp_before"])
    np.testing.assert_array_equal(r["ref_after"], r["ref_before"])


def test_exports_read_float32(bf16_run):
    r = bf16_run
    names, expected = r["merged_names"]
    assert names == expected and all("lora" not in n and "base_layer" not in n for n in names)
    assert r["merged_dtypes"] == ["torch.float32"]
    assert r["merged_max_diff"] == 0.0  # Merged.iterate: float32(W) + (B @ A) x alpha / r
    assert r["merged_delta"] > 0  # the update is not rounded away into the bfloat16 base
    assert r["push_specs"] == ["float32"] and r["push_dtypes"] == ["torch.float32"]
    assert not r["push_mismatch"]  # the adapters as trained, not via bfloat16
    assert r["hf_config_dtype"] == "float32" and not r["hf_mismatch"] and not r["hf_missing"]


def test_checkpoint_round_trip_restores_the_adapters(bf16_run):
    r = bf16_run
    assert sorted(r["ckpt_tensors"]) == r["trained"]
    assert {t["dtype"] for t in r["ckpt_tensors"].values()} == {"float32"}
    assert r["resumed_differs_before_load"]
    assert not r["restored_mismatch"]  # the adapters restored, the bfloat16 base loaded again alike
    np.testing.assert_array_equal(r["resumed_logp"], r["logp_after"])
