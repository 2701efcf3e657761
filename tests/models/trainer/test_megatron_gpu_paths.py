"""The Megatron trainer's GPU code paths, proven on the CPU: the step count of a fused Adam
(kept per parameter group), the TransformerEngine layer spec and its ``thd`` packing, chunked
vocabulary-parallel log-probs, weight export that stays on the device, and the
``CUDA_DEVICE_MAX_CONNECTIONS`` check.

Rank jobs run under the test-only CPU device shim (``megatron_shim``), as in
``test_megatron_trainer``.
"""
from __future__ import annotations

import inspect
import os
import sys
import types
from unittest import mock

import numpy as np
import pytest
import torch
from test_fsdp_trainer import add_logprobs, hf_logprobs, make_batch, make_tiny_model, run_ranks
from test_megatron_trainer import megatron_spec, needs_megatron
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

LR = 1e-4
WARMUP = dict(lr_warmup_iters=4, lr_warmup_init=0.0)  # lr of step s: LR * s / 4


# --------------------------------------------------------------------------- a fused Adam

class FakeTEFusedAdam(torch.optim.Optimizer):
    """Shaped like TransformerEngine's ``transformer_engine.pytorch.optimizers.FusedAdam``
    (``fused_adam.py``, TE 2.x), for the CPU: the same constructor signature; ``step()`` keeps
    ONE step count per parameter group, ``group["step"]`` (a Python int, advanced for empty
    groups too), and per-parameter state ``exp_avg`` / ``exp_avg_sq`` only; the update is its
    ``multi_tensor_adam`` kernel's (``adam_w_mode=1``: decoupled weight decay, bias
    correction). Only the configuration megatron-core builds here is supported."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, bias_correction=True, adam_w_mode=True, capturable=False,
                 master_weights=False, master_weight_dtype=torch.float32,
                 exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
                 use_decoupled_grad=False, store_param_remainders=False, set_grad_none=None):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        if capturable or master_weights or use_decoupled_grad or store_param_remainders or \
                exp_avg_dtype != torch.float32 or exp_avg_sq_dtype != torch.float32:
            raise NotImplementedError("this fake covers fp32 states, no master weights")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas,
                                      eps=eps, weight_decay=weight_decay))
        self.adam_w_mode = 1 if adam_w_mode else 0

    def zero_grad(self, set_to_none=None):
        super().zero_grad(set_to_none=True if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            group["step"] = group["step"] + 1 if "step" in group else 1
            step = group["step"]
            beta1, beta2 = group["betas"]
            bc1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
            bc2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                if p.grad is None:
                    continue
                g, m, v = p.grad, state["exp_avg"], state["exp_avg_sq"]
                if not self.adam_w_mode:
                    g = g + group["weight_decay"] * p
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / bc1) / ((v / bc2).sqrt() + group["eps"])
                if self.adam_w_mode:
                    update = update + group["weight_decay"] * p
                p.sub_(group["lr"] * update)
        return loss


class HostCopies(TorchFunctionMode):
    """Records every torch call that moves a tensor to a device (``Tensor.to`` with a device,
    ``Tensor.cpu``, ``Tensor.pin_memory``, ``Tensor.numpy``)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        moves = func in (torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.pin_memory) or (
            func is torch.Tensor.to and ("device" in kwargs or any(
                isinstance(a, (str, torch.device, int)) and not isinstance(a, bool)
                for a in args[1:])))
        if moves:
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


def _exported(trainer) -> dict:
    return {k: v for b in trainer.export_weights(bucket_mb=1) for k, v in b}


def job_fused_adam(rank, world, setup, out):
    """A trainer whose megatron-core optimizer is the fused Adam fake: learning rates of
    three steps, where the step is kept, checkpoint resume."""
    import megatron.core.optimizer as mopt
    from megatron_shim import cpu_device_shim

    path, batch = setup["path"], setup["batch"]
    res = {}
    with cpu_device_shim(), mock.patch.object(mopt, "Adam", FakeTEFusedAdam), \
            mock.patch.object(mopt, "USING_PYTORCH_OPTIMIZER", False):
        from chatlearn.models.trainer.megatron import MegatronTrainer

        cfg = megatron_spec(path, **WARMUP)
        trainer = MegatronTrainer(cfg)
        inner = [o.optimizer for o in trainer._optimizers()]
        res["classes"] = sorted({type(o).__name__ for o in inner})
        res["lrs"] = [trainer.train(batch)["lr"] for _ in range(2)]
        res["group_steps"] = [g["step"] for o in inner for g in o.param_groups]
        res["state_keys"] = sorted({k for o in inner for st in o.state.values() for k in st})
        res["steps_taken"] = trainer._optimizer_steps()
        ckpt = os.path.join(out, "checkpoint")
        trainer.save_checkpoint(ckpt)
        res["expected"] = trainer.train(batch)
        expected_weights = _exported(trainer)
        resumed = MegatronTrainer(cfg)
        resumed.load_checkpoint(ckpt)
        res["resumed_steps"] = resumed._optimizer_steps()
        res["got"] = resumed.train(batch)
        got_weights = _exported(resumed)
        res["weights_equal"] = got_weights.keys() == expected_weights.keys() and all(
            np.array_equal(got_weights[k], w) for k, w in expected_weights.items())
    return res


def job_export(rank, world, setup, out):
    """What export_tensors does (moves to the host, devices, aliasing)."""
    from megatron_shim import cpu_device_shim

    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        frozen = MegatronTrainer(megatron_spec(setup["path"], trainable=False))
        names = [n for n, *_ in frozen.weight_specs()]
        params = {p.untyped_storage().data_ptr() for p in frozen.gpt.parameters()}
        with HostCopies() as seen:
            exported = list(frozen.export_tensors(names))
        return {
            "moves": seen.calls, "names": [n for n, _ in exported] == names,
            "devices": sorted({str(t.device) for _, t in exported}),
            "dtypes": sorted({str(t.dtype) for _, t in exported}),
            "aliases": any(t.untyped_storage().data_ptr() in params for _, t in exported),
            "device": str(frozen.device)}


def job_packed(rank, world, setup, out):
    """Packed micro-batches of the TransformerEngine path next to the CPU path's."""
    from megatron_shim import cpu_device_shim

    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        packed = MegatronTrainer(megatron_spec(setup["path"], trainable=False, packing=True,
                                               max_token_in_packing=16))
        dense, _ = packed._micro_batches(setup["batch"], 4)
        packed.transformer_engine = True  # what the trainer picks on CUDA with TE
        thd, _ = packed._micro_batches(setup["batch"], 4)
        return [{"dense": d.mask.cpu(), "mask": t.mask, "cu": t.packed.cu_seqlens_q.cpu(),
                 "cu_kv": t.packed.cu_seqlens_kv.cpu(), "max": t.packed.max_seqlen_q,
                 "max_kv": t.packed.max_seqlen_kv, "format": t.packed.qkv_format,
                 "ids_equal": torch.equal(d.ids, t.ids)} for d, t in zip(dense, thd)]


@pytest.fixture(scope="module")
def paths_setup(tmp_path_factory):
    from transformers import AutoConfig

    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    batch = make_batch(AutoConfig.from_pretrained(path).vocab_size)
    logp, _ = hf_logprobs(path, batch)
    return {"path": path, "batch": add_logprobs(batch, logp)}


def _run_job(job, setup, tmp_path):
    return run_ranks(job, 1, tmp_path, setup, str(tmp_path), timeout=300)[0]


@needs_megatron
@pytest.mark.timeout(400)
def test_fused_adam_step_drives_the_schedule_and_survives_a_checkpoint(paths_setup, tmp_path):
    """With a fused Adam (step per parameter group, none per parameter) the warmup advances
    (lr 0, then LR/4) and a resumed trainer continues at step 2 (LR/2), bit for bit."""
    res = _run_job(job_fused_adam, paths_setup, tmp_path)
    assert res["classes"] == ["FakeTEFusedAdam"]
    assert res["state_keys"] == ["exp_avg", "exp_avg_sq"] and set(res["group_steps"]) == {2}
    assert res["lrs"] == [0.0, LR / 4]
    assert res["steps_taken"] == 2 and res["resumed_steps"] == 2
    assert res["expected"]["lr"] == LR / 2
    assert res["got"] == res["expected"] and res["weights_equal"]


@needs_megatron
@pytest.mark.timeout(400)
def test_export_stays_on_the_device_without_host_copies(paths_setup, tmp_path):
    """export_tensors hands the weight push float32 copies on the trainer's device: no
    move to the host (no pageable round trip), no views of the live parameters."""
    exp = _run_job(job_export, paths_setup, tmp_path)
    assert exp["names"] and exp["moves"] == []
    assert exp["devices"] == [exp["device"]] and exp["dtypes"] == ["torch.float32"]
    assert not exp["aliases"]


def _mask_from_cu(cu: torch.Tensor, width: int) -> torch.Tensor:
    """The dense [1, 1, width, width] mask (True = masked) that causal attention within the
    segments ``cu`` means."""
    seg = torch.bucketize(torch.arange(width), cu[1:].long(), right=True)
    q = torch.arange(width)
    return ((q[None, :] > q[:, None]) | (seg[:, None] != seg[None, :]))[None, None]


@needs_megatron
@pytest.mark.timeout(400)
def test_thd_micro_batches_match_the_dense_packing_mask(paths_setup, tmp_path):
    """On the TransformerEngine path a packed row carries thd PackedSeqParams and no mask;
    its segments mean exactly the CPU path's block-diagonal causal mask."""
    rows = _run_job(job_packed, paths_setup, tmp_path)
    assert len(rows) >= 2
    for row in rows:
        width = row["dense"].shape[-1]
        assert row["mask"] is None and row["format"] == "thd" and row["ids_equal"]
        assert torch.equal(row["cu"], row["cu_kv"]) and row["cu"].dtype == torch.int32
        assert row["cu"][0] == 0 and row["cu"][-1] == width
        assert row["max"] == row["max_kv"] == int(row["cu"].diff().max())
        assert torch.equal(_mask_from_cu(row["cu"], width), row["dense"])


# --------------------------------------------------------------------------- without ranks

@needs_megatron
def test_step_count_and_checkpoint_helpers_for_both_layouts():
    """group["step"] (fused Adam: int, or a [1] tensor when capturable) and state[p]["step"]
    (torch's Adam) are both read; group steps round-trip through their tensors."""
    from chatlearn.models.trainer.megatron.optimizer_state import (
        group_steps,
        restore_group_steps,
        step_count,
    )

    w = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))]
    torch_adam = torch.optim.AdamW([{"params": w[:1]}, {"params": w[1:]}], lr=0.1)
    fused = FakeTEFusedAdam([{"params": w[:1]}, {"params": []}], lr=0.1)
    assert step_count(torch_adam) == step_count(fused) == 0
    for _ in range(3):
        for p in w:
            p.grad = torch.ones_like(p)
        torch_adam.step()
        fused.step()
    assert step_count(torch_adam) == step_count(fused) == 3
    assert group_steps(torch_adam) == {}
    saved = group_steps(fused)
    assert set(saved) == {0, 1} and all(t.dim() == 0 for t in saved.values())
    fresh = FakeTEFusedAdam([{"params": w[:1]}, {"params": []}], lr=0.1)
    restore_group_steps(fresh, saved)
    assert [g["step"] for g in fresh.param_groups] == [3, 3]
    assert all(type(g["step"]) is int for g in fresh.param_groups)
    fused.param_groups[0]["step"] = torch.tensor([5], dtype=torch.int32)  # capturable layout
    restore_group_steps(fresh, group_steps(fused))
    assert step_count(fresh) == 5 and fresh.param_groups[0]["step"].shape == (1,)
    restore_group_steps(fresh, {})
    assert step_count(fresh) == 0


def test_cuda_device_max_connections_is_required_with_tensor_parallelism(monkeypatch):
    from chatlearn.models.trainer.megatron.trainer import check_cuda_device_max_connections

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    with pytest.raises(RuntimeError, match="CUDA_DEVICE_MAX_CONNECTIONS=1"):
        check_cuda_device_max_connections(cuda, 2)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    with pytest.raises(RuntimeError, match="CUDA_DEVICE_MAX_CONNECTIONS=1.*'8'"):
        check_cuda_device_max_connections(cuda, 2)
    check_cuda_device_max_connections(cuda, 1)  # no tensor parallelism: not needed
    check_cuda_device_max_connections(cpu, 2)  # gloo on the CPU: not needed
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    check_cuda_device_max_connections(cuda, 2)


# --------------------------------------------------------------------------- layer spec

def _fake_te_spec(num_experts=None, moe_grouped_gemm=False, qk_layernorm=False,
                  multi_latent_attention=False, fp8=None, moe_use_legacy_grouped_gemm=False,
                  qk_l2_norm=False, use_te_op_fuser=False, use_kitchen=False,
                  use_te_activation_func=False, use_kitchen_attention=False,
                  kitchen_attention_backend="sdpa"):
    """megatron-core 0.16's ``get_gpt_layer_with_transformer_engine_spec`` signature."""
    _fake_te_spec.calls.append(dict(num_experts=num_experts, qk_layernorm=qk_layernorm,
                                    multi_latent_attention=multi_latent_attention,
                                    moe_grouped_gemm=moe_grouped_gemm))
    return "te-layer-spec"


@pytest.fixture
def fake_transformer_engine(monkeypatch):
    """``import transformer_engine.pytorch`` succeeds; the spec function is the fake."""
    from megatron.core.models.gpt import gpt_layer_specs

    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    monkeypatch.setitem(sys.modules, "transformer_engine", te)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te.pytorch)
    _fake_te_spec.calls = []
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec",
                        _fake_te_spec)
    return _fake_te_spec


@needs_megatron
def test_fake_spec_function_has_the_upstream_signature():
    from megatron.core.models.gpt import gpt_layer_specs

    real = inspect.signature(gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec)
    fake = inspect.signature(_fake_te_spec)
    assert [(p.name, p.kind, p.default) for p in real.parameters.values()] == \
        [(p.name, p.kind, p.default) for p in fake.parameters.values()]


@needs_megatron
def test_transformer_engine_spec_is_chosen_on_cuda_with_te(fake_transformer_engine, monkeypatch):
    from chatlearn.models.trainer.megatron import model

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert model.uses_transformer_engine(cuda) and not model.uses_transformer_engine(cpu)
    assert model.layer_spec(True) == "te-layer-spec"
    assert fake_transformer_engine.calls == [dict(num_experts=None, qk_layernorm=False,
                                                  multi_latent_attention=False, moe_grouped_gemm=False)]
    local = model.layer_spec(False)  # the CPU twin: local spec with RMSNorm
    assert local.submodules.input_layernorm is model.RMSNorm
    monkeypatch.setitem(sys.modules, "transformer_engine", None)  # not installed
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", None)
    assert not model.uses_transformer_engine(cuda)


def test_te_parameter_names_map_to_the_local_names():
    from chatlearn.models.trainer.megatron.model import canonical_name

    assert canonical_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    for same in ("decoder.layers.0.self_attention.linear_qkv.weight",
                 "decoder.layers.0.input_layernorm.weight", "decoder.final_layernorm.weight"):
        assert canonical_name(same) == same


@needs_megatron
def test_thd_packed_seq_params_from_sample_lengths():
    from megatron.core.packed_seq_params import PackedSeqParams

    from chatlearn.models.trainer.megatron.model import thd_packed_seq_params

    got = thd_packed_seq_params(np.array([3, 5, 2]), 12, torch.device("cpu"))
    assert isinstance(got, PackedSeqParams) and got.qkv_format == "thd"
    assert got.cu_seqlens_q.tolist() == got.cu_seqlens_kv.tolist() == [0, 3, 8, 10, 12]
    assert got.cu_seqlens_q.dtype == torch.int32 and got.max_seqlen_q == got.max_seqlen_kv == 5
    exact = thd_packed_seq_params([4, 4], 8, torch.device("cpu"))  # no padding segment
    assert exact.cu_seqlens_q.tolist() == [0, 4, 8] and exact.max_seqlen_q == 4
    pad = thd_packed_seq_params([2], 9, torch.device("cpu"))  # a long padding tail
    assert pad.cu_seqlens_q.tolist() == [0, 2, 9] and pad.max_seqlen_q == 7
    with pytest.raises(ValueError, match="do not fit"):
        thd_packed_seq_params([5, 5], 8, torch.device("cpu"))


# --------------------------------------------------------------------------- chunked log-probs

def _logits(m=23, v=41, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(m, v, generator=g)).to(dtype).requires_grad_()
    return logits, torch.randint(0, v, (m,), generator=g)


def _loss(logp, ent):
    g = torch.Generator().manual_seed(7)
    return (logp * torch.randn(logp.shape, generator=g)).sum() + \
        (ent * torch.randn(ent.shape, generator=g)).sum()


@pytest.mark.parametrize("chunk", [1, 4, 23, 100])
def test_chunked_vocab_parallel_logprobs_equal_unchunked(chunk):
    from chatlearn.models.trainer.megatron.logprobs import vocab_parallel_logprobs

    logits, target = _logits()
    full = vocab_parallel_logprobs(logits, target, with_entropy=True, temperature=0.8)
    (full_grad,) = torch.autograd.grad(_loss(*full), logits)
    chunked = vocab_parallel_logprobs(logits, target, with_entropy=True, temperature=0.8,
                                      chunk_tokens=chunk)
    (grad,) = torch.autograd.grad(_loss(*chunked), logits)
    for a, b in zip(chunked, full):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, full_grad, rtol=0, atol=1e-6)
    ref = torch.log_softmax(logits.double() / 0.8, -1)
    torch.testing.assert_close(chunked[0].double(), ref[torch.arange(len(target)), target],
                               rtol=0, atol=1e-5)


class LargestFloat32Vocab(TorchDispatchMode):
    """The most rows of any float32 tensor with a last dimension of ``vocab`` made by an op."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 2 \
                    and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.shape[0])
        return out


def test_chunked_logprobs_make_no_full_float32_logits():
    """bf16 logits (as on the GPU): no float32 [tokens, V] tensor beyond one chunk, forward
    or backward (the unchunked computation makes several of all 64 rows)."""
    from chatlearn.models.trainer.megatron.logprobs import vocab_parallel_logprobs

    logits, target = _logits(m=64, v=97, dtype=torch.bfloat16)
    with LargestFloat32Vocab(97) as seen:
        logp, ent = vocab_parallel_logprobs(logits, target, with_entropy=True, temperature=0.9,
                                            chunk_tokens=8)
        _loss(logp, ent).backward()
    assert seen.rows == 8 and logits.grad.dtype == torch.bfloat16
    with LargestFloat32Vocab(97) as seen:
        vocab_parallel_logprobs(logits, target, with_entropy=True, temperature=0.9)
    assert seen.rows == 64  # what the tracker sees without chunks


def job_split_vocab(rank, world, logits, target, chunk):
    """Each rank holds half of the vocabulary; chunked log-probs, entropy and gradients."""
    import torch.distributed as dist

    from chatlearn.models.trainer.megatron.logprobs import vocab_parallel_logprobs

    dist.init_process_group("gloo")
    half = logits.shape[1] // world
    mine = logits[:, rank * half:(rank + 1) * half].clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(mine, target, rank * half, dist.group.WORLD, True,
                                        temperature=0.8, chunk_tokens=chunk)
    _loss(logp, ent).backward()
    return {"logp": logp.detach(), "entropy": ent.detach(), "grad": mine.grad}


@pytest.mark.timeout(200)
def test_chunked_logprobs_over_a_split_vocabulary(tmp_path):
    """Two ranks, vocabulary split in halves, chunks of 5 (all-reduces per chunk): the values
    and the (concatenated) gradients of one rank with the whole vocabulary, unchunked."""
    from chatlearn.models.trainer.megatron.logprobs import vocab_parallel_logprobs

    logits, target = _logits(m=17, v=42)
    full = vocab_parallel_logprobs(logits, target, with_entropy=True, temperature=0.8)
    (grad,) = torch.autograd.grad(_loss(*full), logits)
    ranks = run_ranks(job_split_vocab, 2, tmp_path, logits.detach(), target, 5, timeout=150)
    for res in ranks:
        torch.testing.assert_close(res["logp"], full[0].detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(res["entropy"], full[1].detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat([r["grad"] for r in ranks], dim=1), grad,
                               rtol=0, atol=1e-6)


def job_split_topk(rank, world, logits, ks):
    """Each rank holds half of the vocabulary; the teacher's top-k over both halves, for each k of ``ks``."""
    import torch.distributed as dist

    from chatlearn.models.trainer.megatron.logprobs import vocab_parallel_topk

    dist.init_process_group("gloo")
    half = logits.shape[1] // world
    mine = logits[:, rank * half:(rank + 1) * half].clone()
    return {k: vocab_parallel_topk(mine, k, rank * half, dist.group.WORLD, temperature=0.8) for k in ks}


@pytest.mark.timeout(200)
def test_teacher_top_k_over_a_split_vocabulary(tmp_path):
    """A distillation teacher's top-k (k = 1: its argmax; k = the vocabulary: the whole distribution, sorted) with
    the vocabulary in halves on 2 ranks (tensor parallelism 2) equals one rank's over the whole vocabulary
    (tensor parallelism 1) and plain log_softmax + topk; the ids are global."""
    from chatlearn.models.trainer.megatron.logprobs import vocab_parallel_topk

    logits, _ = _logits(m=17, v=42)
    logits = logits.detach()
    ks = (1, 5, 42)
    ranks = run_ranks(job_split_topk, 2, tmp_path, logits, ks, timeout=150)
    for k in ks:
        plain_values, plain_ids = torch.log_softmax(logits.double() / 0.8, -1).topk(k, -1)
        one_values, one_ids = vocab_parallel_topk(logits, k, temperature=0.8)
        torch.testing.assert_close(one_values, plain_values.float(), rtol=0, atol=1e-5)
        assert torch.equal(one_ids, plain_ids)
        assert bool((plain_ids[:, 0] >= 21).any()) and bool((plain_ids[:, 0] < 21).any())  # both halves win some
        for res in ranks:
            values, ids = res[k]
            torch.testing.assert_close(values, one_values, rtol=0, atol=1e-6)
            assert torch.equal(ids, one_ids)
    with pytest.raises(ValueError, match="larger than the vocabulary"):
        vocab_parallel_topk(logits, 43)
