"""FSDPTrainer on one CUDA device (``gpu`` marker; skipped without CUDA): chunked log-probs
equal the full-logits ones, and offload gives the memory back to the device."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_fsdp_trainer import TEMPERATURE, add_logprobs, hf_logprobs, make_batch, run_ranks, trainer_spec
from tiny_model import make_tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB = 131072  # 64 MiB of float32 tied embeddings: large next to everything else


def _full_logprobs(trainer, batch, temperature):
    """Reference: the model's own [1, L, V] logits per sample, float32, log_softmax."""
    off, plen = batch["offsets"], batch["prompt_lens"]
    logp = np.zeros(len(batch["tokens"]), np.float32)
    with torch.no_grad():
        for i in range(len(plen)):
            ids = torch.from_numpy(batch["tokens"][off[i]:off[i + 1]].copy()).to(trainer.device)
            z = trainer.model(input_ids=ids[None], use_cache=False).logits[0].float() / temperature
            lsm = torch.log_softmax(z, -1)
            p = torch.arange(int(plen[i]), len(ids), device=trainer.device)
            logp[off[i] + int(plen[i]):off[i + 1]] = lsm[p - 1, ids[p]].cpu().numpy()
    trainer._reshard()
    return logp


def job_chunks(rank, world, path, batch):
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    out = {}
    for bf16 in (False, True):
        chunked = FSDPTrainer(trainer_spec(path, bf16=bf16, logprob_chunk_tokens=5))
        out[bf16] = {"chunked": chunked.compute_logprobs(batch, temperature=TEMPERATURE),
                     "full": _full_logprobs(chunked, batch, TEMPERATURE),
                     "loss": chunked.train(batch, temperature=TEMPERATURE)["loss"]}
        torch.cuda.synchronize()
        out[bf16]["peak"] = torch.cuda.max_memory_allocated()
        del chunked
    return out


@pytest.mark.timeout(600)
def test_chunked_logprobs_on_cuda_equal_the_full_logits(tmp_path):
    """float32: 1e-5 (no TF32 in matmuls by default). bf16 (mixed precision, bf16 logits):
    the chunked and the full matmul may round a logit differently by one bf16 ulp
    (2^-8 relative, logits O(1)), so log-probs agree within 2e-2."""
    path = make_tiny_model(str(tmp_path / "wide"), seed=0, vocab_size=VOCAB)
    batch = make_batch(VOCAB)
    logp, _ = hf_logprobs(path, batch)
    batch = add_logprobs(batch, logp)
    out = run_ranks(job_chunks, 1, tmp_path, path, batch, timeout=540)[0]
    np.testing.assert_allclose(out[False]["chunked"], out[False]["full"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(out[True]["chunked"], out[True]["full"], rtol=0, atol=2e-2)
    assert np.isfinite(out[False]["loss"]) and np.isfinite(out[True]["loss"])


def job_offload(rank, world, path, batch):
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    trainer = FSDPTrainer(trainer_spec(path))
    trainer.train(batch, temperature=TEMPERATURE)  # Adam states exist
    probe = torch.from_numpy(batch["tokens"][:9].copy())[None].to(trainer.device)
    with torch.no_grad():
        logits = trainer.model(input_ids=probe, use_cache=False).logits.float().cpu()
    trainer._reshard()
    res = {"base": base, "loaded": torch.cuda.memory_reserved()}
    trainer.offload(["weights", "optimizer", "grads"])
    res["offloaded"] = torch.cuda.memory_reserved()
    res["allocated"] = torch.cuda.memory_allocated()
    trainer.onload(["weights", "optimizer", "grads"])
    with torch.no_grad():
        res["same"] = torch.equal(trainer.model(input_ids=probe, use_cache=False).logits.float().cpu(),
                                  logits)
    trainer._reshard()
    return res


@pytest.mark.timeout(600)
def test_fsdp_offload_returns_cuda_memory(tmp_path):
    """Weights, gradients and Adam states of 64 MiB of weights (>= 192 MiB in all): after
    offload ``memory_reserved`` is within 16 MiB of what it was before the trainer was built
    (rotary buffers, FSDP's small bookkeeping tensors, allocator rounding)."""
    path = make_tiny_model(str(tmp_path / "wide"), seed=0, vocab_size=VOCAB)
    batch = make_batch(VOCAB)
    logp, _ = hf_logprobs(path, batch)
    batch = add_logprobs(batch, logp)
    res = run_ranks(job_offload, 1, tmp_path, path, batch, timeout=540)[0]
    assert res["loaded"] - res["base"] >= 192 * 2**20
    assert res["offloaded"] <= res["base"] + 16 * 2**20
    assert res["same"]
