"""Supervised fine-tuning through the FSDP2 trainer (``Trainer.train_sft``, :class:`chatlearn.algorithms.sft.SFTLoss`)
against a plain reference: one transformers forward per conversation, cross-entropy on its assistant tokens (the
``loss_mask``: two assistant turns with a user turn between), summed and divided by the assistant tokens of the
whole global batch. Two ranks, micro-batches of 2 (gradient accumulation), with and without packing: the same loss
and the same gradients."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_fsdp_trainer import make_tiny_model, run_ranks, trainer_spec  # noqa: E402


def sft_batch(vocab: int, n: int = 8, seed: int = 0) -> dict:
    """Conversations of 6..17 tokens: a prompt, then two assistant turns with a user turn between (mask 1, 0, 1)."""
    rng = np.random.default_rng(seed)
    tokens, masks, plens = [], [], []
    for _ in range(n):
        parts = rng.integers(1, 5, 4)  # prompt, turn 1, user turn, turn 2
        parts[0] += 1
        ids = rng.integers(0, vocab, int(parts.sum()))
        mask = np.concatenate([np.zeros(parts[0]), np.ones(parts[1]), np.zeros(parts[2]), np.ones(parts[3])])
        tokens.append(ids)
        masks.append(mask.astype(np.int32))
        plens.append(int(parts[0]))
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum([len(t) for t in tokens], out=offsets[1:])
    return {"tokens": np.concatenate(tokens).astype(np.int64), "offsets": offsets,
            "prompt_lens": np.asarray(plens, np.int64), "loss_mask": np.concatenate(masks)}


def reference(path: str, batch: dict) -> tuple[float, dict]:
    """The token-mean cross-entropy over every assistant token of the batch, and its gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    off = batch["offsets"]
    total = int(batch["loss_mask"].sum())
    loss = 0.0
    for i in range(len(off) - 1):
        ids = torch.from_numpy(batch["tokens"][off[i]:off[i + 1]])
        mask = torch.from_numpy(batch["loss_mask"][off[i]:off[i + 1]]).bool()
        logits = model(input_ids=ids[None]).logits[0]
        targets = ids[1:].clone()
        targets[~mask[1:]] = -100  # ignored: not an assistant token
        loss = loss + torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="sum", ignore_index=-100)
    loss = loss / total
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def job(rank, world, path, batch):
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    res = {}
    for packing in (False, True):
        trainer = FSDPTrainer(trainer_spec(path, packing=packing, max_token_in_packing=24, train_micro_batch_size=2,
                                           kl_coef=0.0, entropy_coef=0.0))
        trainer._sft_step = True  # what train_sft sets around its step
        res[packing] = {"metrics": trainer.compute_grads(batch), "grads": trainer.full_grads()}
        trainer._sft_step = False
        trainer.zero_grad()
        res[packing]["step"] = trainer.train_sft(batch)
    return res


@pytest.mark.timeout(240)
def test_sft_loss_and_gradients_match_plain_cross_entropy(tmp_path):
    from transformers import AutoConfig

    path = make_tiny_model(str(tmp_path / "tiny"))
    batch = sft_batch(AutoConfig.from_pretrained(path).vocab_size)
    ref_loss, ref_grads = reference(path, batch)
    results = run_ranks(job, 2, tmp_path, path, batch)
    for packing in (False, True):
        got = results[0][packing]
        assert got["metrics"]["num_tokens"] == batch["loss_mask"].sum()
        assert got["metrics"]["loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert results[1][packing]["metrics"]["loss"] == pytest.approx(ref_loss, rel=1e-5)  # all-reduced alike
        assert set(got["grads"]) == set(ref_grads)
        for name, g in ref_grads.items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)
        step = got["step"]
        assert step["loss"] == pytest.approx(ref_loss, rel=1e-5) and step["skipped_steps"] == 0.0
        assert step["grad_norm"] > 0


def test_sft_loss_terms_are_the_token_mean_over_the_global_batch():
    from chatlearn.algorithms.sft import SFTLoss, sft_nll

    batch = sft_batch(50, n=4, seed=1)
    loss = SFTLoss(None, batch, torch.device("cpu"))
    total = int(batch["loss_mask"].sum())
    assert loss.num_tokens == total
    logp = -torch.rand(5, dtype=torch.float64).float()
    terms, coef, weight = loss.terms(logp, None, np.arange(5))
    torch.testing.assert_close(terms["loss"], -logp)
    assert torch.allclose(coef, torch.full((5,), 1.0 / total))
    sums = loss.token_sums(terms, coef, weight)
    assert loss.metrics(sums.tolist())["loss"] == pytest.approx(float(-logp.double().sum()) / total)
    # the eval loss over per-token log-probs of the whole batch: only the assistant tokens count
    full = np.random.default_rng(2).uniform(-3, 0, len(batch["tokens"])).astype(np.float32)
    nll, count = sft_nll(full, batch)
    assert count == total
    assert nll == pytest.approx(-float(full[batch["loss_mask"].astype(bool)].astype(np.float64).sum()), rel=1e-9)
    with pytest.raises(ValueError, match="loss_mask"):
        SFTLoss(None, {k: v for k, v in batch.items() if k != "loss_mask"}, torch.device("cpu"))


def job_megatron(rank, world, path, batch):
    """The Megatron trainer (TP = 1 under the CPU device shim): the same SFT loss through its loss hook. The
    batch holds the pad token (id 0 of the tiny model) as a real token: the Hugging Face embedding gives that
    row no gradient from the input side (``padding_idx``), and the Megatron model must do the same."""
    from megatron_shim import cpu_device_shim
    from test_megatron_trainer import megatron_spec

    from chatlearn.models.trainer.fsdp import FSDPTrainer

    fsdp = FSDPTrainer(trainer_spec(path, train_micro_batch_size=2, kl_coef=0.0, entropy_coef=0.0)).train_sft(batch)
    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        trainer = MegatronTrainer(megatron_spec(path, tp=1, train_micro_batch_size=2, kl_coef=0.0, entropy_coef=0.0))
        trainer._sft_step = True
        metrics = trainer.compute_grads(batch)
        trainer._sft_step = False
        trainer.zero_grad()
        return {"metrics": metrics, "step": trainer.train_sft(batch), "fsdp": fsdp}


@pytest.mark.timeout(300)
def test_sft_through_the_megatron_trainer_gives_the_same_loss_and_gradient_norm(tmp_path):
    from transformers import AutoConfig

    from chatlearn.config import load as config_load

    if not config_load._importable("megatron.core"):
        pytest.skip("megatron-core is not installed")
    path = make_tiny_model(str(tmp_path / "tiny"))
    batch = sft_batch(AutoConfig.from_pretrained(path).vocab_size)
    assert AutoConfig.from_pretrained(path).pad_token_id == 0 and (batch["tokens"] == 0).any()
    ref_loss, ref_grads = reference(path, batch)
    ref_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads.values())))
    got = run_ranks(job_megatron, 1, tmp_path, path, batch)[0]
    assert got["metrics"]["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert got["step"]["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert got["fsdp"]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)  # before clipping
    assert got["step"]["grad_norm"] == pytest.approx(got["fsdp"]["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_megatron_embedding_gives_the_padding_row_no_input_gradient(sequence_parallel):
    """The hook on megatron-core's word embeddings (``_no_gradient_at_padding_idx``) against
    ``nn.Embedding(padding_idx=...)``, in both output layouts: ``[b, s, h]``, and under sequence parallelism
    this rank's ``[s / tp, b, h]`` slice (rank 1 of 2 here)."""
    from chatlearn.models.trainer.megatron import model as megatron_model

    torch.manual_seed(0)
    ids = torch.tensor([[3, 0, 5, 0, 1, 2], [0, 4, 4, 1, 0, 3]])
    weight = torch.randn(6, 4)
    ref = torch.nn.Embedding(6, 4, padding_idx=0)
    ref.weight.data.copy_(weight)
    ref(ids).pow(2).sum().backward()

    class Rank1:  # what the hook reads of VocabParallelEmbedding
        reduce_scatter_embeddings = sequence_parallel
        tp_group = type("Group", (), {"rank": staticmethod(lambda: 1)})()

    w = weight.clone().requires_grad_(True)
    out = torch.nn.functional.embedding(ids, w)
    if sequence_parallel:  # this rank's half of the sequence, [s/2, b, h]
        out = out.transpose(0, 1)[3:]
    megatron_model._no_gradient_at_padding_idx(0)(Rank1(), (ids,), out).pow(2).sum().backward()
    if sequence_parallel:  # the reference restricted to the same half
        ref.weight.grad = None
        ref(ids[:, 3:]).pow(2).sum().backward()
    torch.testing.assert_close(w.grad, ref.weight.grad)
    assert w.grad[0].abs().sum() == 0 and w.grad[3].abs().sum() > 0
