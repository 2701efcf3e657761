"""The FSDP trainer never makes a ``[tokens, vocab]`` tensor: log-probs and entropy are
computed ``logprob_chunk_tokens`` rows at a time from the hidden states, in the log-prob
pass and in training (forward and backward). Every op of a 1-rank trainer is watched with a
``TorchDispatchMode``; the model's own ``[B, L, V]`` logits would show up as B x L rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_fsdp_trainer import TEMPERATURE, add_logprobs, hf_logprobs, make_batch, make_tiny_model, run_ranks, trainer_spec

CHUNK = 4


def job_watch(rank, world, path, batch):
    from test_chunked_logprobs import LargestVocabTensor

    from chatlearn.models.trainer.fsdp import FSDPTrainer

    trainer = FSDPTrainer(trainer_spec(path, logprob_chunk_tokens=CHUNK, gradient_checkpointing=True))
    vocab, hidden = trainer.model.config.vocab_size, trainer.model.config.hidden_size
    out = {}
    with LargestVocabTensor(vocab, hidden) as seen:
        out["logp"], _ = trainer.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
    out["logprob_rows"] = seen.rows
    with LargestVocabTensor(vocab, hidden) as seen:
        out["step"] = trainer.train(batch, temperature=TEMPERATURE)
    out["train_rows"] = seen.rows
    ids = torch.from_numpy(batch["tokens"][:12].copy())[None]
    with LargestVocabTensor(vocab, hidden) as seen, torch.no_grad():
        trainer.model(input_ids=ids, use_cache=False)
    out["plain_forward_rows"] = seen.rows
    trainer._reshard()
    return out


@pytest.mark.timeout(240)
def test_no_tensor_holds_more_than_one_chunk_of_vocab_rows(tmp_path):

    from transformers import AutoConfig

    path = make_tiny_model(str(tmp_path / "tiny"))
    batch = make_batch(AutoConfig.from_pretrained(path).vocab_size)
    logp, _ = hf_logprobs(path, batch)
    batch = add_logprobs(batch, logp)
    out = run_ranks(job_watch, 1, tmp_path, path, batch)[0]
    # train_micro_batch_size 2, logprob_micro_batch_size 3: each micro-batch has more than
    # CHUNK response tokens, and the padded [rows, len] logits would be far more
    assert out["plain_forward_rows"] == 12  # the probe sees a model's logits when they exist
    assert 0 < out["logprob_rows"] <= CHUNK and 0 < out["train_rows"] <= CHUNK
    assert np.isfinite(out["step"]["loss"])
