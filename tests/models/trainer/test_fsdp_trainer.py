"""FSDPTrainer on CPU (gloo): 2 ranks vs 1 rank, against plain transformers, residency,
weight export and the token-mean normalisation of the GRPO loss.

Two jobs run once per module (2 ranks and 1 rank, processes with a hard
deadline); the tests compare what they return.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import time
import traceback
from pathlib import Path

import backend_specs
import numpy as np
import pytest
import torch

TEMPERATURE = 0.8
JOB_TIMEOUT_S = 150

# --------------------------------------------------------------------------- helpers


def make_tiny_model(path: str) -> str:
    """tests/support/tiny_model.py's random Qwen2 folder (with a tokenizer), with the (tied)
    embeddings scaled to std 0.1 so that logits are O(1) as in a trained model: with
    std 1 log-probs are about -150 and float32 rounding alone exceeds 1e-5."""
    from transformers import AutoModelForCausalLM

    spec = importlib.util.spec_from_file_location(
        "tiny_model", Path(__file__).resolve().parents[2] / "support" / "tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_tiny_model(path, seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(0.1)
    model.save_pretrained(path)
    return path


def trainer_spec(path: str, **over):
    """The FSDP tests' :class:`~chatlearn.models.specs.TrainerSpec` of the model at ``path``."""
    fields = dict(trust_remote_code=False, seed=0, trainable=True, lr=1e-3,
                  weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, clip_grad=1.0, train_micro_batch_size=2,
                  logprob_micro_batch_size=3, pos_clip_ratio=0.2, neg_clip_ratio=0.2,
                  kl_coef=0.1, entropy_coef=0.01, gradient_checkpointing=False, bf16=False,
                  packing=False, max_token_in_packing=32768, seq_length=None,
                  logprob_chunk_tokens=5, meta_init=False, share_prompt=False,  # 5: chunks that do not divide the tokens
                  clip_ratio_c=None, policy_loss="vanilla", loss_agg_mode="token-mean",
                  max_response_tokens_length=16, kl_estimator="k3", kl_in_reward=False,
                  min_lr=0.0, lr_decay_style="constant", lr_warmup_iters=0, lr_decay_iters=100,
                  lr_warmup_init=0.0, old_logprobs="auto", rollout_correction="none",
                  rollout_correction_level="token", rollout_is_threshold=2.0, rollout_is_threshold_lower=None)
    return backend_specs.trainer_spec(path, **{**fields, **over})


def hf_logprobs(path: str, batch: dict, temperature: float = 1.0):
    """Reference: one plain transformers forward per sample (no FSDP, no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    logp = np.zeros(len(batch["tokens"]), np.float32)
    ent = np.zeros(len(batch["tokens"]), np.float32)
    off, plen = batch["offsets"], batch["prompt_lens"]
    with torch.no_grad():
        for i in range(len(plen)):
            ids = torch.from_numpy(batch["tokens"][off[i]:off[i + 1]])
            z = model(input_ids=ids[None]).logits[0].double() / temperature
            lsm = torch.log_softmax(z, -1)
            for p in range(int(plen[i]), len(ids)):
                logp[off[i] + p] = lsm[p - 1, ids[p]]
                ent[off[i] + p] = -(lsm[p - 1].exp() * lsm[p - 1]).sum()
    return logp, ent


def make_batch(vocab: int, n: int = 8, seed: int = 0) -> dict:
    """A ragged batch: prompts of 1..6 tokens, responses of 1..7 tokens."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(1, 7, n)
    rlen = rng.integers(1, 8, n)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(plen + rlen, out=offsets[1:])
    return {"tokens": rng.integers(0, vocab, int(offsets[-1])).astype(np.int64),
            "offsets": offsets, "prompt_lens": plen.astype(np.int64),
            "advantages": rng.normal(size=n).astype(np.float32)}


def add_logprobs(batch: dict, logp: np.ndarray, seed: int = 1) -> dict:
    """old/ref log-probs near the current ones (so some ratios are clipped)."""
    from chatlearn.models.base import response_mask

    rng = np.random.default_rng(seed)
    mask = response_mask(batch)
    old = np.where(mask, logp + rng.normal(0, 0.3, len(logp)), 0).astype(np.float32)
    ref = np.where(mask, logp + rng.normal(0, 0.5, len(logp)), 0).astype(np.float32)
    return dict(batch, old_logprobs=old, ref_logprobs=ref)


def probe_logits(trainer, ids: torch.Tensor) -> torch.Tensor:
    """A plain forward through the FSDP model (a collective: all ranks call it)."""
    with torch.no_grad():
        out = trainer.model(input_ids=ids, use_cache=False).logits.detach().clone()
    trainer._reshard()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(fn, rank, world, port, out, args, env):
    import rank_processes

    rank_processes.enter(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        result = fn(rank, world, *args)
    except BaseException:
        result = {"error": f"rank {rank}:\n{traceback.format_exc()}"}
    torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    import torch.distributed as dist
    if dist.is_initialized() and "error" not in result:
        dist.destroy_process_group()


def run_ranks(fn, world: int, out: Path, *args, timeout: float = JOB_TIMEOUT_S) -> list:
    """Run fn(rank, world, *args) in `world` new processes (tests/support/rank_processes.py); their
    results, by rank.

    A rank that fails makes the others be killed at once (they would wait forever in a
    collective); so does the deadline.
    """
    import rank_processes

    ctx = rank_processes.context()  # forked from a server that has imported torch & co. once
    port = _free_port()
    env = rank_processes.rank_env()
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world, port, str(out), args, env))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    failed = False
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline and not failed:
        time.sleep(0.2)
        for r, p in enumerate(procs):
            if not p.is_alive():
                file = out / f"rank{r}.pt"
                failed |= not file.exists() or "error" in torch.load(file, weights_only=False)
    timed_out = any(p.is_alive() for p in procs) and time.monotonic() >= deadline
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False)
               if (out / f"rank{r}.pt").exists() else {"error": f"rank {r}: no result"}
               for r in range(world)]
    errors = [res["error"] for res in results if "error" in res]
    if errors or timed_out:
        raise AssertionError(("timed out\n" if timed_out else "") + "\n".join(errors))
    return results


# --------------------------------------------------------------------------- rank jobs


def _parity_part(trainer, batch) -> dict:
    """Log-probs, gradients (before any step), then one real step."""
    logp, ent = trainer.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
    metrics = trainer.compute_grads(batch)
    grads = trainer.full_grads()
    trainer.zero_grad()
    step = trainer.train(batch)
    return {"logp": logp, "entropy": ent, "metrics": metrics, "step_metrics": step,
            "grads": grads if trainer.rank == 0 else None, "sharded": trainer.sharded}


def _residency_part(trainer, batch, probe) -> dict:
    """Offload weights + optimizer + grads, check the storage is gone, onload, compare."""
    from chatlearn.models.stash import _local

    def states():
        return [_local(v).clone() for s in trainer.optimizer.state.values()
                for k, v in s.items() if k != "step"]

    def fsdp_internal_bytes():  # FSDP2 internals: padded shards and all-gathered copies
        total = 0
        for m in trainer.model.modules():
            state = getattr(m, "_get_fsdp_state", None)
            for group in (state()._fsdp_param_groups if state else []):
                for fp in group.fsdp_params:
                    total += fp._sharded_param_data.untyped_storage().nbytes()
                    if hasattr(fp, "_unsharded_param"):
                        total += fp._unsharded_param.untyped_storage().nbytes()
        return total

    logits0 = probe_logits(trainer, probe)
    weights0 = [_local(p).clone() for p in trainer.model.parameters()]
    states0 = states()
    expected = sum(_local(t).untyped_storage().nbytes() for t in trainer._part_tensors("weights")
                   + trainer._part_tensors("optimizer"))
    off = trainer.offload(["weights", "optimizer", "grads"])
    res = {
        "offload_bytes": off["bytes"], "expected_bytes": expected,
        "weight_bytes_live": sum(_local(p).untyped_storage().nbytes()
                                 for p in trainer.model.parameters()),
        "state_bytes_live": sum(_local(v).untyped_storage().nbytes()
                                for s in trainer.optimizer.state.values()
                                for k, v in s.items() if k != "step"),
        "fsdp_internal_bytes_live": fsdp_internal_bytes(),
        "grads_none": all(p.grad is None for p in trainer.model.parameters()),
        "again_bytes": trainer.offload(["weights", "optimizer"])["bytes"],
    }
    try:
        trainer.compute_logprobs(batch)
        res["refused"] = False
    except RuntimeError:
        res["refused"] = True
    res["onload_bytes"] = trainer.onload(["weights", "optimizer", "grads"])["bytes"]
    res["logits_equal"] = torch.equal(probe_logits(trainer, probe), logits0)
    res["weights_equal"] = all(torch.equal(_local(p), w)
                               for p, w in zip(trainer.model.parameters(), weights0))
    res["states_equal"] = all(torch.equal(a, b) for a, b in zip(states(), states0))
    res["after_onload"] = trainer.train(batch)
    return res


def _export_part(trainer, probe, out: str) -> dict:
    buckets = list(trainer.export_weights(bucket_mb=1))
    trainer.save_hf(os.path.join(out, "saved"))
    return {"num_buckets": len(buckets),
            "bucket_sizes": [len(b) for b in buckets],
            "exported": {k: v for b in buckets for k, v in b},
            "probe_logits": probe_logits(trainer, probe)}


LR_SCHEDULE = dict(lr=1e-3, min_lr=1e-4, lr_decay_style="cosine", lr_warmup_iters=2,
                   lr_decay_iters=6, lr_warmup_init=2e-4)
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# sample 1 (on rank 0 of 2) filtered: the ranks keep different numbers of sequences and tokens
SAMPLE_WEIGHTS = np.array([1, 0, 1, 1, 1, 1, 1, 1], np.float32)


def _loss_modes_part(path, batch) -> dict:
    """Per loss_agg_mode (with dual clip, low_var_kl; GSPO for the Dr. GRPO mode): metrics
    and full gradients of one compute_grads over the batch with a filtered sample."""
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    out = {}
    for mode in AGG_MODES:
        trainer = FSDPTrainer(trainer_spec(
            path, loss_agg_mode=mode, clip_ratio_c=1.1, kl_estimator="low_var_kl",
            policy_loss="gspo" if mode == "seq-mean-token-sum-norm" else "vanilla"))
        metrics = trainer.compute_grads(dict(batch, sample_weights=SAMPLE_WEIGHTS))
        out[mode] = {"metrics": metrics, "grads": trainer.full_grads()}
    return out


def _lr_resume_part(path, batch, out) -> dict:
    """lr of 5 steps of a warmup + cosine schedule, with a checkpoint after step 3; a new
    trainer resumed from it takes steps 4 and 5; then a step on an all-filtered batch."""
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    cfg = trainer_spec(path, **LR_SCHEDULE)
    trainer = FSDPTrainer(cfg)
    lrs = [trainer.train(batch)["lr"] for _ in range(3)]
    trainer.save_checkpoint(os.path.join(out, "lr_checkpoint"))
    lrs += [trainer.train(batch)["lr"] for _ in range(2)]
    resumed = FSDPTrainer(cfg)
    resumed.load_checkpoint(os.path.join(out, "lr_checkpoint"))
    resumed_lrs = [resumed.train(batch)["lr"] for _ in range(2)]
    weights = [p.detach().clone() for p in resumed.model.parameters()]
    filtered = resumed.train(dict(batch, sample_weights=np.zeros(8, np.float32)))
    unchanged = all(torch.equal(p.detach(), w) for p, w in zip(resumed.model.parameters(), weights))
    return {"lrs": lrs, "resumed_lrs": resumed_lrs, "filtered_step": filtered,
            "filtered_unchanged": unchanged, "after_filtered_lr": resumed.train(batch)["lr"]}


def _own_old_part(path, batch) -> dict:
    """The same weights, gradients and metrics with the old log-probs of a separate pass as without
    them (the step's own forward, detached); without them, the rollout mismatch sums."""
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    trainer = FSDPTrainer(trainer_spec(path, clip_ratio_c=1.5))
    own = {k: v for k, v in batch.items() if k != "old_logprobs"}
    rollout = own["rollout_logprobs"] = batch["old_logprobs"] + np.float32(0.05)
    passed = trainer.compute_logprobs(batch, temperature=TEMPERATURE)
    with_pass = trainer.compute_grads(dict(batch, old_logprobs=passed), temperature=TEMPERATURE)
    grads_pass = trainer.full_grads()
    trainer.zero_grad()
    without = trainer.compute_grads(own, temperature=TEMPERATURE)
    return {"own_pass_metrics": with_pass, "own_pass_grads": grads_pass, "own_metrics": without,
            "own_grads": trainer.full_grads(), "own_passed": passed, "own_rollout": rollout}


def _correction_part(path, batch) -> dict:
    """Rollout corrections through the trainer: a rollout that agrees with the trainer (weights 1)
    gives the uncorrected loss and gradients; a rollout that differs gives the is_* metrics (the max
    all-reduced apart), for mis at the sequence level with the pass's old log-probs, tis with the
    step's own forward, and tis with old_logprobs: rollout."""
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    rng = np.random.default_rng(11)
    noisy = batch["old_logprobs"] + rng.normal(0, 0.3, len(batch["old_logprobs"])).astype(np.float32)
    res = {}
    plain = FSDPTrainer(trainer_spec(path))
    res["corr_plain"] = plain.compute_grads(batch, temperature=TEMPERATURE)
    res["corr_plain_grads"] = plain.full_grads()
    same = FSDPTrainer(trainer_spec(path, rollout_correction="tis"))
    res["corr_same"] = same.compute_grads(dict(batch, rollout_logprobs=batch["old_logprobs"]),
                                          temperature=TEMPERATURE)
    res["corr_same_grads"] = same.full_grads()
    for name, over, drop in (("mis_seq", dict(rollout_correction="mis", rollout_correction_level="sequence",
                                                rollout_is_threshold=1.5), ()),
                             ("tis_own", dict(rollout_correction="tis", rollout_is_threshold=1.2), ("old_logprobs",)),
                             ("tis_rollout", dict(rollout_correction="tis", rollout_is_threshold=1.2,
                                                  old_logprobs="rollout"), ("old_logprobs",))):
        t = FSDPTrainer(trainer_spec(path, **over))
        b = {k: v for k, v in dict(batch, rollout_logprobs=noisy).items() if k not in drop}
        res[f"corr_{name}"] = t.compute_grads(b, temperature=TEMPERATURE)
    res["corr_noisy"] = noisy
    return res


def with_observations(batch: dict) -> dict:
    """The batch as a multi-turn rollout's: in every response of 3 tokens or more, the middle third
    is an observation (``loss_mask`` 0, log-probs 0), the rest the model's."""
    mask = np.zeros(len(batch["tokens"]), np.uint8)
    off, plen = batch["offsets"], batch["prompt_lens"]
    for i in range(len(plen)):
        start, end = int(off[i] + plen[i]), int(off[i + 1])
        mask[start:end] = 1
        n = end - start
        if n >= 3:
            mask[start + n // 3:start + 2 * n // 3] = 0
    out = dict(batch, loss_mask=mask)
    for key in ("old_logprobs", "ref_logprobs"):
        out[key] = np.where(mask.astype(bool), batch[key], 0).astype(np.float32)
    return out


def _observations_part(path, batch) -> dict:
    """A multi-turn batch (``with_observations``): log-probs, and the gradients of the plain policy
    loss (ratio 1, no KL or entropy) with and without the mask."""
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    masked = with_observations(batch)
    t = FSDPTrainer(trainer_spec(path, kl_coef=0.0, entropy_coef=0.0))
    logp = t.compute_logprobs(masked)
    res = {"obs_logp": logp, "obs_metrics": t.compute_grads(dict(masked, old_logprobs=logp))}
    res["obs_grads"] = t.full_grads()
    t.zero_grad()
    unmasked = {k: v for k, v in masked.items() if k != "loss_mask"}
    t.compute_grads(dict(unmasked, old_logprobs=t.compute_logprobs(unmasked)))
    res["unmasked_grads"] = t.full_grads()
    return res


GKD_TEACHER_T, GKD_BETA, GKD_K = 0.1, 0.3, 5


def _gkd_part(path, batch) -> dict:
    """algorithm: gkd through the trainers: the teacher's top-k (k = 5 and the whole vocabulary) of a multi-turn
    batch at temperature 0.1, and the GKD loss and gradients of a student (the same weights at temperature 1, so
    the two differ) on the top-5 and on the full distribution."""
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    masked = {k: v for k, v in with_observations(batch).items() if k not in ("old_logprobs", "ref_logprobs")}
    teacher = FSDPTrainer(trainer_spec(path, trainable=False, role="teacher"))
    res = {"gkd_teacher": teacher.teacher_logprobs(masked, GKD_TEACHER_T, GKD_K),
           "gkd_teacher_full": teacher.teacher_logprobs(masked, GKD_TEACHER_T, -1)}
    for name, top in (("topk", res["gkd_teacher"]), ("full", res["gkd_teacher_full"])):
        student = FSDPTrainer(trainer_spec(path, kl_coef=0.0, entropy_coef=0.0, gkd_beta=GKD_BETA))
        step = dict(masked, sample_weights=np.ones(len(masked["prompt_lens"]), np.float32),
                    teacher_topk_ids=top["teacher_topk_ids"], teacher_topk_logprobs=top["teacher_topk_logprobs"])
        res[f"gkd_{name}_metrics"] = student.compute_grads(step)
        res[f"gkd_{name}_grads"] = student.full_grads()
    return res


def job_two_ranks(rank, world, path, batch, probe, out):
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    trainer = FSDPTrainer(trainer_spec(path))
    res = _parity_part(trainer, batch)
    res["modes"] = _loss_modes_part(path, batch)
    res.update(_own_old_part(path, batch))
    res.update(_correction_part(path, batch))
    res.update(_observations_part(path, batch))
    res.update(_residency_part(trainer, batch, probe))
    res.update(_export_part(trainer, probe, out))
    # a distillation teacher (role teacher): its log-probs and top-1 agreement from one forward, over both ranks
    teacher = FSDPTrainer(trainer_spec(path, trainable=False, role="teacher"))
    res["teacher"] = teacher.teacher_logprobs(batch, temperature=TEMPERATURE)
    res.update(_gkd_part(path, batch))
    return res


def job_one_rank(rank, world, path, batch, probe, out):
    from torch.distributed.fsdp import FSDPModule

    from chatlearn.models.trainer.fsdp import FSDPTrainer

    trainer = FSDPTrainer(trainer_spec(path))
    res = _parity_part(trainer, batch)
    # one rank: a plain module (no FSDP wrapping); offload / onload work on it all the same
    res["fsdp_modules"] = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
    res.update(_residency_part(trainer, batch, probe))
    # gradient checkpointing gives the same gradients
    ckpt = FSDPTrainer(trainer_spec(path, gradient_checkpointing=True))
    res["ckpt_metrics"] = ckpt.compute_grads(batch)
    res["ckpt_grads"] = ckpt.full_grads()
    # (e) old == current log-probs, no KL / entropy: loss = -token-mean of the advantage
    plain = FSDPTrainer(trainer_spec(path, kl_coef=0.0, entropy_coef=0.0))
    logp = plain.compute_logprobs(batch)
    res["token_mean_metrics"] = plain.compute_grads(dict(batch, old_logprobs=logp))
    res["modes"] = _loss_modes_part(path, batch)
    res.update(_own_old_part(path, batch))
    res.update(_correction_part(path, batch))
    res.update(_observations_part(path, batch))
    res["plain_modes"] = {}
    for mode in AGG_MODES:  # ratio 1, no KL / entropy: the loss is -agg(advantage)
        t = FSDPTrainer(trainer_spec(path, kl_coef=0.0, entropy_coef=0.0, loss_agg_mode=mode))
        res["plain_modes"][mode] = t.compute_grads(dict(batch, old_logprobs=logp,
                                                        sample_weights=SAMPLE_WEIGHTS))
    res.update(_lr_resume_part(path, batch, out))
    # ref_policy: not trainable, same log-probs, no optimizer
    ref = FSDPTrainer(trainer_spec(path, trainable=False))
    res["ref_logp"] = ref.compute_logprobs(batch, temperature=TEMPERATURE)
    res["ref_requires_grad"] = any(p.requires_grad for p in ref.model.parameters())
    res["ref_offload"] = ref.offload(["weights", "optimizer", "grads"])["bytes"]
    res["ref_onload"] = ref.onload(["weights", "optimizer", "grads"])["bytes"]
    try:
        ref.train(batch)
        res["ref_train_refused"] = False
    except RuntimeError:
        res["ref_train_refused"] = True
    return res


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoConfig

    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    vocab = AutoConfig.from_pretrained(path).vocab_size
    batch = make_batch(vocab)
    logp, ent = hf_logprobs(path, batch)
    batch = add_logprobs(batch, logp)
    probe = torch.from_numpy(np.random.default_rng(3).integers(0, vocab, (2, 9)))
    return {"path": path, "batch": batch, "probe": probe}


@pytest.fixture(scope="module")
def two(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("two")
    t0 = time.monotonic()
    results = run_ranks(job_two_ranks, 2, out, setup["path"], setup["batch"], setup["probe"],
                        str(out))
    print(f"2-rank job: {time.monotonic() - t0:.1f}s")
    return results, out


@pytest.fixture(scope="module")
def one(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    return run_ranks(job_one_rank, 1, out, setup["path"], setup["batch"], setup["probe"], str(out))[0]


# --------------------------------------------------------------------------- tests

METRICS = ("loss", "policy_loss", "kl", "entropy", "clip_frac", "num_tokens")


@pytest.mark.timeout(240)
def test_two_ranks_match_one_rank(two, one):
    (r0, r1), _ = two
    for name in METRICS:  # identical on every rank, and equal to the 1-rank run
        assert r0["metrics"][name] == r1["metrics"][name], name
        assert r0["metrics"][name] == pytest.approx(one["metrics"][name], abs=1e-6), name
    for name in METRICS + ("grad_norm", "lr"):
        assert r0["step_metrics"][name] == r1["step_metrics"][name], name
        tol = {"rel": 1e-5} if name == "grad_norm" else {"abs": 1e-6}  # a sum of squares
        assert r0["step_metrics"][name] == pytest.approx(one["step_metrics"][name], **tol)
    assert 0 < r0["metrics"]["clip_frac"] < 1 and r0["metrics"]["kl"] > 0
    assert r0["step_metrics"]["loss"] == pytest.approx(r0["metrics"]["loss"], abs=1e-7)
    g2, g1 = r0["grads"], one["grads"]
    assert g2.keys() == g1.keys() and "lm_head.weight" not in g2
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=0, atol=1e-6, msg=name)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in g1.values())).item()
    assert one["step_metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert norm > 1.0  # so clip_grad=1.0 really clipped


@pytest.mark.timeout(240)
def test_a_step_without_old_logprobs_uses_its_own_forward(setup, two, one):
    """No old log-probs in the batch (the first optimizer step with the weights that generated it):
    the gradients and the loss metrics equal those with the old log-probs of a separate pass, on 1
    and on 2 ranks, and the step reports the rollout mismatch over every response token."""
    from chatlearn.models.base import response_mask

    (r0, r1), _ = two
    for res in (r0, r1, one):
        for name in METRICS + ("ratio_mean",):
            assert res["own_metrics"][name] == pytest.approx(res["own_pass_metrics"][name], abs=1e-6), name
        for name, g in res["own_pass_grads"].items():
            torch.testing.assert_close(res["own_grads"][name], g, rtol=0, atol=1e-6, msg=name)
        assert "rollout_diff_sum" not in res["own_pass_metrics"]
    assert r0["own_metrics"]["ratio_mean"] == 1.0 and r0["own_metrics"]["clip_frac"] == 0.0
    mask = response_mask(setup["batch"])
    d = one["own_passed"][mask].astype(np.float64) - one["own_rollout"][mask].astype(np.float64)
    expected = {"rollout_diff_sum": np.abs(d).sum(), "rollout_kl_sum": (np.exp(d) - d - 1).sum(),
                "rollout_tokens": float(mask.sum()), "rollout_diff_max": np.abs(d).max()}
    for name, value in expected.items():
        assert r0["own_metrics"][name] == r1["own_metrics"][name], name
        assert r0["own_metrics"][name] == pytest.approx(one["own_metrics"][name], rel=1e-6), name
        assert one["own_metrics"][name] == pytest.approx(value, rel=1e-4), name


@pytest.mark.timeout(240)
def test_rollout_correction_through_the_trainer(setup, two, one):
    """A rollout that agrees with the trainer gives weights 1: the uncorrected loss and gradients.
    A differing one gives the same is_* metrics on 1 and 2 ranks (sums all-reduced, the max
    max-reduced), and mis at the sequence level masks exactly the samples whose likelihood ratio
    old / rollout is outside [1 / 1.5, 1.5]."""
    from chatlearn.models.base import response_mask

    (r0, r1), _ = two
    for res in (r0, r1, one):
        for name in METRICS:
            assert res["corr_same"][name] == pytest.approx(res["corr_plain"][name], abs=1e-7), name
        assert res["corr_same"]["is_weight_mean"] == pytest.approx(1.0) and res["corr_same"]["is_clip_frac"] == 0
        for name, g in res["corr_plain_grads"].items():
            torch.testing.assert_close(res["corr_same_grads"][name], g, rtol=0, atol=1e-7, msg=name)
    for case in ("mis_seq", "tis_own", "tis_rollout"):
        for name in ("loss", "is_weight_mean", "is_weight_max", "is_mismatch_kl"):
            assert r0[f"corr_{case}"][name] == r1[f"corr_{case}"][name], (case, name)
            assert r0[f"corr_{case}"][name] == pytest.approx(one[f"corr_{case}"][name], rel=1e-5, abs=1e-7), (case, name)
    batch = setup["batch"]
    mask = response_mask(batch)
    d = batch["old_logprobs"].astype(np.float64) - one["corr_noisy"].astype(np.float64)
    sample = np.repeat(np.arange(len(batch["prompt_lens"])), np.diff(batch["offsets"]))
    rho = np.exp([d[mask & (sample == i)].sum() for i in range(len(batch["prompt_lens"]))])
    lens = np.array([(mask & (sample == i)).sum() for i in range(len(rho))])
    masked = (rho < 1 / 1.5) | (rho > 1.5)
    assert 0 < masked.sum() < len(rho)
    m = one["corr_mis_seq"]
    assert m["is_masked_frac"] == pytest.approx((lens * masked).sum() / lens.sum(), rel=1e-6)
    assert m["is_weight_max"] == pytest.approx(rho[~masked].max(), rel=1e-4)
    assert 0 < one["corr_tis_own"]["is_clip_frac"] < 1 and one["corr_tis_own"]["is_weight_max"] == pytest.approx(1.2)
    assert one["corr_tis_rollout"]["is_weight_max"] <= 1.0 + 1e-6  # min(1, C / rho)
    assert one["corr_tis_rollout"]["rollout_tokens"] == mask.sum()


@pytest.mark.timeout(240)
def test_gradient_checkpointing_gives_the_same_gradients(one):
    for name in METRICS:
        assert one["ckpt_metrics"][name] == pytest.approx(one["metrics"][name], abs=1e-6)
    for name, g in one["grads"].items():
        torch.testing.assert_close(one["ckpt_grads"][name], g, rtol=0, atol=1e-6, msg=name)


@pytest.mark.timeout(240)
def test_compute_logprobs_matches_plain_transformers(setup, two, one):
    (r0, r1), _ = two
    logp, ent = hf_logprobs(setup["path"], setup["batch"], TEMPERATURE)
    for res in (r0, r1, one):
        assert res["logp"].dtype == np.float32 and res["logp"].shape == logp.shape
        np.testing.assert_allclose(res["logp"], logp, rtol=0, atol=1e-5)
        np.testing.assert_allclose(res["entropy"], ent, rtol=0, atol=1e-5)
    np.testing.assert_allclose(one["ref_logp"], logp, rtol=0, atol=1e-5)
    batch = setup["batch"]
    first = batch["offsets"][:-1]
    assert np.all(r0["logp"][first] == 0)  # the first token of each sample has no prefix
    from chatlearn.models.base import response_mask
    assert np.all(r0["logp"][~response_mask(batch)] == 0)
    assert np.all(r0["logp"][response_mask(batch)] < 0)


@pytest.mark.timeout(240)
def test_offload_frees_storage_and_onload_restores_bit_for_bit(two, one):
    (r0, r1), _ = two
    assert one["fsdp_modules"] == 0 and not one["sharded"] and r0["sharded"]
    for res in (r0, r1, one):
        assert res["offload_bytes"] == res["expected_bytes"] > 0
        assert res["weight_bytes_live"] == 0 and res["state_bytes_live"] == 0
        assert res["fsdp_internal_bytes_live"] == 0
        assert res["grads_none"] and res["again_bytes"] == 0 and res["refused"]
        assert res["onload_bytes"] == res["offload_bytes"]
        assert res["logits_equal"] and res["weights_equal"] and res["states_equal"]
        assert np.isfinite(res["after_onload"]["loss"])


def hf_top1(path: str, batch: dict) -> np.ndarray:
    """Reference: 1.0 where a response token is the argmax of plain transformers' logits at its position."""
    from transformers import AutoModelForCausalLM

    from chatlearn.models.base import response_mask

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    top1 = np.zeros(len(batch["tokens"]), np.float32)
    off, mask = batch["offsets"], response_mask(batch)
    with torch.no_grad():
        for i in range(len(off) - 1):
            ids = torch.from_numpy(batch["tokens"][off[i]:off[i + 1]])
            best = model(input_ids=ids[None]).logits[0].argmax(-1)
            for p in range(1, len(ids)):
                top1[off[i] + p] = float(mask[off[i] + p] and best[p - 1] == ids[p])
    return top1


@pytest.mark.timeout(240)
def test_teacher_pass_gives_log_probs_and_argmax_agreement(setup, two):
    """The teacher's pass over 2 ranks: the log-probs of plain transformers, and 1.0 exactly where the sampled
    token is the argmax of its logits (the batch's random tokens: some are, most are not)."""
    (r0, r1), _ = two
    logp, _ = hf_logprobs(setup["path"], setup["batch"], TEMPERATURE)
    top1 = hf_top1(setup["path"], setup["batch"])
    assert 0 < top1.sum() < (logp != 0).sum()
    for res in (r0, r1):
        assert set(res["teacher"]) == {"teacher_logprobs", "teacher_top1"}
        np.testing.assert_allclose(res["teacher"]["teacher_logprobs"], logp, rtol=0, atol=1e-5)
        np.testing.assert_array_equal(res["teacher"]["teacher_top1"], top1)


@pytest.mark.timeout(240)
def test_ref_policy_is_frozen(one):
    assert not one["ref_requires_grad"] and one["ref_train_refused"]
    assert one["ref_offload"] == one["ref_onload"] > 0


@pytest.mark.timeout(240)
def test_export_weights_and_save_hf_load_in_transformers(setup, two):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    (r0, r1), out = two
    assert r1["exported"] == {} and r0["num_buckets"] == r1["num_buckets"] >= 2
    assert all(n == 0 for n in r1["bucket_sizes"])
    config = AutoConfig.from_pretrained(setup["path"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {k: torch.from_numpy(v) for k, v in r0["exported"].items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) == {"lm_head.weight"} and not unexpected  # tied to the embeddings
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(input_ids=setup["probe"]).logits
    torch.testing.assert_close(logits, r0["probe_logits"], rtol=0, atol=1e-5)
    initial = AutoModelForCausalLM.from_pretrained(setup["path"], dtype=torch.float32)
    assert not torch.equal(initial.model.embed_tokens.weight, state["model.embed_tokens.weight"])

    saved = AutoModelForCausalLM.from_pretrained(out / "saved", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(saved(input_ids=setup["probe"]).logits, r0["probe_logits"],
                                   rtol=0, atol=1e-5)
    tok = AutoTokenizer.from_pretrained(out / "saved")
    assert tok.apply_chat_template([{"role": "user", "content": "1+1"}], tokenize=False)


@pytest.mark.timeout(240)
def test_loss_is_the_token_mean_of_minus_advantage(setup, one):
    batch = setup["batch"]
    n_tokens = np.diff(batch["offsets"]) - batch["prompt_lens"]
    expected = -float(np.sum(batch["advantages"].astype(np.float64) * n_tokens) / n_tokens.sum())
    m = one["token_mean_metrics"]
    assert m["num_tokens"] == n_tokens.sum()
    assert m["loss"] == pytest.approx(expected, abs=1e-5)
    assert m["policy_loss"] == pytest.approx(expected, abs=1e-5)
    assert m["clip_frac"] == 0.0 and "entropy" not in m
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # on-policy: logp == old_logp


@pytest.mark.timeout(240)
def test_every_loss_agg_mode_on_two_ranks_matches_the_global_aggregate(two, one):
    """The loss and gradients summed over 2 ranks (each with its share of the samples and
    micro-batches) equal the 1-rank global aggregate, for every loss_agg_mode."""
    (r0, r1), _ = two
    losses = set()
    for mode in AGG_MODES:
        g1 = one["modes"][mode]
        for name in ("loss", "policy_loss", "kl", "entropy", "clip_frac", "clip_frac_lower", "ratio_mean"):
            assert r0["modes"][mode]["metrics"][name] == r1["modes"][mode]["metrics"][name]
            assert r0["modes"][mode]["metrics"][name] == pytest.approx(
                g1["metrics"][name], rel=1e-5, abs=1e-6), (mode, name)
        for key, g in g1["grads"].items():
            torch.testing.assert_close(r0["modes"][mode]["grads"][key], g, rtol=0, atol=1e-6,
                                       msg=f"{mode} {key}")
        losses.add(round(g1["metrics"]["loss"], 6))
    assert len(losses) == len(AGG_MODES)  # the modes really differ
    assert one["modes"]["token-mean"]["metrics"]["clip_frac_lower"] > 0  # dual clip was active


@pytest.mark.timeout(240)
def test_loss_agg_modes_match_their_formulas(setup, one):
    """Ratio 1, no KL or entropy: per-token loss -A_i, so each mode's loss is a closed form
    of the advantages (n_i response lengths, w_i sample weights, L = 16)."""
    batch = setup["batch"]
    a = batch["advantages"].astype(np.float64)
    n = (np.diff(batch["offsets"]) - batch["prompt_lens"]).astype(np.float64)
    w = SAMPLE_WEIGHTS.astype(np.float64)
    expected = {
        "token-mean": -np.sum(w * a * n) / np.sum(w * n),
        "seq-mean-token-mean": -np.sum(w * a) / np.sum(w),
        "seq-mean-token-sum": -np.sum(w * a * n) / np.sum(w),
        "seq-mean-token-sum-norm": -np.sum(w * a * n) / 16 / np.sum(w),
    }
    for mode, value in expected.items():
        m = one["plain_modes"][mode]
        assert m["loss"] == pytest.approx(value, abs=1e-5), mode
        assert m["policy_loss"] == pytest.approx(value, abs=1e-5), mode
        assert m["num_tokens"] == n.sum() and m["clip_frac"] == 0.0


@pytest.mark.timeout(240)
def test_lr_schedule_follows_the_formula_and_survives_resume(one):
    def lr_at(step):  # warmup 2 steps from 2e-4, cosine to 1e-4 at step 6 (Megatron's)
        if step <= 2:
            return 2e-4 + (1e-3 - 2e-4) * step / 2
        if step > 6:
            return 1e-4
        return 1e-4 + (1e-3 - 1e-4) * 0.5 * (1 + np.cos(np.pi * (step - 2) / 4))

    np.testing.assert_allclose(one["lrs"], [lr_at(s) for s in range(5)], rtol=1e-12)
    assert one["resumed_lrs"] == one["lrs"][3:]
    # a batch whose samples are all filtered: lr 0, no weight changes, the schedule advances
    assert one["filtered_step"]["lr"] == 0.0 and one["filtered_step"]["loss"] == 0.0
    assert one["filtered_unchanged"]
    assert one["after_filtered_lr"] == pytest.approx(lr_at(6), rel=1e-12)


@pytest.mark.timeout(240)
def test_observation_tokens_get_no_loss_and_no_gradient(setup, two, one):
    """A multi-turn batch: the trainer's log-probs are the model's at the model's tokens and 0 at the
    observations; the gradient is exactly that of the token-mean policy loss over the model's tokens
    alone (plain transformers, computed here), on 1 and 2 ranks; without the mask it differs."""
    from transformers import AutoModelForCausalLM

    from chatlearn.models.base import loss_token_counts

    batch = with_observations(setup["batch"])
    mask = batch["loss_mask"].astype(bool)
    logp, _ = hf_logprobs(setup["path"], batch)
    (r0, r1), _ = two
    for res in (one, r0, r1):
        np.testing.assert_allclose(res["obs_logp"][mask], logp[mask], rtol=0, atol=1e-5)
        assert np.all(res["obs_logp"][~mask] == 0)
        assert res["obs_metrics"]["num_tokens"] == mask.sum() == loss_token_counts(batch).sum()
    model = AutoModelForCausalLM.from_pretrained(setup["path"], dtype=torch.float32)
    off, plen = batch["offsets"], batch["prompt_lens"]
    total = torch.zeros((), dtype=torch.float64)
    for i in range(len(plen)):
        ids = torch.from_numpy(batch["tokens"][off[i]:off[i + 1]])
        lsm = torch.log_softmax(model(input_ids=ids[None]).logits[0].double(), -1)
        for p in range(int(plen[i]), len(ids)):
            if mask[off[i] + p]:
                total = total - float(batch["advantages"][i]) * lsm[p - 1, ids[p]]
    (total / mask.sum()).backward()
    reference = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    differs = False
    for key, g in one["obs_grads"].items():
        torch.testing.assert_close(g, reference[key], rtol=0, atol=2e-6, msg=key)
        torch.testing.assert_close(r0["obs_grads"][key], g, rtol=0, atol=1e-6, msg=key)
        differs |= not torch.allclose(one["unmasked_grads"][key], g, rtol=0, atol=1e-4)
    assert differs  # the observation tokens would have changed the gradient


def job_where_am_i(rank, world):
    return {"rank": rank, "world": world, "pid": os.getpid()}


@pytest.mark.slow  # a spawned rank imports torch & co. itself: about 10 s
def test_rank_jobs_are_spawned_where_cuda_is(monkeypatch, tmp_path):
    """On a CUDA machine the fork server's imports initialise CUDA, which a forked rank cannot use; there the
    ranks are spawned (a rank job still runs, its function found by reference as from the fork server)."""
    import rank_processes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert rank_processes.context().get_start_method() == "spawn"
    results = run_ranks(job_where_am_i, 1, tmp_path)
    assert results[0]["rank"] == 0 and results[0]["world"] == 1 and results[0]["pid"] != os.getpid()


@pytest.mark.timeout(240)
def test_gkd_teacher_top_k_and_loss_match_plain_transformers(setup, two):
    """algorithm: gkd over 2 ranks, multi-turn: the teacher's top-k log-probs and ids (k = 5 and the vocabulary)
    are those of plain transformers' log-softmax at the model's tokens (0 elsewhere); the student's loss and
    gradients are those of the token mean of the generalized JSD (chatlearn.algorithms.gkd.gkd_token_loss, itself
    checked against TRL's formula in tests/algorithms/test_gkd.py) over the model's tokens, computed here."""
    from transformers import AutoModelForCausalLM

    from chatlearn.algorithms.gkd import gkd_token_loss

    batch = with_observations(setup["batch"])
    mask = batch["loss_mask"].astype(bool)
    model = AutoModelForCausalLM.from_pretrained(setup["path"], dtype=torch.float32)
    off, plen = batch["offsets"], batch["prompt_lens"]
    logits = []  # the logits that predict each of the model's tokens, in order
    for i in range(len(plen)):
        ids = torch.from_numpy(batch["tokens"][off[i]:off[i + 1]])
        z = model(input_ids=ids[None]).logits[0]
        logits += [z[p - 1] for p in range(int(plen[i]), len(ids)) if mask[off[i] + p]]
    logits = torch.stack(logits)
    vocab = logits.shape[-1]
    lsm = torch.log_softmax(logits.detach().double() / GKD_TEACHER_T, -1)
    values, ids = lsm.topk(vocab, -1)
    (r0, r1), _ = two
    for res in (r0, r1):
        for name, k in (("gkd_teacher", GKD_K), ("gkd_teacher_full", vocab)):
            top = res[name]
            got = torch.from_numpy(top["teacher_topk_ids"][mask].astype(np.int64))
            assert top["teacher_topk_ids"].shape == (len(batch["tokens"]), k)
            np.testing.assert_allclose(top["teacher_topk_logprobs"][mask], values[:, :k].numpy(), rtol=0, atol=1e-5)
            # the ids' own log-probs are the values (ids of near-equal log-probs may come in either order)
            np.testing.assert_allclose(lsm.gather(-1, got).numpy(), top["teacher_topk_logprobs"][mask], atol=1e-5)
            assert (got.sort(-1).values == torch.arange(vocab)).all() if k == vocab else torch.equal(got, ids[:, :k])
            assert not top["teacher_topk_logprobs"][~mask].any()
    for name, k in (("topk", GKD_K), ("full", vocab)):
        model.zero_grad()
        top = r0["gkd_teacher" if name == "topk" else "gkd_teacher_full"]
        loss = gkd_token_loss(logits, torch.from_numpy(top["teacher_topk_ids"][mask]),
                              torch.from_numpy(top["teacher_topk_logprobs"][mask]), GKD_BETA, 1.0).mean()
        loss.backward(retain_graph=True)
        assert loss.item() > 1e-3  # the student (temperature 1) and the teacher (0.1) differ
        for res in (r0, r1):
            assert res[f"gkd_{name}_metrics"]["loss"] == pytest.approx(loss.item(), rel=1e-5)
            assert res[f"gkd_{name}_metrics"]["num_tokens"] == mask.sum()
        for key, g in r0[f"gkd_{name}_grads"].items():
            torch.testing.assert_close(g, model.get_parameter(key).grad, rtol=0, atol=2e-6, msg=key)
    full_loss = r0["gkd_full_metrics"]["loss"]
    assert r0["gkd_topk_metrics"]["loss"] < full_loss  # top-5 and the rest: a coarser, smaller divergence
