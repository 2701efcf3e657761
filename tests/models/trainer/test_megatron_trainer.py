"""MegatronTrainer on CPU (gloo, under the test-only device shim) against the FSDP2 trainer:
weight round trip, log-probs, GRPO loss, gradients and one optimizer step, for tensor,
pipeline and data parallelism; residency, weight export and the Hugging Face save.

megatron-core calls CUDA directly; every rank job runs inside ``megatron_shim.cpu_device_shim``
so that its CUDA code paths land on the CPU. Four jobs run once per module (spawned
processes with a hard deadline): a 1-rank reference (FSDP2 and Megatron TP=1), TP=2 (also
with sequence parallelism), PP=2 (with activation recomputation) and DP=2 (distributed
optimizer); TP=2 and PP=2 also load a second model with untied output embeddings and a
vocabulary that TP=2 pads. The tests compare what they return.
"""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from conftest import REPO
from test_fsdp_trainer import (
    add_logprobs,
    hf_logprobs,
    make_batch,
    make_tiny_model,
    run_ranks,
    trainer_spec,
    with_observations,
)

from chatlearn.config import load as config_load

INSTALL = "pip install -e '.[megatron]' -c requirements/constraints-cpu.txt"
needs_megatron = pytest.mark.skipif(not config_load._importable("megatron.core"),
                                    reason=f"megatron-core is not installed ({INSTALL})")
TEMPLATE = os.path.join(REPO, "template", "grpo_megatron.yaml")

TEMPERATURE = 0.8
LR = 1e-4  # Adam's first step moves every weight by about lr (see test_one_step_...)
JOB_TIMEOUT_S = 120


def megatron_spec(path: str, tp: int = 1, pp: int = 1, **over):
    """The FSDP tests' spec (:func:`trainer_spec`) with Megatron's parallel sizes."""
    return trainer_spec(path, **{"lr": LR, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                 "sequence_parallel": False, "use_distributed_optimizer": False, **over})


def make_untied_model(path: str) -> str:
    """A second tiny Qwen2 with untied output embeddings and an odd vocabulary (321: padded
    to 322 rows under TP=2, the padding masked out of the log-probs)."""
    from tiny_model import make_tiny_model as make_raw
    from transformers import AutoModelForCausalLM

    make_raw(path, seed=1, vocab_size=321)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 tie_word_embeddings=False)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(0.1)
        model.lm_head.weight.normal_(0.0, 0.05)
    model.save_pretrained(path)
    return path


def initial_weights(path: str) -> dict:
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _exported(trainer) -> tuple[dict, list[int]]:
    buckets = list(trainer.export_weights(bucket_mb=1))
    return {k: v for b in buckets for k, v in b}, [len(b) for b in buckets]


# --------------------------------------------------------------------------- rank jobs


def _parity_part(trainer, batch, full_grads: bool = True) -> dict:
    """Export before any step, log-probs, gradients, then one real step and export."""
    weights0, _ = _exported(trainer)
    logp, ent = trainer.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
    metrics = trainer.compute_grads(batch)
    grads = trainer.full_grads() if full_grads else None
    trainer.zero_grad()
    step = trainer.train(batch)
    weights1, sizes = _exported(trainer)
    return {"weights0": weights0, "logp": logp, "entropy": ent, "metrics": metrics,
            "grads": grads, "step_metrics": step, "weights1": weights1, "bucket_sizes": sizes}


# a non-default loss and schedule: GSPO, Dr. GRPO aggregation, dual clip, low_var_kl, a
# filtered sample (on data-parallel replica 0), linear decay after a 1-step warmup
ALT = dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-sum-norm",
           pos_clip_ratio=0.1, neg_clip_ratio=0.1, clip_ratio_c=1.05, kl_estimator="low_var_kl", lr_decay_style="linear",
           lr_warmup_iters=1, lr_decay_iters=4, lr_warmup_init=3e-5, min_lr=1e-5)
ALT_WEIGHTS = np.array([1, 0, 1, 1, 1, 1, 1, 1], np.float32)


def _alt_part(trainer, batch, full_grads: bool = True) -> dict:
    """The ALT configuration: metrics and gradients, then two steps (warmup lr, then lr)."""
    batch = dict(batch, sample_weights=ALT_WEIGHTS)
    metrics = trainer.compute_grads(batch)
    grads = trainer.full_grads() if full_grads else None
    trainer.zero_grad()
    steps = [trainer.train(batch) for _ in range(2)]
    weights, _ = _exported(trainer)
    return {"metrics": metrics, "grads": grads, "steps": steps, "weights": weights}


def _observations_part(trainer, batch) -> dict:
    """A multi-turn batch (observation tokens with loss_mask 0): log-probs and gradients (the
    trainer built with kl_coef = entropy_coef = 0)."""
    masked = with_observations(batch)
    logp = trainer.compute_logprobs(masked)
    metrics = trainer.compute_grads(dict(masked, old_logprobs=logp))
    grads = trainer.full_grads()
    trainer.zero_grad()
    return {"obs_logp": logp, "obs_metrics": metrics, "obs_grads": grads}


def _residency_part(trainer, batch) -> dict:
    """Offload weights + optimizer + grads, check the storage is gone, onload, compare."""
    def nbytes(tensors):
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def unique_nbytes(tensors):
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors}.values())

    logp0 = trainer.compute_logprobs(batch)
    weights0 = [p.detach().clone() for p in trainer.gpt.parameters()]
    states0 = [t.clone() for t in trainer._part_tensors("optimizer")]
    expected = (unique_nbytes(trainer._part_tensors("weights"))
                + unique_nbytes(trainer._part_tensors("optimizer")))
    off = trainer.offload(["weights", "optimizer", "grads"])
    res = {
        "offload_bytes": off["bytes"], "expected_bytes": expected,
        "num_states": len(states0),
        "weight_bytes_live": nbytes(trainer.gpt.parameters()),
        "state_bytes_live": nbytes(trainer._part_tensors("optimizer")),
        "grad_bytes_live": nbytes(trainer._grad_buffers()),
        "again_bytes": trainer.offload(["weights", "optimizer"])["bytes"],
    }
    try:
        trainer.compute_logprobs(batch)
        res["refused"] = False
    except RuntimeError:
        res["refused"] = True
    res["onload_bytes"] = trainer.onload(["weights", "optimizer", "grads"])["bytes"]
    res["grad_bytes_back"] = nbytes(trainer._grad_buffers())
    res["logp_equal"] = np.array_equal(trainer.compute_logprobs(batch), logp0)
    res["weights_equal"] = all(torch.equal(p, w) for p, w in zip(trainer.gpt.parameters(), weights0))
    res["states_equal"] = all(torch.equal(a, b) for a, b in
                              zip(trainer._part_tensors("optimizer"), states0))
    # grads dropped without an onload come back as zeros when training needs them
    trainer.offload(["grads"])
    res["after_onload"] = trainer.train(batch)
    return res


def _resume_part(trainer, make_trainer, batch, path: str) -> dict:
    """Save a checkpoint after a step, step again; a new trainer loads it and steps: the
    two second steps must agree bit for bit."""
    trainer.save_checkpoint(path)
    expected = trainer.train(batch)
    expected_weights, _ = _exported(trainer)
    resumed = make_trainer()
    resumed.load_checkpoint(path)
    parts = ["weights", "optimizer", "grads"]  # the loaded state can leave the device too
    assert resumed.offload(parts)["bytes"] == resumed.onload(parts)["bytes"] > 0
    got = resumed.train(batch)
    got_weights, _ = _exported(resumed)
    return {"resume_expected": expected, "resume_got": got,
            "resume_weights_equal": all(np.array_equal(got_weights[k], w)
                                        for k, w in expected_weights.items())
            and got_weights.keys() == expected_weights.keys()}


def _frozen_part(trainer, batch) -> dict:
    """A frozen model (ref_policy): its export and its log-probs."""
    weights, _ = _exported(trainer)
    return {"weights0": weights, "logp": trainer.compute_logprobs(batch, temperature=TEMPERATURE)}


def _top1_part(trainer, batch):
    """A distillation teacher's pass on Megatron: the log-probs and whether each token is the argmax of the logits
    (over every tensor-parallel rank's slice of the vocabulary)."""
    from chatlearn.algorithms.grpo import TOP1

    return trainer.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=TOP1)


def job_reference(rank, world, setup, out):
    """1 rank: the FSDP2 trainer, and Megatron with TP = PP = DP = 1 (and as ref_policy)."""
    from megatron_shim import cpu_device_shim

    path, batch = setup["path"], setup["batch"]
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    fsdp = FSDPTrainer(trainer_spec(path, lr=LR))
    res = {"fsdp": _parity_part(fsdp, batch)}
    res["fsdp_obs"] = _observations_part(FSDPTrainer(trainer_spec(path, kl_coef=0.0, entropy_coef=0.0)), batch)
    res["fsdp_alt"] = _alt_part(FSDPTrainer(trainer_spec(path, lr=LR, **ALT)), batch)
    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        res["tp1"] = _parity_part(MegatronTrainer(megatron_spec(path)), batch)
        res["tp1"]["top1"] = _top1_part(MegatronTrainer(megatron_spec(path, trainable=False)), batch)
        res["tp1"]["alt"] = _alt_part(MegatronTrainer(megatron_spec(path, **ALT)), batch)
        res["tp1"]["obs"] = _observations_part(MegatronTrainer(megatron_spec(path, kl_coef=0.0, entropy_coef=0.0)),
                                               batch)
        ref = MegatronTrainer(megatron_spec(path, trainable=False))
        res["ref_logp"] = ref.compute_logprobs(batch, temperature=TEMPERATURE)
        res["ref_requires_grad"] = any(p.requires_grad for p in ref.gpt.parameters())
        res["ref_offload"] = ref.offload(["weights", "optimizer", "grads"])["bytes"]
        res["ref_onload"] = ref.onload(["weights", "optimizer", "grads"])["bytes"]
        res["ref_logp_after_onload"] = ref.compute_logprobs(batch, temperature=TEMPERATURE)
        try:
            ref.train(batch)
            res["ref_train_refused"] = False
        except RuntimeError:
            res["ref_train_refused"] = True
    return res


def job_tp2(rank, world, setup, out):
    """TP=2: parity, residency, save_hf; TP=2 with sequence parallelism; the untied model."""
    from megatron_shim import cpu_device_shim

    path, batch = setup["path"], setup["batch"]
    env_before = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        trainer = MegatronTrainer(megatron_spec(path, tp=2))
        res = _parity_part(trainer, batch)
        res["top1"] = _top1_part(MegatronTrainer(megatron_spec(path, tp=2, trainable=False)), batch)
        res["max_connections_env"] = (env_before, os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
        res.update(_residency_part(trainer, batch))
        trainer.save_hf(os.path.join(out, "saved"))
        trainer.save_checkpoint(os.path.join(out, "checkpoint"))  # for the offline merge
        res["saved_logp"] = trainer.compute_logprobs(batch, temperature=TEMPERATURE)
        res["saved_weights"], _ = _exported(trainer)
        sp = MegatronTrainer(megatron_spec(path, tp=2, sequence_parallel=True))
        res["sp"] = _parity_part(sp, batch)
        untied = MegatronTrainer(megatron_spec(setup["untied"], tp=2, trainable=False))
        res["untied"] = _frozen_part(untied, batch)
        untied.save_checkpoint(os.path.join(out, "untied_checkpoint"))
    return res


def job_pp2(rank, world, setup, out):
    """PP=2 (tied embeddings on both stages), with activation recomputation; the untied
    model (output layer on the last stage)."""
    from megatron_shim import cpu_device_shim

    path, batch = setup["path"], setup["batch"]
    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        cfg = megatron_spec(path, pp=2, gradient_checkpointing=True)
        trainer = MegatronTrainer(cfg)
        res = _parity_part(trainer, batch)
        res.update(_resume_part(trainer, lambda: MegatronTrainer(cfg), batch,
                                os.path.join(out, "checkpoint")))
        res["alt"] = _alt_part(MegatronTrainer(megatron_spec(path, pp=2, **ALT)), batch)
        res["obs"] = _observations_part(MegatronTrainer(megatron_spec(path, pp=2, kl_coef=0.0, entropy_coef=0.0)),
                                        batch)
        untied = MegatronTrainer(megatron_spec(setup["untied"], pp=2, trainable=False))
        res["untied"] = _frozen_part(untied, batch)
    return res


def job_dp2(rank, world, setup, out):
    """DP=2 with the distributed optimizer (gradients are reduce-scattered: no full_grads)."""
    from megatron_shim import cpu_device_shim

    path, batch = setup["path"], setup["batch"]
    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        cfg = megatron_spec(path, use_distributed_optimizer=True)
        trainer = MegatronTrainer(cfg)
        res = _parity_part(trainer, batch, full_grads=False)
        res.update(_resume_part(trainer, lambda: MegatronTrainer(cfg), batch,
                                os.path.join(out, "checkpoint")))
        res["alt"] = _alt_part(MegatronTrainer(megatron_spec(
            path, use_distributed_optimizer=True, **ALT)), batch, full_grads=False)
    return res


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoConfig

    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    vocab = AutoConfig.from_pretrained(path).vocab_size
    batch = make_batch(vocab)
    logp, _ = hf_logprobs(path, batch)
    untied = make_untied_model(str(tmp_path_factory.mktemp("untied")))
    return {"path": path, "batch": add_logprobs(batch, logp), "untied": untied}


def _run(job, world, setup, tmp_path_factory):
    out = tmp_path_factory.mktemp(job.__name__)
    return run_ranks(job, world, out, setup, str(out), timeout=JOB_TIMEOUT_S), out


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    return _run(job_reference, 1, setup, tmp_path_factory)[0][0]


@pytest.fixture(scope="module")
def tp2(setup, tmp_path_factory):
    return _run(job_tp2, 2, setup, tmp_path_factory)


@pytest.fixture(scope="module")
def pp2_run(setup, tmp_path_factory):
    return _run(job_pp2, 2, setup, tmp_path_factory)


@pytest.fixture(scope="module")
def pp2(pp2_run):
    return pp2_run[0]


@pytest.fixture(scope="module")
def dp2(setup, tmp_path_factory):
    return _run(job_dp2, 2, setup, tmp_path_factory)[0]


def _runs(reference, tp2, pp2, dp2) -> dict:
    """Every Megatron run by name: a list of per-rank results."""
    return {"tp1": [reference["tp1"]], "tp2": tp2[0], "tp2-sp": [r["sp"] for r in tp2[0]],
            "pp2": pp2, "dp2-distopt": dp2}


# --------------------------------------------------------------------------- tests without ranks


def test_vocab_parallel_logprobs_match_full_softmax():
    """On one rank (no group) the function is log_softmax / entropy, with exact gradients."""
    from chatlearn.algorithms.grpo import entropy_from_logits, logprobs_from_logits
    from chatlearn.models.trainer.megatron.logprobs import vocab_parallel_logprobs

    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(6, 17, generator=gen, dtype=torch.float64)).requires_grad_()
    target = torch.randint(0, 17, (6,), generator=gen)
    logp, ent = vocab_parallel_logprobs(logits, target, with_entropy=True)
    torch.testing.assert_close(logp, logprobs_from_logits(logits, target), rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, entropy_from_logits(logits), rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda z: vocab_parallel_logprobs(z, target, with_entropy=True), (logits,))
    assert torch.autograd.gradcheck(lambda z: vocab_parallel_logprobs(z, target)[0], (logits,))
    assert vocab_parallel_logprobs(logits.float(), target)[1] is None


def test_config_without_megatron_core_names_the_key_and_the_install_command(
        paths_overrides, monkeypatch):
    from chatlearn.errors import ConfigError

    monkeypatch.setattr(config_load, "_importable", lambda module: module != "megatron.core")
    with pytest.raises(ConfigError) as err:
        config_load.load_config(TEMPLATE, paths_overrides)
    assert err.value.key == "runtime_args.train_backend"
    assert INSTALL in str(err.value) and "\n" not in str(err.value)


@needs_megatron
def test_template_loads_and_passes_the_parallel_sizes(paths_overrides):
    from chatlearn.config.plan import make_plan
    from chatlearn.models.specs import TrainerSpec
    from chatlearn.runtime.cluster.cluster import BACKENDS

    over = ["models.policy_trainer.num_gpu=4", "models.policy_trainer.tensor_model_parallel_size=2",
            "models.policy_trainer.sequence_parallel=True"]
    cfg = config_load.load_config(TEMPLATE, paths_overrides + over)
    assert cfg.runtime_args.train_backend == "megatron"
    assert BACKENDS["megatron"] == "chatlearn.models.trainer.megatron:MegatronTrainer"
    assert make_plan(cfg).trainer_dp == 2
    for name in ("policy_trainer", "ref_policy"):  # the reference follows the trainer
        spec = TrainerSpec.from_config(cfg, name, make_plan(cfg))
        assert (spec.tensor_model_parallel_size, spec.pipeline_model_parallel_size) == (2, 1)
        assert spec.sequence_parallel is True and spec.use_distributed_optimizer is False


# --------------------------------------------------------------------------- tests with ranks

METRICS = ("loss", "policy_loss", "kl", "entropy", "clip_frac", "num_tokens")


@needs_megatron
@pytest.mark.timeout(400)
def test_weight_round_trip_is_exact(setup, reference, tp2, pp2, dp2):
    """HF -> Megatron (sharded) -> HF gives every parameter back bit for bit."""
    initial = initial_weights(setup["path"])
    expected = set(initial) - {"lm_head.weight"}  # tied: exported as the embeddings
    for name, ranks in _runs(reference, tp2, pp2, dp2).items():
        exported = ranks[0]["weights0"]
        assert set(exported) == expected, name
        for key in expected:
            assert exported[key].dtype == np.float32, (name, key)
            assert np.array_equal(exported[key], initial[key]), (name, key)
        for other in ranks[1:]:  # collective export: only rank 0 holds the arrays
            assert other["weights0"] == {} and all(n == 0 for n in other["bucket_sizes"])
            assert len(other["bucket_sizes"]) == len(ranks[0]["bucket_sizes"]) >= 2


@needs_megatron
@pytest.mark.timeout(400)
def test_untied_embeddings_and_padded_vocabulary(setup, tp2, pp2):
    """Untied output layer (last pipeline stage), vocabulary 321 padded to 322 under TP=2."""
    initial = initial_weights(setup["untied"])
    assert initial["lm_head.weight"].shape[0] == 321
    logp, _ = hf_logprobs(setup["untied"], setup["batch"], TEMPERATURE)
    for name, ranks in (("tp2", tp2[0]), ("pp2", pp2)):
        exported = ranks[0]["untied"]["weights0"]
        assert set(exported) == set(initial), name
        for key, w in initial.items():
            assert np.array_equal(exported[key], w), (name, key)
        for res in ranks:
            np.testing.assert_allclose(res["untied"]["logp"], logp, rtol=0, atol=1e-5,
                                       err_msg=name)


@needs_megatron
@pytest.mark.timeout(400)
def test_logprobs_and_loss_match_fsdp(setup, reference, tp2, pp2, dp2):
    fsdp = reference["fsdp"]
    logp, ent = hf_logprobs(setup["path"], setup["batch"], TEMPERATURE)
    np.testing.assert_allclose(fsdp["logp"], logp, rtol=0, atol=1e-5)
    np.testing.assert_allclose(fsdp["entropy"], ent, rtol=0, atol=1e-5)
    for name, ranks in _runs(reference, tp2, pp2, dp2).items():
        for res in ranks:  # the same on every rank
            assert res["logp"].dtype == np.float32, name
            np.testing.assert_allclose(res["logp"], fsdp["logp"], rtol=0, atol=1e-5, err_msg=name)
            np.testing.assert_allclose(res["entropy"], fsdp["entropy"], rtol=0, atol=1e-5,
                                       err_msg=name)
            for key in METRICS:
                assert res["metrics"][key] == pytest.approx(fsdp["metrics"][key], abs=1e-5), \
                    (name, key)
                assert res["metrics"][key] == ranks[0]["metrics"][key], (name, key)
    assert 0 < fsdp["metrics"]["clip_frac"] < 1 and fsdp["metrics"]["kl"] > 0
    np.testing.assert_allclose(reference["ref_logp"], fsdp["logp"], rtol=0, atol=1e-5)


@needs_megatron
@pytest.mark.timeout(400)
def test_gradients_match_fsdp(reference, tp2, pp2, dp2):
    fsdp_grads = reference["fsdp"]["grads"]
    assert "lm_head.weight" not in fsdp_grads
    for name, ranks in _runs(reference, tp2, pp2, dp2).items():
        grads = ranks[0]["grads"]
        if grads is None:  # the distributed optimizer keeps reduced gradient shards only
            continue
        assert set(grads) == set(fsdp_grads), name
        for key, g in fsdp_grads.items():
            torch.testing.assert_close(grads[key], g, rtol=0, atol=1e-6, msg=f"{name} {key}")
        assert all(r["grads"] == {} for r in ranks[1:]), name


@needs_megatron
@pytest.mark.timeout(400)
def test_observation_tokens_are_left_out_as_in_fsdp(reference, pp2):
    """A multi-turn batch (observation tokens, loss_mask 0): Megatron at TP1 and PP2 gives FSDP's
    log-probs (0 at the observations) and gradients (FSDP's are checked against plain transformers
    in test_fsdp_trainer)."""
    fsdp = reference["fsdp_obs"]
    for name, res in (("tp1", reference["tp1"]["obs"]), *((f"pp2 rank {r}", x["obs"]) for r, x in enumerate(pp2))):
        np.testing.assert_allclose(res["obs_logp"], fsdp["obs_logp"], rtol=0, atol=1e-5, err_msg=name)
        assert res["obs_metrics"]["num_tokens"] == fsdp["obs_metrics"]["num_tokens"], name
        assert res["obs_metrics"]["loss"] == pytest.approx(fsdp["obs_metrics"]["loss"], abs=1e-5), name
        if res["obs_grads"]:  # rank 0 holds the full gradients
            for key, g in fsdp["obs_grads"].items():
                torch.testing.assert_close(res["obs_grads"][key], g, rtol=0, atol=1e-6, msg=f"{name} {key}")


@needs_megatron
@pytest.mark.timeout(400)
def test_one_step_matches_fsdp(setup, reference, tp2, pp2, dp2):
    """One optimizer step (Adam, weight decay, gradient clipping at norm 1) leaves the same
    weights. Adam's first step moves each weight by about lr whatever the gradient's size,
    so weights whose gradient is near Adam's eps amplify float32 rounding differences by
    about lr / eps: lr is kept at 1e-4 so that this stays well under the tolerance."""
    fsdp = reference["fsdp"]
    initial = initial_weights(setup["path"])
    for key, w in fsdp["weights1"].items():  # the step really moved every tensor
        assert np.abs(w - initial[key]).max() > 5 * 1e-5, key
    assert fsdp["step_metrics"]["grad_norm"] > 1.0  # so clip_grad = 1 really clipped
    for name, ranks in _runs(reference, tp2, pp2, dp2).items():
        for res in ranks:
            step = res["step_metrics"]
            assert step["grad_norm"] == pytest.approx(fsdp["step_metrics"]["grad_norm"],
                                                      rel=1e-5), name
            assert step["lr"] == fsdp["step_metrics"]["lr"] == LR, name
            assert step["loss"] == pytest.approx(res["metrics"]["loss"], abs=1e-7), name
        weights = ranks[0]["weights1"]
        assert set(weights) == set(fsdp["weights1"]), name
        for key, w in fsdp["weights1"].items():
            np.testing.assert_allclose(weights[key], w, rtol=0, atol=1e-5, err_msg=f"{name} {key}")


@needs_megatron
@pytest.mark.timeout(400)
def test_non_default_loss_and_schedule_match_fsdp(reference, pp2, dp2):
    """GSPO + seq-mean-token-sum-norm + dual clip + low_var_kl + a filtered sample + a
    warmup/linear schedule: metrics, gradients, learning rates and two steps match FSDP."""
    fsdp = reference["fsdp_alt"]
    assert fsdp["metrics"]["clip_frac_lower"] > 0 and fsdp["metrics"]["clip_frac"] > 0
    assert [s["lr"] for s in fsdp["steps"]] == [3e-5, LR]
    runs = {"tp1": [reference["tp1"]["alt"]], "pp2": [r["alt"] for r in pp2],
            "dp2-distopt": [r["alt"] for r in dp2]}
    for name, ranks in runs.items():
        for res in ranks:
            for key in ("loss", "policy_loss", "kl", "entropy", "clip_frac", "clip_frac_lower"):
                assert res["metrics"][key] == pytest.approx(fsdp["metrics"][key], abs=1e-5), \
                    (name, key)
            for got, want in zip(res["steps"], fsdp["steps"]):
                assert got["lr"] == want["lr"], name
                assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), name
        if ranks[0]["grads"] is not None:
            for key, g in fsdp["grads"].items():
                torch.testing.assert_close(ranks[0]["grads"][key], g, rtol=0, atol=1e-6,
                                           msg=f"{name} {key}")
        for key, w in fsdp["weights"].items():
            np.testing.assert_allclose(ranks[0]["weights"][key], w, rtol=0, atol=1e-5,
                                       err_msg=f"{name} {key}")


@needs_megatron
@pytest.mark.timeout(400)
def test_checkpoint_resumes_bit_for_bit(pp2, dp2):
    """PP=2 (Adam state on two stages) and DP=2 with the distributed optimizer (sharded Adam
    state): a fresh trainer that loads the checkpoint takes exactly the same next step."""
    for name, ranks in (("pp2", pp2), ("dp2-distopt", dp2)):
        for res in ranks:
            assert res["resume_got"] == res["resume_expected"], name
            assert res["resume_got"]["grad_norm"] > 0, name
        assert ranks[0]["resume_weights_equal"], name


def test_checkpoint_metadata_is_checked(tmp_path):
    """A checkpoint loads only when complete, of this format, and of the same layout."""
    from chatlearn.checkpoint import sharded
    from chatlearn.checkpoint import megatron_format as fmt
    from chatlearn.errors import UserError

    layout = {"world_size": 2, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
              "use_distributed_optimizer": False, "dtype": "float32"}
    fmt.write_meta(str(tmp_path), layout)
    with pytest.raises(UserError, match="incomplete"):
        fmt.read_meta(str(tmp_path), layout)
    sharded.mark_complete(str(tmp_path))
    assert fmt.read_meta(str(tmp_path), layout)["format"] == fmt.FORMAT
    with pytest.raises(UserError, match="tensor_model_parallel_size 2 .now 1."):
        fmt.read_meta(str(tmp_path), {**layout, "tensor_model_parallel_size": 1})
    sharded.write_meta(str(tmp_path), layout)  # the FSDP trainer's format
    with pytest.raises(UserError, match="another training backend"):
        fmt.read_meta(str(tmp_path), layout)


@needs_megatron
@pytest.mark.timeout(400)
def test_offload_frees_storage_and_onload_restores_bit_for_bit(tp2):
    for res in tp2[0]:
        assert res["num_states"] > 0  # Adam moments exist after the step
        assert res["offload_bytes"] == res["expected_bytes"] > 0
        assert res["weight_bytes_live"] == res["state_bytes_live"] == res["grad_bytes_live"] == 0
        assert res["again_bytes"] == 0 and res["refused"]
        assert res["onload_bytes"] == res["offload_bytes"] and res["grad_bytes_back"] > 0
        assert res["logp_equal"] and res["weights_equal"] and res["states_equal"]
        assert np.isfinite(res["after_onload"]["loss"])


@needs_megatron
@pytest.mark.timeout(400)
def test_trainer_leaves_cuda_device_max_connections_to_the_environment(tp2):
    """CUDA reads CUDA_DEVICE_MAX_CONNECTIONS when it starts: the worker's environment sets
    it (chatlearn.runtime.cluster.worker_env); the trainer only checks it on CUDA and never writes it."""
    for res in tp2[0]:
        before, after = res["max_connections_env"]
        assert after == before


@needs_megatron
@pytest.mark.timeout(400)
def test_ref_policy_is_frozen(reference):
    assert not reference["ref_requires_grad"] and reference["ref_train_refused"]
    assert reference["ref_offload"] == reference["ref_onload"] > 0
    assert np.array_equal(reference["ref_logp_after_onload"], reference["ref_logp"])


@needs_megatron
@pytest.mark.timeout(400)
def test_save_hf_loads_in_transformers(setup, tp2):
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (r0, _), out = tp2
    saved = out / "saved"
    state = load_file(saved / "model.safetensors")
    assert set(state) == set(r0["saved_weights"])
    for key, w in r0["saved_weights"].items():
        assert np.array_equal(state[key], w), key
    logp, _ = hf_logprobs(str(saved), setup["batch"], TEMPERATURE)
    np.testing.assert_allclose(r0["saved_logp"], logp, rtol=0, atol=1e-5)
    model = AutoModelForCausalLM.from_pretrained(saved)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(saved)
    assert tok.apply_chat_template([{"role": "user", "content": "1+1"}], tokenize=False)



@needs_megatron
@pytest.mark.timeout(400)
def test_merge_turns_megatron_checkpoints_into_hf_folders(setup, tp2, pp2_run, tmp_path):
    """``chatlearn merge`` of Megatron checkpoints: TP=2 (tied; untied with the vocabulary
    padded to 322 rows) and PP=2 (tied, the layers on two stages) give the trainer's exported
    weights exactly, and a model that transformers loads with the same logits."""
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from chatlearn.checkpoint.merge import merge_checkpoint

    (tp2_ranks, tp2_out), (pp2_ranks, pp2_out) = tp2, pp2_run
    cases = [  # (checkpoint, source model, the weights the trainer exported at that point,
        #         whether training moved them away from the source model's)
        ("tp2", tp2_out / "checkpoint", setup["path"], tp2_ranks[0]["saved_weights"], True),
        ("tp2-untied", tp2_out / "untied_checkpoint", setup["untied"],
         tp2_ranks[0]["untied"]["weights0"], False),  # frozen
        ("pp2", pp2_out / "checkpoint", setup["path"], pp2_ranks[0]["weights1"], True),
    ]
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(0))
    for name, ckpt, source, exported, trained in cases:
        out = tmp_path / name
        summary = merge_checkpoint(str(ckpt), str(out), max_shard_size="100KB")
        assert summary["num_tensors"] == len(exported) and len(summary["shards"]) > 1, name
        merged = {}
        for shard in summary["shards"]:
            merged.update(load_file(out / shard))
        assert set(merged) == set(exported), name
        for key, w in exported.items():
            assert merged[key].dtype == np.float32 and np.array_equal(merged[key], w), (name, key)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        reference.load_state_dict({k: torch.from_numpy(v) for k, v in exported.items()},
                                  strict=False)
        with torch.no_grad():
            got, want = model(ids).logits, reference(ids).logits
            initial = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)(ids).logits
        assert torch.equal(want, initial) != trained, name
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)
    from chatlearn.errors import UserError

    with pytest.raises(UserError, match="does not match the model of .*embed_tokens"):
        # the tied model's checkpoint against the untied model (other vocabulary, lm_head)
        merge_checkpoint(str(tp2_out / "checkpoint"), str(tmp_path / "wrong"),
                         hf_config=setup["untied"])
    assert not (tmp_path / "wrong").exists()
    # a rank's shard cut short (no manifest: a checkpoint copied out of its run folder)
    cut = tmp_path / "cut"
    shutil.copytree(tp2_out / "checkpoint", cut)
    shard = sorted(cut.glob("*.safetensors"))[-1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    with pytest.raises(UserError, match=f"the shard of rank 1, .*{shard.name}, is .* bytes, but its header "
                                        "places .*truncated.*The checkpoint is damaged"):
        merge_checkpoint(str(cut), str(tmp_path / "cut_out"))
    assert not (tmp_path / "cut_out").exists()


# --------------------------------------------------------------------------- sequence packing
# The ragged batch of test_packing (sample lengths 12 13 11 12 | 3 2 4 3, at most 16 tokens a
# bin). One replica (TP=2, PP=2) packs the eight samples into the bins [13+3, 12+4, 12+3,
# 11+2] (first-fit decreasing, by hand); with DP=2 replica 0 gets four bins of one sample
# each and replica 1 one bin of four samples, so replica 1 runs three dummy micro-steps.

PACKING_LAYOUTS = {  # name: (world, the Megatron trainers' keys)
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "tp2-sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2, gradient_checkpointing=True)),
    "dp2": (2, {}),
}
PACKING_JOBS = {"tp2": ("tp2", "tp2-sp"), "pp2": ("pp2",), "dp2": ("dp2",)}
# position ids that restart inside one causally attended row: rotary angles must follow them
ROPE_POSITIONS = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]


def _packing_pass(trainer, batch) -> dict:
    """Log-probs and entropy, the training micro-batches, gradients, then one step."""
    logp, ent = trainer.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
    stats = trainer.logprob_stats()
    micro, _ = trainer._micro_batches(batch, trainer.spec.train_micro_batch_size)
    metrics = trainer.compute_grads(batch, TEMPERATURE)
    grads = trainer.full_grads()
    trainer.zero_grad()
    step = trainer.train(batch, TEMPERATURE)
    weights, _ = _exported(trainer)
    return {"logp": logp, "entropy": ent, "logprob_stats": stats, "metrics": metrics,
            "shapes": [tuple(m.ids.shape) if hasattr(m, "ids") else len(m) for m in micro],
            "samples": [[int(i) for i in (m.samples if hasattr(m, "samples") else m)]
                        for m in micro],
            "step": step, "grads": grads if trainer.rank == 0 else None,
            "weights": weights if trainer.rank == 0 else None}


def job_packing(rank, world, setup, out, job):
    """Padded and packed Megatron passes for each layout of ``job`` (and, for DP=2, the
    packed FSDP trainer on the same two ranks)."""
    from megatron_shim import cpu_device_shim
    from test_packing import FIXED_WIDTH, MAX_TOKENS

    path, batch = setup["path"], setup["ragged"]
    common = dict(train_micro_batch_size=2, logprob_micro_batch_size=3,
                  max_token_in_packing=MAX_TOKENS)
    res = {}
    if job == "dp2":
        from chatlearn.models.trainer.fsdp import FSDPTrainer

        res["fsdp"] = _packing_pass(FSDPTrainer(trainer_spec(path, lr=LR, packing=True, **common)),
                                    batch)
    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        for name in PACKING_JOBS[job]:
            keys = PACKING_LAYOUTS[name][1]
            res[name] = {mode: _packing_pass(MegatronTrainer(megatron_spec(
                path, packing=mode == "packed", seq_length=FIXED_WIDTH if mode == "fixed" else None,
                **common, **keys)), batch)
                for mode in ("padded", "packed", "fixed")}
        if job == "dp2":  # the model's logits for ROPE_POSITIONS, with Megatron's causal mask
            frozen = MegatronTrainer(megatron_spec(path, trainable=False))
            ids = torch.arange(3, 3 + len(ROPE_POSITIONS))[None]
            with torch.no_grad():
                res["rope_logits"] = frozen.gpt(
                    input_ids=ids, position_ids=torch.tensor([ROPE_POSITIONS]),
                    attention_mask=None)[0].numpy()
    return res


@pytest.fixture(scope="module")
def packing_setup(setup):
    from test_packing import make_batch as make_ragged_batch
    from transformers import AutoConfig

    conf = AutoConfig.from_pretrained(setup["path"])
    batch = make_ragged_batch(conf.vocab_size)
    # no pad token in the text: transformers' embedding (padding_idx) gives its row no
    # gradient, Megatron's does, which is no matter of packing
    batch["tokens"][batch["tokens"] == conf.pad_token_id] = conf.pad_token_id + 1
    logp, _ = hf_logprobs(setup["path"], batch)
    return {**setup, "ragged": add_logprobs(batch, logp)}


@pytest.fixture(scope="module")
def packing_runs(packing_setup, tmp_path_factory) -> dict:
    """name -> per-rank results, every layout; "fsdp": the FSDP trainer's (DP=2)."""
    runs = {}
    for job in PACKING_JOBS:
        out = tmp_path_factory.mktemp(f"packing_{job}")
        ranks = run_ranks(job_packing, 2, out, packing_setup, str(out), job, timeout=300)
        for name in PACKING_JOBS[job]:
            runs[name] = [r[name] for r in ranks]
        if job == "dp2":
            runs["fsdp"] = [r["fsdp"] for r in ranks]
            runs["dp2-rope"] = [r["rope_logits"] for r in ranks]
    return runs


def _assert_pass_close(got: dict, want: dict, name: str, full: bool) -> None:
    np.testing.assert_allclose(got["logp"], want["logp"], rtol=0, atol=1e-5, err_msg=name)
    np.testing.assert_allclose(got["entropy"], want["entropy"], rtol=0, atol=1e-5, err_msg=name)
    for key in METRICS:
        for part in ("metrics", "step"):
            assert got[part][key] == pytest.approx(want[part][key], abs=1e-5), (name, part, key)
    assert got["step"]["grad_norm"] == pytest.approx(want["step"]["grad_norm"], rel=1e-5), name
    if full:  # rank 0 holds the gradients and weights
        assert got["grads"].keys() == want["grads"].keys(), name
        for key, g in want["grads"].items():
            torch.testing.assert_close(got["grads"][key], g, rtol=0, atol=1e-5, msg=f"{name} {key}")
        assert got["weights"].keys() == want["weights"].keys(), name
        for key, w in want["weights"].items():
            np.testing.assert_allclose(got["weights"][key], w, rtol=0, atol=1e-5,
                                       err_msg=f"{name} {key}")


@needs_megatron
@pytest.mark.timeout(1200)
def test_megatron_packed_matches_padded_transformers_and_fsdp_packed(packing_setup, packing_runs):
    """Packed vs padded Megatron passes (log-probs, entropy, loss metrics, gradients, one
    step) for TP=2, TP=2 with sequence parallelism, PP=2 and DP=2; packed vs plain
    transformers (one sample at a time) and vs the FSDP trainer's packed passes."""
    ref_logp, ref_ent = hf_logprobs(packing_setup["path"], packing_setup["ragged"], TEMPERATURE)
    fsdp = packing_runs["fsdp"]
    np.testing.assert_allclose(fsdp[0]["logp"], ref_logp, rtol=0, atol=1e-5)
    for name in PACKING_LAYOUTS:
        for rank, res in enumerate(packing_runs[name]):
            packed, padded = res["packed"], res["padded"]
            np.testing.assert_allclose(packed["logp"], ref_logp, rtol=0, atol=1e-5, err_msg=name)
            np.testing.assert_allclose(packed["entropy"], ref_ent, rtol=0, atol=1e-5,
                                       err_msg=name)
            _assert_pass_close(packed, padded, f"{name} packed vs padded", full=rank == 0)
            _assert_pass_close(packed, fsdp[rank], f"{name} packed vs fsdp packed",
                               full=rank == 0)
        grads = packing_runs[name][0]["packed"]["grads"]
        assert all(g.abs().max() > 0 for k, g in grads.items() if "embed" not in k), name


@needs_megatron
@pytest.mark.timeout(1200)
def test_megatron_packed_micro_batches_and_padding_share(packing_runs):
    """One row per bin; PP pads every row (dummy rows too) to the replica's longest bin, SP
    to a multiple of TP; the padding share counts exactly those padding tokens."""
    from test_packing import FIXED_WIDTH
    bins = [[1, 4], [0, 6], [3, 7], [2, 5]]  # one replica: 16, 16, 15 and 13 tokens
    expected = {  # name: (per rank: shapes of the training micro-batches, pad_token_frac)
        "tp2": ([[(1, 16), (1, 16), (1, 15), (1, 13)]] * 2, 0.0),
        "tp2-sp": ([[(1, 16), (1, 16), (1, 16), (1, 14)]] * 2, 1 - 60 / 62),
        "pp2": ([[(1, 16)] * 4] * 2, 1 - 60 / 64),
        "dp2": ([[(1, 13), (1, 12), (1, 12), (1, 11)], [(1, 12), (1, 1), (1, 1), (1, 1)]], 0.0),
    }
    for name, (shapes, pad) in expected.items():
        for rank, res in enumerate(packing_runs[name]):
            packed = res["packed"]
            assert packed["shapes"] == shapes[rank], name
            if name != "dp2":
                assert packed["samples"] == bins, name
            for stats in (packed["metrics"], packed["logprob_stats"]):
                assert stats["pad_token_frac"] == pytest.approx(pad, abs=1e-12), name
                assert stats["micro_steps"] == 4.0, name
            assert res["padded"]["metrics"]["pad_token_frac"] > pad, name
            # seq_length: unpacked micro-batches of train_micro_batch_size (2) rows, each exactly
            # FIXED_WIDTH wide; same values as per-micro-batch padding
            fixed = res["fixed"]
            assert {w for _, w in fixed["shapes"]} == {FIXED_WIDTH}, name
            _assert_pass_close(fixed, res["padded"], f"{name} fixed width vs padded", full=rank == 0)
    assert [r["packed"]["samples"] for r in packing_runs["dp2"]] == [
        [[1], [0], [3], [2]], [[4, 5, 6, 7], [], [], []]]


@needs_megatron
@pytest.mark.timeout(1200)
def test_megatron_rotary_embedding_follows_position_ids(packing_setup, packing_runs):
    """Rotary angles follow the position ids (megatron-core's own "rope" uses 0 .. s-1):
    with restarting position ids and one causal row, the logits are transformers' for the
    same position ids (attention mask of ones: no sample boundaries), which differ from
    those of positions 0 .. s-1. (Under the block-diagonal mask a per-sample shift of the
    positions changes nothing but rounding, RoPE being relative.)"""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(packing_setup["path"], dtype=torch.float32).eval()
    ids = torch.arange(3, 3 + len(ROPE_POSITIONS))[None]
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=torch.tensor([ROPE_POSITIONS]),
                     attention_mask=torch.ones_like(ids), use_cache=False).logits[0].numpy()
        plain = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                      use_cache=False).logits[0].numpy()
    assert np.abs(want - plain).max() > 1e-3
    for res in packing_runs["dp2-rope"]:
        np.testing.assert_allclose(res[:, :want.shape[1]], want, rtol=0, atol=1e-5)


@needs_megatron
@pytest.mark.timeout(400)
def test_teacher_argmax_agreement_is_gathered_over_tensor_parallel_ranks(setup, reference, tp2):
    """The teacher's argmax agreement (with_entropy TOP1) on Megatron with the vocabulary split over 2
    tensor-parallel ranks equals TP 1's exactly, on every rank, and plain transformers' argmax (but for a near tie
    between Megatron's and transformers' forwards), beside the same log-probs."""
    from test_fsdp_trainer import hf_top1

    top1 = hf_top1(setup["path"], setup["batch"])
    assert 0 < top1.sum()
    logp, _ = hf_logprobs(setup["path"], setup["batch"], TEMPERATURE)
    tp1 = reference["tp1"]["top1"][1]
    assert tp1.sum() > 0 and (tp1 != top1).sum() <= 1  # Megatron's forward vs transformers': a near tie may flip
    for res in (reference["tp1"], *tp2[0]):
        np.testing.assert_array_equal(res["top1"][1], tp1)  # TP 2 = TP 1 exactly, on every rank
        np.testing.assert_allclose(res["top1"][0], logp, rtol=0, atol=1e-5)
