"""A step whose loss or gradient norm is not finite is skipped, on every rank alike; weights that
hold nan or inf are never written to a checkpoint (the FSDP trainer, and the Megatron trainer with
the distributed optimizer under the CPU device shim; 2 ranks each).

The nan is injected without touching the learning rate: one sample's advantage is nan, and that
sample is in rank 1's share, so rank 0's own loss is finite and only the all-reduced loss and
gradient norm tell it to skip. The engine's side (warning, the count, the stop) is in
test_engine_counts_skipped_steps_in_a_row here and, in a real run, in test_reliability_e2e.py.
"""
from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
import pytest
import torch

from test_fsdp_trainer import (add_logprobs, hf_logprobs, make_batch, make_tiny_model,  # noqa: E402
                               run_ranks, trainer_spec)


def _weights(trainer) -> dict:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in trainer.model.named_parameters()}


def _adam(trainer) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    for i, state in enumerate(trainer.optimizer.state.values()):
        for k, v in state.items():
            out[f"{i}.{k}"] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def _megatron_state(trainer) -> tuple[dict, dict]:
    """This rank's weights and optimizer state (main params, Adam moments)."""
    weights = {str(i): p.detach().clone() for i, p in enumerate(trainer.gpt.parameters())}
    states = {str(i): t.detach().clone() for i, t in enumerate(trainer._part_tensors("optimizer"))}
    return weights, states


def _skip_part(trainer, batch, bad_batch, state, grads_dropped, poison, out) -> dict:
    from chatlearn.errors import UserError

    res = {"first": trainer.train(batch)}
    (weights, adam), steps = state(), trainer._optimizer_steps()
    res["bad"] = trainer.train(bad_batch)
    weights2, adam2 = state()
    res["weights_unchanged"] = all(torch.equal(weights[n], w) for n, w in weights2.items())
    res["adam_unchanged"] = adam.keys() == adam2.keys() and all(torch.equal(adam[k], v) for k, v in adam2.items())
    res["steps"] = (steps, trainer._optimizer_steps())
    res["grads_dropped"] = grads_dropped()
    res["after"] = trainer.train(batch)
    res["steps_after"] = trainer._optimizer_steps()
    # weights that hold nan: no checkpoint, on every rank
    with torch.no_grad():
        poison()
    target = os.path.join(out, "ckpt")
    try:
        trainer.save_checkpoint(target)
        res["save_error"] = None
    except UserError as err:
        res["save_error"] = err.message
    res["ckpt_written"] = os.path.exists(target) and bool(os.listdir(target))
    return res


def job_megatron(rank, world, path, batch, bad_batch, out):
    """Megatron, 2 data-parallel replicas with the distributed optimizer (under the CPU shim)."""
    from megatron_shim import cpu_device_shim
    from test_megatron_trainer import megatron_spec

    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        trainer = MegatronTrainer(megatron_spec(path, use_distributed_optimizer=True))
        return _skip_part(trainer, batch, bad_batch, lambda: _megatron_state(trainer),
                          lambda: all(not b.any() for b in trainer._grad_buffers()),
                          lambda: next(trainer.gpt.parameters()).fill_(float("nan")), out)


def job(rank, world, path, batch, bad_batch, out):
    from chatlearn.errors import UserError
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    trainer = FSDPTrainer(trainer_spec(path))
    res = {"first": trainer.train(batch)}
    weights, adam, steps = _weights(trainer), _adam(trainer), trainer._optimizer_steps()
    res["bad"] = trainer.train(bad_batch)
    res["weights_unchanged"] = all(torch.equal(weights[n], w) for n, w in _weights(trainer).items())
    res["adam_unchanged"] = all(torch.equal(adam[k], v) for k, v in _adam(trainer).items())
    res["steps"] = (steps, trainer._optimizer_steps())
    res["grads_dropped"] = all(p.grad is None for p in trainer.model.parameters())
    res["after"] = trainer.train(batch)
    res["steps_after"] = trainer._optimizer_steps()
    # weights that hold nan: no checkpoint, on every rank
    with torch.no_grad():
        next(trainer.model.parameters()).to_local().fill_(float("nan"))
    target = os.path.join(out, "ckpt")
    try:
        trainer.save_checkpoint(target)
        res["save_error"] = None
    except UserError as err:
        res["save_error"] = err.message
    res["ckpt_written"] = os.path.exists(target) and bool(os.listdir(target))
    return res


needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="megatron-core is not installed")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["fsdp", pytest.param("megatron", marks=needs_megatron)])
def test_nonfinite_step_is_skipped_on_every_rank(tmp_path, backend):
    from transformers import AutoConfig

    path = make_tiny_model(str(tmp_path / "tiny"))
    batch = make_batch(AutoConfig.from_pretrained(path).vocab_size)
    logp, _ = hf_logprobs(path, batch)
    batch = add_logprobs(batch, logp)
    bad = dict(batch, advantages=batch["advantages"].copy())
    bad["advantages"][6] = np.nan  # samples 4..7 are rank 1's
    results = run_ranks(job if backend == "fsdp" else job_megatron, 2, tmp_path, path, batch, bad, str(tmp_path))
    for rank, res in enumerate(results):
        assert res["first"]["skipped_steps"] == 0.0 and math.isfinite(res["first"]["grad_norm"]), rank
        assert res["bad"]["skipped_steps"] == 1.0, (rank, res["bad"])
        assert not math.isfinite(res["bad"]["loss"]) or not math.isfinite(res["bad"]["grad_norm"])
        assert res["weights_unchanged"] and res["adam_unchanged"], rank
        assert res["steps"] == (1, 1), rank  # the learning-rate schedule did not advance
        assert res["grads_dropped"], rank
        assert res["after"]["skipped_steps"] == 0.0 and res["steps_after"] == 2, rank
        assert res["save_error"] and "hold nan or inf" in res["save_error"], (rank, res["save_error"])
        assert "optimizer.lr" in res["save_error"]
    assert not results[0]["ckpt_written"]


def test_engine_counts_skipped_steps_in_a_row(capsys):
    """A warning per skipped step; a finite step resets the count; the limit stops the run."""
    import types

    from chatlearn.errors import UserError
    from chatlearn.runtime.driver.algorithm import StepLoop

    cfg = types.SimpleNamespace(
        models=types.SimpleNamespace(policy_trainer=types.SimpleNamespace(
            optimizer=types.SimpleNamespace(max_nonfinite_steps=2))),
        runtime_args=types.SimpleNamespace(output_dir="OUT"))
    loop = StepLoop(cfg, types.SimpleNamespace(steps_per_episode=4), calls=None, progress=None)
    good = {"skipped_steps": 0.0, "loss": 0.1, "grad_norm": 1.0}
    bad = {"skipped_steps": 1.0, "loss": float("nan"), "grad_norm": float("inf")}
    assert loop.nonfinite("policy_trainer", bad, 3, 1) is True
    assert "episode 3, optimizer step 1/4: loss nan, gradient norm inf: not finite" in capsys.readouterr().out
    assert loop.nonfinite("policy_trainer", good, 3, 2) is False and loop.nonfinite_in_a_row["policy_trainer"] == 0
    assert loop.nonfinite("policy_trainer", bad, 3, 3) is True
    with pytest.raises(UserError) as err:
        loop.nonfinite("policy_trainer", bad, 3, 4)
    message = " ".join(err.value.message.split())
    for word in ("training diverged", "not finite in 2 optimizer steps in a row", "episode 3, optimizer step 4/4",
                 "max_nonfinite_steps: 2", "no checkpoint was saved yet (none in OUT/checkpoints)",
                 "models.policy_trainer.optimizer.lr"):
        assert word in message, message


def test_the_divergence_message_names_the_checkpoint_a_rerun_resumes_from(tmp_path):
    """The checkpoint ``checkpoints/latest`` names (one that exists), not the folder of checkpoints."""
    import types

    from chatlearn.errors import UserError
    from chatlearn.runtime.driver.algorithm import StepLoop

    root = tmp_path / "checkpoints"
    for e in (1, 2, 3):
        (root / f"episode_00000{e}").mkdir(parents=True)
        if e < 3:  # episode 3's save never completed
            (root / f"episode_00000{e}" / "COMPLETE").write_text("ok\n")
    (root / "latest").write_text("episode_000002\n")
    cfg = types.SimpleNamespace(
        models=types.SimpleNamespace(policy_trainer=types.SimpleNamespace(
            optimizer=types.SimpleNamespace(max_nonfinite_steps=1))),
        runtime_args=types.SimpleNamespace(output_dir=str(tmp_path)))
    loop = StepLoop(cfg, types.SimpleNamespace(steps_per_episode=1), calls=None, progress=None)
    with pytest.raises(UserError) as err:
        loop.nonfinite("policy_trainer", {"skipped_steps": 1.0, "loss": float("nan"), "grad_norm": 1.0}, 4, 1)
    message = " ".join(err.value.message.split())
    named = str(root / "episode_000002")
    assert f"resumes from the last checkpoint saved, {named} (episode 2)" in message, message
    assert os.path.isdir(named)
