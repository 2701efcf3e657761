"""FSDPTrainer as the PPO critic (role critic) on CPU (gloo): the value loss against its formula,
2 ranks vs 1 rank, the values against plain transformers' token-classification forward, training
toward fixed returns, checkpoints (resumed bit for bit) and save_hf.

Two jobs run once per module (2 ranks and 1 rank, spawned processes with a hard deadline, as in
test_fsdp_trainer.py); the tests compare what they return.
"""
from __future__ import annotations

import os
import shutil
import time

import backend_specs
import numpy as np
import pytest
import torch
from test_fsdp_trainer import make_batch, make_tiny_model, run_ranks, trainer_spec, with_observations
from test_shared_prompt import grouped_batch

from chatlearn.algorithms.grpo import GRPOLoss, sample_loss_coefficients
from chatlearn.algorithms.value_loss import VALUE_SUMS, ValueLoss
from chatlearn.models.base import loss_token_counts, response_mask, response_positions

CLIP = 0.2  # cliprange_value of the trainer tests
COEF = 0.5  # value_loss_coef
# sample 1 (on rank 0 of 2) filtered: the ranks keep different numbers of sequences and tokens
SAMPLE_WEIGHTS = np.array([1, 0, 1, 1, 1, 1, 1, 1], np.float32)
VALUE_METRICS = ("loss", "value_loss", "value_clip_frac", "values_mean", "value_error", "num_tokens")


def critic_spec(path: str, **over):
    """The critic's spec of the model at ``path`` (the FSDP tests' settings, clipped value loss)."""
    return trainer_spec(path, **{"role": "critic", "cliprange_value": CLIP, "value_loss_coef": COEF, **over})


def value_columns(batch: dict, values: np.ndarray, seed: int = 5) -> dict:
    """The batch with ``values`` (V_old: ``values`` moved by N(0, 0.3), so that a clip range of 0.2
    clips some tokens) and ``returns`` (N(0, 1)) on its response tokens, 0 elsewhere."""
    rng = np.random.default_rng(seed)
    mask = response_mask(batch)
    old = np.where(mask, values + rng.normal(0, 0.3, len(mask)), 0).astype(np.float32)
    returns = np.where(mask, rng.normal(0, 1, len(mask)), 0).astype(np.float32)
    return dict(batch, values=old, returns=returns)


# --------------------------------------------------------------------------- the loss alone


def reference_value_loss(batch: dict, v: np.ndarray, mode: str, clip: float | None, coef: float) -> dict:
    """The critic's loss and metrics token by token in plain python (float64)."""
    lens = loss_token_counts(batch)
    w = GRPOLoss.sample_weights(batch)
    c = sample_loss_coefficients(mode, lens, w, 16)
    loss = clipped = values = error = kept = 0.0
    for i in range(len(lens)):
        for p in response_positions(batch, i):
            t = int(batch["offsets"][i]) + int(p)
            old, ret = float(batch["values"][t]), float(batch["returns"][t])
            vt = float(v[t])
            l1 = (vt - ret) ** 2
            l2 = (min(max(vt, old - clip), old + clip) - ret) ** 2 if clip is not None else l1
            loss += c[i] * coef * max(l1, l2)
            clipped += w[i] * (l2 > l1)
            values += w[i] * vt
            error += w[i] * l1
            kept += w[i]
    return {"value_loss": loss, "value_clip_frac": clipped / kept, "values_mean": values / kept,
            "value_error": error / kept, "num_tokens": float(lens.sum())}


def run_value_loss(spec, batch: dict, v: np.ndarray, pieces: int = 2):
    """The metrics of ValueLoss over the batch's response tokens cut into ``pieces`` micro-batches,
    and d(loss)/dV per token."""
    objective = ValueLoss(spec, batch, torch.device("cpu"))
    pos = np.concatenate([int(batch["offsets"][i]) + response_positions(batch, i)
                          for i in range(len(batch["prompt_lens"]))])
    grad = np.zeros(len(v))
    sums = torch.zeros(len(objective.SUMS), dtype=torch.float64)
    for part in np.array_split(pos, pieces):
        values = torch.tensor(v[part], dtype=torch.float32, requires_grad=True)
        terms, c, weight = objective.terms(values, None, part)
        (terms["loss"] * c).sum().backward()
        grad[part] = values.grad.numpy()
        sums += objective.token_sums(terms, c, weight, None)
    return objective.metrics(sums.tolist(), None, None), grad


@pytest.mark.parametrize("clip", [CLIP, None])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_matches_its_formula(clip, mode):
    """l = coef * max((V - R)^2, (V_old + clamp(V - V_old, +-clip) - R)^2), aggregated by the mode's
    c_i over micro-batches, equals the per-token python computation; so do the metrics; the gradient
    is c_i * coef * 2 (V - R) where the unclipped term is the larger, 0 where the clipped one is."""
    batch = make_batch(50, n=6, seed=2)
    rng = np.random.default_rng(0)
    batch = value_columns(dict(batch, sample_weights=np.array([1, 1, 0, 1, 1, 1], np.float32)),
                          np.zeros(len(batch["tokens"])))
    v = np.where(response_mask(batch), batch["values"] + rng.normal(0, 0.4, len(batch["tokens"])), 0)
    spec = backend_specs.trainer_spec(role="critic", cliprange_value=clip, value_loss_coef=COEF, loss_agg_mode=mode)
    got, grad = run_value_loss(spec, batch, v.astype(np.float32))
    want = reference_value_loss(batch, v.astype(np.float32), mode, clip, COEF)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert got["loss"] == got["value_loss"] and set(VALUE_SUMS) == {"loss", "value_clipped", "values", "value_error"}
    if clip is None:
        assert got["value_clip_frac"] == 0.0
    else:
        assert 0 < got["value_clip_frac"] < 1
    c = sample_loss_coefficients(mode, loss_token_counts(batch), GRPOLoss.sample_weights(batch), 16)
    sample = np.repeat(np.arange(6), np.diff(batch["offsets"]))
    v32, old, ret = v.astype(np.float32), batch["values"], batch["returns"]
    l1 = (v32 - ret) ** 2
    l2 = (np.clip(v32, old - np.float32(clip), old + np.float32(clip)) - ret) ** 2 if clip is not None else l1
    expected = np.where(response_mask(batch) & ~(l2 > l1), c[sample] * COEF * 2 * (v32 - ret), 0)
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)


def test_value_loss_leaves_out_observation_tokens():
    """A multi-turn batch: the tokens of ``loss_mask`` 0 have no loss, no gradient and no share in the
    token counts (token-mean divides by the model's tokens alone)."""
    batch = make_batch(50, n=6, seed=3)
    batch = with_observations(dict(batch, old_logprobs=np.zeros(len(batch["tokens"]), np.float32),
                                   ref_logprobs=np.zeros(len(batch["tokens"]), np.float32)))
    batch = value_columns(batch, np.zeros(len(batch["tokens"])), seed=7)
    v = (batch["values"] + np.random.default_rng(1).normal(0, 0.4, len(batch["tokens"]))).astype(np.float32)
    spec = backend_specs.trainer_spec(role="critic", cliprange_value=CLIP, value_loss_coef=COEF)
    got, grad = run_value_loss(spec, batch, v, pieces=3)
    mask = batch["loss_mask"].astype(bool)
    assert got["num_tokens"] == mask.sum() < (np.diff(batch["offsets"]) - batch["prompt_lens"]).sum()
    want = reference_value_loss(batch, v, "token-mean", CLIP, COEF)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    assert np.all(grad[~mask] == 0) and np.any(grad[mask] != 0)


def test_value_loss_needs_values_and_returns():
    batch = make_batch(50, n=2)
    spec = backend_specs.trainer_spec(role="critic")
    for drop in ("values", "returns"):
        columns = {k: v for k, v in value_columns(batch, np.zeros(len(batch["tokens"]))).items() if k != drop}
        with pytest.raises(ValueError, match=drop):
            ValueLoss(spec, columns, torch.device("cpu"))


# --------------------------------------------------------------------------- rank jobs


def _parity_part(trainer, batch: dict, out: str) -> dict:
    """Values, gradients (before any step), one step and the values after it; then a checkpoint,
    another step, the checkpoint loaded and the same step again; save_hf."""
    v0 = trainer.compute_values(batch)
    b = value_columns(dict(batch, sample_weights=SAMPLE_WEIGHTS), v0)
    metrics = trainer.compute_grads(b)
    grads = trainer.full_grads()
    trainer.zero_grad()
    res = {"values": v0, "metrics": metrics, "grads": grads if trainer.rank == 0 else None,
           "step": trainer.train(b), "after_step": trainer.compute_values(batch), "sharded": trainer.sharded}
    ckpt = os.path.join(out, "critic_checkpoint")
    trainer.save_checkpoint(ckpt)
    res["second_step"] = trainer.train(b)
    res["after_second"] = trainer.compute_values(batch)
    trainer.load_checkpoint(ckpt)
    res["loaded"] = trainer.compute_values(batch)
    res["second_step_again"] = trainer.train(b)
    res["after_second_again"] = trainer.compute_values(batch)
    trainer.save_hf(os.path.join(out, "critic_hf"))
    try:
        trainer.compute_logprobs(batch)
        res["logprobs_refused"] = False
    except RuntimeError:
        res["logprobs_refused"] = True
    return res


def job_two_ranks(rank, world, path, batch, out):
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    res = _parity_part(FSDPTrainer(critic_spec(path)), batch, out)
    res["meta_init_values"] = FSDPTrainer(critic_spec(path, meta_init=True)).compute_values(batch)
    return res


def _training_part(path, batch) -> dict:
    """A few steps toward fixed random returns (V_old refreshed before each step, as PPO's critic
    update does): the value error of each step, and the final one."""
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    trainer = FSDPTrainer(critic_spec(path, lr=3e-4))
    b = value_columns(batch, np.zeros(len(batch["tokens"])), seed=9)
    errors = []
    for _ in range(4):
        b["values"] = trainer.compute_values(batch)
        errors.append(trainer.train(b)["value_error"])
    v = trainer.compute_values(batch)
    mask = response_mask(batch)
    errors.append(float(np.mean((v[mask].astype(np.float64) - b["returns"][mask]) ** 2)))
    return {"errors": errors}


def _variants_part(path, batch, grouped, out) -> dict:
    """The values and gradients with packing and with a shared prompt (a grouped batch) against the
    plain padded pass; a policy model refuses compute_values, and its checkpoint does not load into
    a critic."""
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    res = {}
    for name, over, b in (("plain", {}, batch), ("packed", dict(packing=True), batch),
                          ("grouped_plain", {}, grouped), ("grouped_shared", dict(share_prompt=True), grouped)):
        t = FSDPTrainer(critic_spec(path, **over))
        v = t.compute_values(b)
        res[f"{name}_values"] = v
        res[f"{name}_metrics"] = t.compute_grads(value_columns(b, v))
        res[f"{name}_grads"] = t.full_grads()
        res[f"{name}_shares"] = t.share_prompt
    policy = FSDPTrainer(trainer_spec(path))
    try:
        policy.compute_values(batch)
        res["policy_values_refused"] = False
    except RuntimeError:
        res["policy_values_refused"] = True
    from chatlearn.errors import UserError

    policy.save_checkpoint(os.path.join(out, "policy_checkpoint"))
    try:
        t.load_checkpoint(os.path.join(out, "policy_checkpoint"))
        res["policy_checkpoint_error"] = None
    except UserError as err:
        res["policy_checkpoint_error"] = str(err)
    # the critic's checkpoint with its shards' bytes overwritten in place (their sizes kept)
    damaged = os.path.join(out, "critic_damaged")
    shutil.copytree(os.path.join(out, "critic_checkpoint"), damaged)
    for name in os.listdir(damaged):
        if name.endswith(".distcp"):
            with open(os.path.join(damaged, name), "r+b") as f:
                f.write(b"\0" * os.path.getsize(os.path.join(damaged, name)))
    try:
        t.load_checkpoint(damaged)
        res["damaged_error"] = None
    except BaseException as err:  # noqa: BLE001 - what kind of error it is, is the point (DCP's is a BaseException)
        res["damaged_error"] = (type(err).__name__, str(err))
    return res


def job_one_rank(rank, world, path, batch, grouped, out):
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    res = _parity_part(FSDPTrainer(critic_spec(path)), batch, out)
    res.update(_training_part(path, batch))
    res.update(_variants_part(path, batch, grouped, out))
    return res


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoConfig

    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    vocab = AutoConfig.from_pretrained(path).vocab_size
    return {"path": path, "batch": make_batch(vocab), "grouped": grouped_batch(vocab, groups=2, per_group=3)}


@pytest.fixture(scope="module")
def two(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("two")
    t0 = time.monotonic()
    results = run_ranks(job_two_ranks, 2, out, setup["path"], setup["batch"], str(out))
    print(f"2-rank critic job: {time.monotonic() - t0:.1f}s")
    return results, out


@pytest.fixture(scope="module")
def one(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    return run_ranks(job_one_rank, 1, out, setup["path"], setup["batch"], setup["grouped"], str(out))[0], out


def hf_values(model, batch: dict) -> np.ndarray:
    """Reference: plain transformers' token-classification forward per sample (no FSDP, no padding),
    the value of token p the score of position p - 1."""
    values = np.zeros(len(batch["tokens"]), np.float32)
    off, plen = batch["offsets"], batch["prompt_lens"]
    with torch.no_grad():
        for i in range(len(plen)):
            ids = torch.from_numpy(batch["tokens"][off[i]:off[i + 1]])
            scores = model(input_ids=ids[None]).logits[0, :, 0]
            for p in range(int(plen[i]), len(ids)):
                values[off[i] + p] = scores[p - 1]
    return values


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(240)
def test_values_match_plain_transformers(setup, two, one):
    """compute_values is the score head on the hidden state before each response token (0
    elsewhere), the same on 1 and 2 ranks; the value head is initialised from ``seed`` as
    ``from_pretrained(num_labels=1)`` after ``torch.manual_seed(seed)`` initialises it."""
    from transformers import AutoModelForTokenClassification

    (r0, r1), _ = two
    one, _ = one
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(setup["path"], num_labels=1, dtype=torch.float32)
    expected = hf_values(model.eval(), setup["batch"])
    mask = response_mask(setup["batch"])
    for res in (r0, r1, one):
        assert res["values"].dtype == np.float32 and res["values"].shape == expected.shape
        np.testing.assert_allclose(res["values"], expected, rtol=0, atol=1e-5)
        assert np.all(res["values"][~mask] == 0) and np.all(res["values"][mask] != 0)
    np.testing.assert_array_equal(r0["values"], r1["values"])
    np.testing.assert_allclose(r0["values"], one["values"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(r0["meta_init_values"], r0["values"])  # rank 0 reads, the head is the same
    assert r0["sharded"] and not one["sharded"]
    assert r0["logprobs_refused"] and one["logprobs_refused"] and one["policy_values_refused"]
    assert "saved by a policy model" in one["policy_checkpoint_error"]


@pytest.mark.timeout(240)
def test_two_ranks_match_one_rank(two, one):
    """The loss metrics, the gradients, one step (with a filtered sample) and the values after it are
    the same on 2 ranks as on 1."""
    (r0, r1), _ = two
    one, _ = one
    for name in VALUE_METRICS:
        assert r0["metrics"][name] == r1["metrics"][name], name
        assert r0["metrics"][name] == pytest.approx(one["metrics"][name], abs=1e-6), name
    for name in VALUE_METRICS + ("grad_norm", "lr"):
        assert r0["step"][name] == r1["step"][name], name
        tol = {"rel": 1e-5} if name == "grad_norm" else {"abs": 1e-6}
        assert r0["step"][name] == pytest.approx(one["step"][name], **tol), name
    assert 0 < one["metrics"]["value_clip_frac"] < 1 and one["metrics"]["num_tokens"] > 0
    assert one["step"]["skipped_steps"] == 0.0 and one["step"]["loss"] == pytest.approx(one["metrics"]["loss"])
    g2, g1 = r0["grads"], one["grads"]
    assert g2.keys() == g1.keys() and {"score.weight", "score.bias"} <= g1.keys()
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=0, atol=1e-6, msg=name)
    np.testing.assert_array_equal(r0["after_step"], r1["after_step"])
    np.testing.assert_allclose(r0["after_step"], one["after_step"], rtol=0, atol=1e-5)
    assert not np.allclose(one["after_step"], one["values"], rtol=0, atol=1e-4)  # the step moved them


@pytest.mark.timeout(240)
def test_training_lowers_the_value_error(one):
    one, _ = one
    errors = one["errors"]
    assert errors[-1] < 0.8 * errors[0], errors


@pytest.mark.timeout(240)
def test_checkpoint_resumes_bit_for_bit(two, one):
    """Save, step, load: the values are the saved ones, and the same step again (the optimizer state
    restored) gives the same metrics and values bit for bit."""
    (r0, r1), _ = two
    one, _ = one
    for res in (r0, r1, one):
        np.testing.assert_array_equal(res["loaded"], res["after_step"])
        assert not np.array_equal(res["after_second"], res["after_step"])
        np.testing.assert_array_equal(res["after_second_again"], res["after_second"])
        for name in VALUE_METRICS + ("grad_norm", "lr"):
            assert res["second_step_again"][name] == res["second_step"][name], name


@pytest.mark.timeout(240)
def test_save_hf_is_a_token_classification_folder(setup, two, one):
    """save_hf's folder (2 ranks and 1) loads with AutoModelForTokenClassification, one label, and
    gives the trainer's values; the tokenizer comes along."""
    from transformers import AutoConfig, AutoModelForTokenClassification, AutoTokenizer

    (r0, _), out2 = two
    one, out1 = one
    for res, out in ((r0, out2), (one, out1)):
        folder = out / "critic_hf"
        config = AutoConfig.from_pretrained(folder)
        assert config.num_labels == 1 and config.architectures == ["Qwen2ForTokenClassification"]
        model = AutoModelForTokenClassification.from_pretrained(folder, dtype=torch.float32).eval()
        np.testing.assert_allclose(hf_values(model, setup["batch"]), res["after_second_again"], rtol=0, atol=1e-5)
        assert AutoTokenizer.from_pretrained(folder).eos_token == "<|im_end|>"


@pytest.mark.timeout(240)
def test_packing_and_shared_prompts_give_the_same_values(one):
    one, _ = one
    assert one["grouped_shared_shares"] and not one["grouped_plain_shares"]
    for a, b in (("plain", "packed"), ("grouped_plain", "grouped_shared")):
        np.testing.assert_allclose(one[f"{b}_values"], one[f"{a}_values"], rtol=0, atol=1e-5)
        for name in VALUE_METRICS:
            assert one[f"{b}_metrics"][name] == pytest.approx(one[f"{a}_metrics"][name], rel=1e-5, abs=1e-6)
        for key, g in one[f"{a}_grads"].items():
            torch.testing.assert_close(one[f"{b}_grads"][key], g, rtol=0, atol=1e-5, msg=f"{b} {key}")


@pytest.mark.timeout(240)
def test_a_damaged_critic_shard_is_one_paragraph(one):
    """A critic checkpoint whose shard bytes were overwritten in place (the manifest's sizes still match) is
    one paragraph naming the checkpoint and its shard files, not DCP's or torch.load's traceback."""
    one, out = one
    assert one["damaged_error"] is not None
    kind, text = one["damaged_error"]
    assert kind == "UserError", one["damaged_error"]
    for words in (os.path.join(str(out), "critic_damaged"), ".distcp", "is damaged", "restore it from a copy"):
        assert words in text, (words, text)
    assert "\n" not in text and "Traceback" not in text
