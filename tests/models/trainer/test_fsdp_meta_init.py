"""FSDPTrainer with ``meta_init``: built on the meta device, sharded, filled from rank 0.

2 gloo ranks on CPU: the same log-probs, entropy, loss and weights after one step as the
ordinary build (every rank loads the checkpoint), tied embeddings kept tied, rotary buffers
restored, and rank 1 never reads a weight file (it is given a folder without any, and
``from_pretrained`` raises there). A ``gpu`` variant runs one rank on CUDA.
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from test_fsdp_trainer import (TEMPERATURE, add_logprobs, hf_logprobs, make_batch, make_tiny_model,
                               run_ranks, trainer_spec)


def _forbid_weight_reads(monkeypatch_targets: list) -> None:
    """Make every transformers/safetensors weight loader raise in this process."""
    import safetensors
    import safetensors.torch
    import transformers
    import transformers.modeling_utils as mu

    def refuse(*args, **kwargs):
        raise AssertionError("this rank read a weight file")

    for owner, name in [(safetensors, "safe_open"), (safetensors.torch, "load_file"),
                        (mu, "safe_open"), (mu, "load_state_dict")]:
        if hasattr(owner, name):
            setattr(owner, name, refuse)
    for cls in (transformers.AutoModelForCausalLM, transformers.PreTrainedModel):
        cls.from_pretrained = classmethod(lambda cls_, *a, **k: refuse())
    monkeypatch_targets.append("patched")


def _run(trainer, batch) -> dict:
    logp, ent = trainer.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
    step = trainer.train(batch, temperature=TEMPERATURE)
    names = [spec[0] for spec in trainer.weight_specs()]
    weights = {n: t for n, t in trainer.export_tensors(names)}
    model = trainer.model
    return {"logp": logp, "entropy": ent, "step": step,
            "weights": weights if trainer.rank == 0 else None,
            "tied": model.lm_head.weight is model.get_input_embeddings().weight,
            "inv_freq": model.model.rotary_emb.inv_freq.detach().cpu().clone(),
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def job_meta_init(rank, world, path, stripped, batch):
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    res = {"plain": _run(FSDPTrainer(trainer_spec(path, logprob_chunk_tokens=7)), batch)}
    patched = []
    if rank != 0:
        _forbid_weight_reads(patched)
    load = path if rank == 0 else stripped
    meta = FSDPTrainer(trainer_spec(load, meta_init=True, logprob_chunk_tokens=7))
    res["generation_eos"] = meta.model.generation_config.eos_token_id
    res["meta"] = _run(meta, batch)
    ref = FSDPTrainer(trainer_spec(load, meta_init=True, trainable=False))
    res["ref_logp"] = ref.compute_logprobs(batch, temperature=TEMPERATURE)
    res["ref_frozen"] = not any(p.requires_grad for p in ref.model.parameters())
    res["patched"] = bool(patched)
    return res


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoConfig

    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    stripped = tmp_path_factory.mktemp("no_weights")
    for name in os.listdir(path):  # config, generation config, tokenizer: no weights
        if not name.endswith((".safetensors", ".bin", ".json.index")) and "safetensors" not in name:
            shutil.copy2(os.path.join(path, name), stripped / name)
    assert not any("safetensors" in n for n in os.listdir(stripped))
    vocab = AutoConfig.from_pretrained(path).vocab_size
    batch = make_batch(vocab)
    logp, _ = hf_logprobs(path, batch)
    return path, str(stripped), add_logprobs(batch, logp)


@pytest.mark.timeout(240)
def test_meta_init_matches_the_ordinary_build_on_two_ranks(model, tmp_path):
    path, stripped, batch = model
    results = run_ranks(job_meta_init, 2, tmp_path, path, stripped, batch)
    hf_logp, hf_ent = hf_logprobs(path, batch, TEMPERATURE)
    from transformers import GenerationConfig

    assert results[1]["patched"] and not results[0]["patched"]
    eos = GenerationConfig.from_pretrained(path).eos_token_id
    for res in results:
        assert res["generation_eos"] == eos  # the checkpoint's generation config (save_hf writes it)
        assert res["ref_frozen"]
        np.testing.assert_allclose(res["ref_logp"], res["plain"]["logp"], rtol=0, atol=1e-6)
        plain, meta = res["plain"], res["meta"]
        assert meta["tied"] and plain["tied"]
        assert meta["dtypes"] == ["torch.float32"]
        torch.testing.assert_close(meta["inv_freq"], plain["inv_freq"], rtol=0, atol=0)
        np.testing.assert_allclose(meta["logp"], plain["logp"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(meta["entropy"], plain["entropy"], rtol=0, atol=1e-6)
        np.testing.assert_allclose(meta["logp"], hf_logp, rtol=0, atol=1e-5)
        np.testing.assert_allclose(meta["entropy"], hf_ent, rtol=0, atol=1e-5)
        for key in ("loss", "grad_norm", "kl", "entropy"):
            assert meta["step"][key] == pytest.approx(plain["step"][key], abs=1e-6), key
    plain_w, meta_w = results[0]["plain"]["weights"], results[0]["meta"]["weights"]
    assert plain_w.keys() == meta_w.keys() and "lm_head.weight" not in meta_w
    for name, w in plain_w.items():
        torch.testing.assert_close(meta_w[name], w, rtol=0, atol=1e-6, msg=name)


def job_cuda_meta_init(rank, world, path, batch):
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    out = {}
    for meta in (False, True):
        trainer = FSDPTrainer(trainer_spec(path, meta_init=meta, bf16=True))
        logp = trainer.compute_logprobs(batch, temperature=TEMPERATURE)
        ref = FSDPTrainer(trainer_spec(path, meta_init=meta, bf16=True, trainable=False))
        out[meta] = {"logp": logp, "ref_logp": ref.compute_logprobs(batch, temperature=TEMPERATURE),
                     "dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
                     "ref_dtypes": sorted({str(p.dtype) for p in ref.model.parameters()}),
                     "device": str(next(trainer.model.parameters()).device)}
        del trainer, ref
    return out


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_meta_init_on_cuda(model, tmp_path):
    """World 1 on CUDA with bf16: fp32 master weights for the policy, bf16 weights for the
    frozen reference; meta_init gives the same log-probs as the ordinary build (both compute
    in bf16 from the same weights, so they agree bit for bit up to kernel choice: 1e-6)."""
    path, _, batch = model
    out = run_ranks(job_cuda_meta_init, 1, tmp_path, path, batch, timeout=540)[0]
    assert out[True]["device"].startswith("cuda")
    assert out[True]["dtypes"] == ["torch.float32"] and out[True]["ref_dtypes"] == ["torch.bfloat16"]
    np.testing.assert_allclose(out[True]["logp"], out[False]["logp"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(out[True]["ref_logp"], out[False]["ref_logp"], rtol=0, atol=1e-6)
    # the bf16 reference computes what the bf16-mixed-precision policy computes
    np.testing.assert_allclose(out[True]["ref_logp"], out[True]["logp"], rtol=0, atol=1e-6)
