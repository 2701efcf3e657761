"""MegatronTrainer on one CUDA device (``gpu`` marker; skipped without CUDA): parity with the
FSDP2 trainer at TP=1, packed (TransformerEngine ``thd``) against padded passes, and the step
count of the fused Adam that megatron-core builds with TransformerEngine or Apex."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_fsdp_trainer import add_logprobs, hf_logprobs, make_batch, run_ranks, trainer_spec
from test_megatron_trainer import LR, TEMPERATURE, megatron_spec
from tiny_model import make_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _has_transformer_engine() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


def _fused_adam() -> bool:
    """megatron-core builds TE's or Apex's FusedAdam (not torch's AdamW)."""
    try:
        import megatron.core.optimizer as mopt
    except ImportError:
        return False
    return not mopt.USING_PYTORCH_OPTIMIZER


def _pass(trainer, batch, full_grads=True) -> dict:
    logp, ent = trainer.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
    metrics = trainer.compute_grads(batch, TEMPERATURE)
    grads = trainer.full_grads() if full_grads else None
    trainer.zero_grad()
    step = trainer.train(batch, TEMPERATURE)
    weights = {k: v for b in trainer.export_weights(bucket_mb=64) for k, v in b}
    return {"logp": logp, "entropy": ent, "metrics": metrics, "grads": grads, "step": step,
            "weights": weights}


def job_parity(rank, world, path, batch):
    """float32: the FSDP2 trainer and Megatron TP=1 (the TE spec when TE imports)."""
    from chatlearn.models.trainer.fsdp import FSDPTrainer
    from chatlearn.models.trainer.megatron import MegatronTrainer

    fsdp = _pass(FSDPTrainer(trainer_spec(path, lr=LR)), batch)
    megatron = MegatronTrainer(megatron_spec(path))
    return {"fsdp": fsdp, "megatron": _pass(megatron, batch),
            "transformer_engine": megatron.transformer_engine}


@pytest.mark.timeout(600)
def test_megatron_tp1_matches_fsdp_on_cuda(tmp_path):
    """float32 on one GPU: log-probs, entropy, loss, gradients and one Adam step agree with
    the FSDP2 trainer (different kernels: a looser tolerance than on the CPU)."""
    path = make_tiny_model(str(tmp_path / "tiny"), seed=0)
    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(path).vocab_size)
    logp, _ = hf_logprobs(path, batch)
    out = run_ranks(job_parity, 1, tmp_path, path, add_logprobs(batch, logp), timeout=540)[0]
    assert out["transformer_engine"] == _has_transformer_engine()
    fsdp, mg = out["fsdp"], out["megatron"]
    np.testing.assert_allclose(mg["logp"], fsdp["logp"], rtol=0, atol=1e-4)
    np.testing.assert_allclose(mg["entropy"], fsdp["entropy"], rtol=0, atol=1e-4)
    for key in ("loss", "policy_loss", "kl", "entropy"):
        assert mg["metrics"][key] == pytest.approx(fsdp["metrics"][key], abs=1e-4), key
    assert mg["step"]["grad_norm"] == pytest.approx(fsdp["step"]["grad_norm"], rel=1e-3)
    assert mg["grads"].keys() == fsdp["grads"].keys()
    for key, g in fsdp["grads"].items():
        torch.testing.assert_close(mg["grads"][key], g, rtol=0, atol=1e-4, msg=key)
    for key, w in fsdp["weights"].items():
        np.testing.assert_allclose(mg["weights"][key], w, rtol=0, atol=1e-4, err_msg=key)


def job_packed(rank, world, path, batch):
    """bf16 (TE's fused / flash attention): padded and packed (thd) passes."""
    from chatlearn.models.trainer.megatron import MegatronTrainer

    out = {}
    for mode in ("padded", "packed"):
        trainer = MegatronTrainer(megatron_spec(path, bf16=True, packing=mode == "packed",
                                                max_token_in_packing=16))
        micro, _ = trainer._micro_batches(batch, trainer.spec.train_micro_batch_size)
        out[mode] = {"thd": [m.packed is not None for m in micro],
                     **_pass(trainer, batch, full_grads=False)}
    return out


@pytest.mark.timeout(600)
@pytest.mark.skipif(not _has_transformer_engine(), reason="needs transformer_engine")
def test_megatron_packed_thd_matches_padded_on_cuda(tmp_path):
    """Packed rows through TE's attention with thd PackedSeqParams give the padded pass's
    log-probs and loss (bf16: a bf16-sized tolerance)."""
    path = make_tiny_model(str(tmp_path / "tiny"), seed=0)
    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(path).vocab_size)
    logp, _ = hf_logprobs(path, batch)
    out = run_ranks(job_packed, 1, tmp_path, path, add_logprobs(batch, logp), timeout=540)[0]
    packed, padded = out["packed"], out["padded"]
    assert all(packed["thd"]) and not any(padded["thd"])
    np.testing.assert_allclose(packed["logp"], padded["logp"], rtol=0, atol=5e-2)
    assert np.abs(packed["logp"] - padded["logp"]).mean() < 1e-2
    np.testing.assert_allclose(packed["logp"], logp, rtol=0, atol=1e-1)  # vs float32 HF
    for key in ("loss", "policy_loss", "kl"):
        assert packed["metrics"][key] == pytest.approx(padded["metrics"][key], abs=2e-2), key


def job_fused_adam(rank, world, path, batch, out):
    """Megatron's own (fused) Adam: warmup learning rates, step count, checkpoint resume."""
    from chatlearn.models.trainer.megatron import MegatronTrainer

    cfg = megatron_spec(path, lr_warmup_iters=4, lr_warmup_init=0.0)
    trainer = MegatronTrainer(cfg)
    res = {"classes": sorted({type(o.optimizer).__module__ for o in trainer._optimizers()}),
           "lrs": [trainer.train(batch)["lr"] for _ in range(2)]}
    trainer.save_checkpoint(os.path.join(out, "checkpoint"))
    res["expected"] = trainer.train(batch)
    resumed = MegatronTrainer(cfg)
    resumed.load_checkpoint(os.path.join(out, "checkpoint"))
    res["resumed_steps"] = resumed._optimizer_steps()
    res["got"] = resumed.train(batch)
    return res


@pytest.mark.timeout(600)
@pytest.mark.skipif(not _fused_adam(), reason="needs transformer_engine or apex (FusedAdam)")
def test_real_fused_adam_step_drives_the_schedule_and_resumes(tmp_path):
    path = make_tiny_model(str(tmp_path / "tiny"), seed=0)
    from transformers import AutoConfig

    batch = make_batch(AutoConfig.from_pretrained(path).vocab_size)
    logp, _ = hf_logprobs(path, batch)
    res = run_ranks(job_fused_adam, 1, tmp_path, path, add_logprobs(batch, logp), str(tmp_path),
                    timeout=540)[0]
    assert all(m.startswith(("transformer_engine", "apex")) for m in res["classes"])
    assert res["lrs"] == [0.0, LR / 4]
    assert res["resumed_steps"] == 2 and res["got"]["lr"] == res["expected"]["lr"] == LR / 2
    for key in ("loss", "grad_norm"):  # GPU kernels need not be bitwise deterministic
        assert res["got"][key] == pytest.approx(res["expected"][key], rel=1e-4), key


@pytest.mark.skipif(not _fused_adam(), reason="needs transformer_engine or apex (FusedAdam)")
def test_real_fused_adam_keeps_its_step_per_group():
    """The helpers read and restore the real FusedAdam's layout."""
    import megatron.core.optimizer as mopt

    from chatlearn.models.trainer.megatron.optimizer_state import (
        group_steps,
        restore_group_steps,
        step_count,
    )

    p = torch.nn.Parameter(torch.ones(8, device="cuda"))
    opt = mopt.Adam([p], lr=0.1, adam_w_mode=True)
    for _ in range(2):
        p.grad = torch.ones_like(p)
        opt.step()
    assert "step" not in opt.state[p] and step_count(opt) == 2
    fresh = mopt.Adam([p], lr=0.1, adam_w_mode=True)
    restore_group_steps(fresh, group_steps(opt))
    assert step_count(fresh) == 2
