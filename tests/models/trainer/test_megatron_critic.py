"""MegatronTrainer as the PPO critic (role critic) on CPU (gloo, under the test-only device shim) against
the FSDP critic: the initial value head, values, the value loss, gradients and one optimizer step for
TP=1, TP=2 (also with sequence parallelism) and PP=2; checkpoints (resumed bit for bit, refused by a
policy model), save_hf (a token-classification folder), ``chatlearn merge`` of the critic's checkpoints,
and a critic loaded from a token-classification folder.

Three jobs run once per module (spawned processes with a hard deadline, as in
test_megatron_trainer.py): 1 rank (the FSDP critic, then the Megatron critic at TP=1), TP=2 and PP=2.
The tests compare what they return.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from test_fsdp_critic import CLIP, COEF, SAMPLE_WEIGHTS, critic_spec, hf_values, value_columns
from test_fsdp_trainer import make_batch, make_tiny_model, run_ranks
from test_megatron_trainer import LR, megatron_spec, needs_megatron

JOB_TIMEOUT_S = 180
VALUE_METRICS = ("loss", "value_loss", "value_clip_frac", "values_mean", "value_error", "num_tokens")
HEAD = ("score.weight", "score.bias")


def megatron_critic_spec(path: str, tp: int = 1, pp: int = 1, **over):
    """The Megatron tests' spec with the FSDP critic tests' value loss (role critic)."""
    return megatron_spec(path, tp, pp, **{"role": "critic", "cliprange_value": CLIP, "value_loss_coef": COEF, **over})


def _exported(trainer) -> dict:
    """The exported weights (rank 0; {} elsewhere), copied: the FSDP trainer's float32 ones are the
    parameters themselves, which later steps change."""
    return {k: np.array(v) for bucket in trainer.export_weights(bucket_mb=1) for k, v in bucket}


def _head(trainer) -> list | None:
    """This rank's own copy of the Megatron value head (weight, bias) on the last stage, else None."""
    gpt = getattr(trainer, "gpt", None)
    if gpt is None or not gpt.post_process:
        return None
    return [p.detach().clone() for p in (gpt.output_layer.weight, gpt.output_layer.bias)]


# --------------------------------------------------------------------------- rank jobs


def _critic_part(trainer, batch: dict, columns: dict, out: str | None = None) -> dict:
    """The initial weights and values, the loss metrics and gradients, one step and the values after
    it; with ``out``: a checkpoint (``out/checkpoint``), a second step, the checkpoint loaded and the
    second step again, and save_hf (``out/hf``)."""
    res = {"weights0": _exported(trainer), "values": trainer.compute_values(batch),
           "metrics": trainer.compute_grads(columns)}
    grads = trainer.full_grads()  # a collective: complete on rank 0
    res["grads"] = grads if trainer.rank == 0 else None
    trainer.zero_grad()
    res["step"] = trainer.train(columns)
    res["after_step"] = trainer.compute_values(batch)
    res["weights1"] = _exported(trainer)
    res["head"] = _head(trainer)
    if out is None:
        return res
    trainer.save_checkpoint(os.path.join(out, "checkpoint"))
    res["second_step"] = trainer.train(columns)
    res["after_second"] = trainer.compute_values(batch)
    trainer.load_checkpoint(os.path.join(out, "checkpoint"))
    res["loaded"] = trainer.compute_values(batch)
    res["second_step_again"] = trainer.train(columns)
    res["after_second_again"] = trainer.compute_values(batch)
    trainer.save_hf(os.path.join(out, "hf"))
    return res


def job_reference(rank, world, setup, out):
    """1 rank: the FSDP critic; the Megatron critic at TP=1 (and from the FSDP critic's save_hf folder, a
    token-classification folder); a Megatron policy model that refuses the critic's checkpoint."""
    from megatron_shim import cpu_device_shim

    from chatlearn.errors import UserError
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    path, batch, columns = setup["path"], setup["batch"], setup["columns"]
    res = {"fsdp": _critic_part(FSDPTrainer(critic_spec(path, lr=LR)), batch, columns, os.path.join(out, "fsdp"))}
    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        critic = MegatronTrainer(megatron_critic_spec(path))
        res["tp1"] = _critic_part(critic, batch, columns, os.path.join(out, "tp1"))
        try:
            critic.compute_logprobs(batch)
            res["logprobs_refused"] = False
        except RuntimeError:
            res["logprobs_refused"] = True
        policy = MegatronTrainer(megatron_spec(path))
        try:
            policy.load_checkpoint(os.path.join(out, "tp1", "checkpoint"))
            res["policy_load_error"] = None
        except UserError as err:
            res["policy_load_error"] = str(err)
        folder = MegatronTrainer(megatron_critic_spec(os.path.join(out, "fsdp", "hf")))
        res["from_folder"] = {"values": folder.compute_values(batch), "weights0": _exported(folder)}
    return res


def job_tp2(rank, world, setup, out):
    """TP=2: the whole critic part; TP=2 with sequence parallelism: up to the step."""
    from megatron_shim import cpu_device_shim

    path, batch, columns = setup["path"], setup["batch"], setup["columns"]
    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        res = {"tp2": _critic_part(MegatronTrainer(megatron_critic_spec(path, tp=2)), batch, columns, out)}
        res["tp2-sp"] = _critic_part(MegatronTrainer(megatron_critic_spec(path, tp=2, sequence_parallel=True)),
                                     batch, columns)
    return res


def job_pp2(rank, world, setup, out):
    """PP=2 (the value head on the last stage), with activation recomputation: the whole critic part."""
    from megatron_shim import cpu_device_shim

    path, batch, columns = setup["path"], setup["batch"], setup["columns"]
    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        trainer = MegatronTrainer(megatron_critic_spec(path, pp=2, gradient_checkpointing=True))
        return {"pp2": _critic_part(trainer, batch, columns, out)}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The tiny model, the batch, and the batch with ``values`` (V_old) and ``returns`` columns around
    the values of plain transformers' critic (its head seeded with 0, as the trainers')."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    batch = make_batch(AutoConfig.from_pretrained(path).vocab_size)
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32).eval()
    values = hf_values(model, batch)
    head = {name: model.get_parameter(name).detach().numpy().copy() for name in HEAD}
    columns = value_columns(dict(batch, sample_weights=SAMPLE_WEIGHTS), values)
    return {"path": path, "batch": batch, "columns": columns, "hf_values": values, "hf_head": head}


def _run(job, world, setup, tmp_path_factory):
    out = tmp_path_factory.mktemp(job.__name__)
    return run_ranks(job, world, out, setup, str(out), timeout=JOB_TIMEOUT_S), out


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    (res,), out = _run(job_reference, 1, setup, tmp_path_factory)
    return res, out


@pytest.fixture(scope="module")
def tp2(setup, tmp_path_factory):
    return _run(job_tp2, 2, setup, tmp_path_factory)


@pytest.fixture(scope="module")
def pp2(setup, tmp_path_factory):
    return _run(job_pp2, 2, setup, tmp_path_factory)


def _runs(reference, tp2, pp2) -> dict:
    """Every Megatron critic run by name: a list of per-rank results."""
    return {"tp1": [reference[0]["tp1"]], "tp2": [r["tp2"] for r in tp2[0]],
            "tp2-sp": [r["tp2-sp"] for r in tp2[0]], "pp2": [r["pp2"] for r in pp2[0]]}


# --------------------------------------------------------------------------- tests


@needs_megatron
@pytest.mark.timeout(400)
def test_initial_head_and_values_match_the_fsdp_critic(setup, reference, tp2, pp2):
    """The value head starts as the FSDP critic's (Hugging Face's initialisation, the same seed), the
    backbone is the causal LM's, and compute_values (the head on the hidden state before each response
    token, 0 elsewhere) gives the FSDP critic's values on every rank of every layout."""
    from safetensors.numpy import load_file

    fsdp = reference[0]["fsdp"]
    np.testing.assert_allclose(fsdp["values"], setup["hf_values"], rtol=0, atol=1e-5)
    initial = load_file(os.path.join(setup["path"], "model.safetensors"))
    backbone = set(initial) - {"lm_head.weight"}
    for name, ranks in _runs(reference, tp2, pp2).items():
        weights = ranks[0]["weights0"]
        assert set(weights) == backbone | set(HEAD) == set(fsdp["weights0"]), name
        for key in HEAD:
            assert np.array_equal(weights[key], setup["hf_head"][key]), (name, key)
            assert np.array_equal(weights[key], fsdp["weights0"][key]), (name, key)
        for key in backbone:
            assert np.array_equal(weights[key], initial[key]), (name, key)
        for res in ranks:
            assert res["values"].dtype == np.float32, name
            np.testing.assert_allclose(res["values"], fsdp["values"], rtol=0, atol=1e-5, err_msg=name)
            np.testing.assert_array_equal(res["values"], ranks[0]["values"])  # the same on every rank
        assert all(r["weights0"] == {} for r in ranks[1:]), name  # only rank 0 holds the export
    assert reference[0]["logprobs_refused"]


@needs_megatron
@pytest.mark.timeout(400)
def test_value_loss_gradients_and_one_step_match_the_fsdp_critic(reference, tp2, pp2):
    """The value loss metrics (with a filtered sample and clipped tokens), the gradients, one Adam step
    (clipped at norm 1) and the values after it are the FSDP critic's; the tensor-parallel ranks hold
    the same value head after the step, bit for bit."""
    fsdp = reference[0]["fsdp"]
    assert 0 < fsdp["metrics"]["value_clip_frac"] < 1 and fsdp["step"]["skipped_steps"] == 0.0
    assert not np.allclose(fsdp["after_step"], fsdp["values"], rtol=0, atol=1e-4)  # the step moved them
    assert {"score.weight", "score.bias"} <= fsdp["grads"].keys()
    for name, ranks in _runs(reference, tp2, pp2).items():
        for res in ranks:
            for key in VALUE_METRICS:
                assert res["metrics"][key] == pytest.approx(fsdp["metrics"][key], abs=1e-6), (name, key)
                assert res["step"][key] == res["metrics"][key] == ranks[0]["metrics"][key], (name, key)
            assert res["step"]["grad_norm"] == pytest.approx(fsdp["step"]["grad_norm"], rel=1e-5), name
            assert res["step"]["lr"] == fsdp["step"]["lr"] == LR, name
            np.testing.assert_allclose(res["after_step"], fsdp["after_step"], rtol=0, atol=1e-5, err_msg=name)
        grads = ranks[0]["grads"]
        assert grads.keys() == fsdp["grads"].keys(), name
        for key, g in fsdp["grads"].items():
            torch.testing.assert_close(grads[key], g, rtol=0, atol=1e-6, msg=f"{name} {key}")
        for key, w in fsdp["weights1"].items():
            np.testing.assert_allclose(ranks[0]["weights1"][key], w, rtol=0, atol=1e-5, err_msg=f"{name} {key}")
        heads = [r["head"] for r in ranks if r["head"] is not None]
        assert len(heads) == (1 if name == "pp2" else len(ranks)), name  # on the last stage only
        for head in heads[1:]:
            assert all(torch.equal(a, b) for a, b in zip(head, heads[0])), name


@needs_megatron
@pytest.mark.timeout(400)
def test_checkpoint_round_trip_restores_the_values(reference, tp2, pp2):
    """Save, step, load: the values are the saved ones, and the same step again (the optimizer state
    restored) gives the same metrics and values bit for bit; the metadata records the role, and a
    policy model refuses the critic's checkpoint."""
    (ref, ref_out), (tp2_ranks, tp2_out), (pp2_ranks, pp2_out) = reference, tp2, pp2
    runs = {"tp1": [ref["tp1"]], "tp2": [r["tp2"] for r in tp2_ranks], "pp2": [r["pp2"] for r in pp2_ranks]}
    for name, ranks in runs.items():
        for res in ranks:
            np.testing.assert_array_equal(res["loaded"], res["after_step"], err_msg=name)
            assert not np.array_equal(res["after_second"], res["after_step"]), name
            np.testing.assert_array_equal(res["after_second_again"], res["after_second"], err_msg=name)
            assert res["second_step_again"] == res["second_step"], name
    for folder in (ref_out / "tp1" / "checkpoint", tp2_out / "checkpoint", pp2_out / "checkpoint"):
        with open(folder / "chatlearn_checkpoint.json", encoding="utf-8") as f:
            assert json.load(f)["role"] == "critic", folder
    assert "saved by a critic model" in ref["policy_load_error"]


@needs_megatron
@pytest.mark.timeout(400)
def test_save_hf_is_a_token_classification_folder(setup, reference, tp2):
    """save_hf's folder (TP=1 and TP=2) holds the backbone and score.weight / score.bias (no lm_head),
    loads with AutoModelForTokenClassification with one label, and gives the trainer's values; the
    tokenizer comes along. Loaded back into the Megatron critic (a token-classification folder: its
    score is loaded, not initialised), the FSDP critic's folder gives the FSDP critic's values."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

    (ref, ref_out), ((tp2_r0, _), tp2_out) = reference, tp2
    for name, res, folder in (("tp1", ref["tp1"], ref_out / "tp1" / "hf"), ("tp2", tp2_r0["tp2"], tp2_out / "hf")):
        state = load_file(folder / "model.safetensors")
        assert set(state) == set(res["weights0"]) and "lm_head.weight" not in state, name
        assert state["score.weight"].shape == (1, 128) and state["score.bias"].shape == (1,), name
        config = AutoConfig.from_pretrained(folder)
        assert config.num_labels == 1 and config.architectures == ["Qwen2ForTokenClassification"], name
        assert not (folder / "generation_config.json").exists(), name
        model = AutoModelForTokenClassification.from_pretrained(folder, dtype=torch.float32).eval()
        np.testing.assert_allclose(hf_values(model, setup["batch"]), res["after_second_again"], rtol=0, atol=1e-5,
                                   err_msg=name)
        assert AutoTokenizer.from_pretrained(folder).eos_token == "<|im_end|>", name
    fsdp, folder = ref["fsdp"], ref["from_folder"]
    np.testing.assert_allclose(folder["values"], fsdp["after_second_again"], rtol=0, atol=1e-5)
    saved = load_file(ref_out / "fsdp" / "hf" / "model.safetensors")
    for key in HEAD:
        assert np.array_equal(folder["weights0"][key], saved[key]), key


@needs_megatron
@pytest.mark.timeout(400)
def test_merge_turns_megatron_critic_checkpoints_into_token_classification_folders(setup, tp2, pp2, tmp_path):
    """``chatlearn merge`` of the critic's TP=2 and PP=2 checkpoints (saved after one step): the trainer's
    exported weights exactly, score.* in place of lm_head, a folder that AutoModelForTokenClassification
    loads with the values the trainer had at the save."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoModelForTokenClassification

    from chatlearn.checkpoint.merge import merge_checkpoint

    for name, (ranks, out) in (("tp2", tp2), ("pp2", pp2)):
        res = ranks[0][name]
        summary = merge_checkpoint(str(out / "checkpoint"), str(tmp_path / name), max_shard_size="100KB")
        merged = {}
        for shard in summary["shards"]:
            merged.update(load_file(tmp_path / name / shard))
        assert set(merged) == set(res["weights1"]) and len(summary["shards"]) > 1, name
        for key, w in res["weights1"].items():
            assert merged[key].dtype == np.float32 and np.array_equal(merged[key], w), (name, key)
        config = AutoConfig.from_pretrained(tmp_path / name)
        assert config.num_labels == 1 and config.architectures == ["Qwen2ForTokenClassification"], name
        model = AutoModelForTokenClassification.from_pretrained(tmp_path / name, dtype=torch.float32).eval()
        np.testing.assert_allclose(hf_values(model, setup["batch"]), res["after_step"], rtol=0, atol=1e-5,
                                   err_msg=name)
