"""Routing replay (``models.policy_trainer.routing_replay: rollout``): the ``routed_experts`` column's
encoding, the router patch, the hf rollout's capture and the FSDP2 trainer's replay on a tiny random
Qwen3-MoE / Qwen2-MoE built here (tests/support/tiny_moe.py).

The end-to-end case: the rollout's routers choose their top-k from slightly noisy scores (what a rollout
engine does where two experts nearly tie, in another precision or with other kernels), the scores of the
chosen experts being the model's own; so rollout and trainer differ by routing alone. With replay the
trainer's experts are the recorded ones bit for bit and its log-probs are the rollout's to float rounding;
without it they differ wherever the choice did.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import backend_specs
from chatlearn.models.moe import layout
from chatlearn.models.moe.routing import RouterPatch, micro_batch_target, routers
from tiny_moe import make_tiny_moe

NOISE = 0.08  # added to the rollout's router probabilities before its top-k


# ----------------------------------------------------------------------------- the column

def test_column_dtype_is_compact_and_round_trips():
    assert layout.column_dtype(8) == np.uint8 and layout.column_dtype(254) == np.uint8
    assert layout.column_dtype(255) == np.int16 and layout.column_dtype(4096) == np.int16
    rng = np.random.default_rng(0)
    for experts in (8, 254, 255, 1000):
        ids = rng.integers(0, experts, (50, 3, 2))
        ids[rng.random(50) < 0.2] = -1  # tokens without record
        enc = layout.encode(ids, experts)
        assert enc.dtype == layout.column_dtype(experts)
        assert np.array_equal(layout.decode(enc), ids)
    assert np.array_equal(layout.decode(layout.encode([[253, 0]], 254)), [[253, 0]])
    with pytest.raises(ValueError, match="not below"):
        layout.encode([[8, 0]], 8)


def test_layout_from_config_and_assembly():
    qwen3 = {"num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4, "decoder_sparse_step": 1,
             "mlp_only_layers": [1]}
    assert layout.layout_of_config(qwen3) == layout.MoeLayout(3, 2, 8)
    assert layout.layout_of_config({**qwen3, "decoder_sparse_step": 2, "mlp_only_layers": []}).layers == 2
    assert layout.layout_of_config({"num_local_experts": 300, "num_experts_per_tok": 2,
                                    "num_hidden_layers": 3}) == layout.MoeLayout(3, 2, 300)
    assert layout.layout_of_config({"num_hidden_layers": 2, "hidden_size": 8}) is None  # dense
    lay = layout.MoeLayout(2, 2, 8)
    assert lay.bytes_per_token() == 4 and layout.MoeLayout(2, 2, 500).bytes_per_token() == 8
    col = layout.assemble([np.ones((3, 2, 2), int), None, np.zeros((5, 2, 2), int)], [4, 2, 3], lay)
    assert col.shape == (9, 2, 2) and col.dtype == np.uint8
    dec = layout.decode(col)
    assert (dec[:3] == 1).all() and (dec[3:6] == -1).all() and (dec[6:] == 0).all()  # cut to the sample's length
    with pytest.raises(ValueError, match="MoE layers"):
        layout.assemble([np.ones((2, 3, 2), int)], [2], lay)


def test_the_column_travels_with_samples():
    from chatlearn.batch import COLUMNS, check, concat_batches, select_samples
    from chatlearn.config.kinds import ROLLOUT

    assert COLUMNS["routed_experts"].per == "token" and "routed_experts" in ROLLOUT.columns
    lay = layout.MoeLayout(2, 2, 8)
    rng = np.random.default_rng(1)
    lens = [3, 5, 4]
    batch = {"tokens": np.arange(12), "offsets": np.array([0, 3, 8, 12]), "prompt_lens": np.array([1, 2, 2]),
             "routed_experts": layout.encode(rng.integers(-1, 8, (12, 2, 2)), 8)}
    check(batch)
    picked = select_samples(batch, [2, 0])
    col = batch["routed_experts"]
    assert np.array_equal(picked["routed_experts"], np.concatenate([col[8:], col[:3]]))
    both = concat_batches([batch, picked])
    check(both)
    assert both["routed_experts"].shape == (19, lay.layers, lay.top_k)
    from chatlearn.runtime.driver.algorithm import SEQUENCE_COLUMNS

    assert "routed_experts" in SEQUENCE_COLUMNS  # every trainer forward receives it (and replayed episodes keep it)
    assert sum(lens) == 12


def test_replayed_episodes_keep_the_column_through_a_checkpoint(tmp_path):
    from chatlearn.runtime.driver.algorithm import SEQUENCE_COLUMNS
    from chatlearn.runtime.driver.replay import ReplayBuffer

    rng = np.random.default_rng(3)
    batch = {"tokens": np.arange(9), "offsets": np.array([0, 4, 9]), "prompt_lens": np.array([2, 3]),
             "routed_experts": layout.encode(rng.integers(-1, 300, (9, 2, 4)), 300)}
    buffer = ReplayBuffer(2, (*SEQUENCE_COLUMNS, "advantages"))
    buffer.add(batch)
    buffer.save(str(tmp_path))
    again = ReplayBuffer(2, (*SEQUENCE_COLUMNS, "advantages"))
    again.load(str(tmp_path))
    kept = again.training_batch(batch)
    assert kept["routed_experts"].dtype == np.int16
    assert np.array_equal(kept["routed_experts"], np.concatenate([batch["routed_experts"]] * 2))


# ----------------------------------------------------------------------------- the router patch

@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def moe_dir(request, tmp_path_factory):
    return make_tiny_moe(str(tmp_path_factory.mktemp(request.param) / "m"), arch=request.param)


def _own_routes(model, ids):
    rec = []
    hooks = [r.register_forward_hook(lambda m, i, o: rec.append(o[2].detach().clone())) for r in routers(model)]
    try:
        out = model(input_ids=ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    return out, torch.stack(rec, dim=1)  # [tokens, layers, k]


def test_replay_routes_to_the_target_and_trains_the_router(moe_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    ids = torch.from_numpy(np.random.default_rng(0).integers(3, 300, (2, 7)))
    plain, own = _own_routes(model, ids)
    patch = RouterPatch(model)
    assert patch.layout == layout.layout_of_folder(moe_dir)
    patch.reset_agreement()
    patch.set_target(own.clone())  # the model's own routes: the unpatched forward bit for bit
    same, _ = _own_routes(model, ids)
    assert torch.equal(same, plain) and patch.agreement() == (own.numel(), own.numel())
    # another target: the experts used are the target's, -1 tokens keep their own
    target = (own + 1) % patch.layout.num_experts
    target[3] = -1
    patch.reset_agreement()
    patch.set_target(target)
    logits, used = _own_routes(model, ids)
    assert torch.equal(used[torch.arange(len(used)) != 3], target[torch.arange(len(used)) != 3])
    assert torch.equal(used[3], own[3])
    agree, slots = patch.agreement()
    assert slots == (len(used) - 1) * patch.layout.layers * patch.layout.top_k and agree < slots
    assert not torch.allclose(logits, plain)
    # the scores are the router's own probabilities at the replayed experts: the router's weight gets a gradient
    logits.float().logsumexp(-1).sum().backward()
    grads = [r.weight.grad for r in routers(model)]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    # the replayed scores are softmax(logits) gathered and renormalised (norm_topk_prob), as megatron-core's replay
    router = routers(model)[0]
    hidden = torch.randn(4, router.hidden_dim)
    patch.set_target(torch.tensor([[[0, 1]] * patch.layout.layers] * 4))
    logits_r, scores, idx = router(hidden)
    probs = torch.softmax(F.linear(hidden, router.weight), -1)
    want = probs[:, :2] / probs[:, :2].sum(-1, keepdim=True)
    assert torch.equal(idx, torch.tensor([[0, 1]] * 4)) and torch.allclose(scores, want)
    patch.set_target(None)  # off: the router's own forward
    assert torch.equal(_own_routes(model, ids)[0], plain)


def test_micro_batch_target_layout():
    lay = layout.MoeLayout(2, 2, 8)
    t = micro_batch_target((2, 4), lay, [(0, 1, np.full((2, 2, 2), 5)), (1, 0, np.full((1, 2, 2), 7))],
                           torch.device("cpu"))
    assert t.shape == (8, 2, 2) and t.dtype == torch.long
    assert (t[1:3] == 5).all() and (t[4] == 7).all() and (t[[0, 3, 5, 6, 7]] == -1).all()


# ----------------------------------------------------------------------------- hf rollout -> FSDP trainer

def _noisy_router_forward(self, hidden_states):
    """The rollout's router: its top-k from the probabilities plus a little noise, the chosen experts' scores
    the model's own (renormalised) probabilities."""
    hidden = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden, self.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    gen = torch.Generator().manual_seed(int(hidden.shape[0]) * 7919 + int(hidden.abs().sum().item() * 1e3) % 1000)
    _, idx = torch.topk(probs + NOISE * torch.rand(probs.shape, generator=gen), self.top_k, dim=-1)
    values = probs.gather(1, idx)
    values = values / values.sum(-1, keepdim=True)
    return logits, values.to(logits.dtype), idx


@pytest.fixture(scope="module")
def rollout_batch(tmp_path_factory):
    """A batch of the hf rollout (routing_replay: rollout) of the tiny Qwen3-MoE whose routers are noisy."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    from chatlearn.models.rollout.hf import HFRollout

    path = make_tiny_moe(str(tmp_path_factory.mktemp("rollout") / "qwen3moe"), seed=1)
    original = modeling_qwen3_moe.Qwen3MoeTopKRouter.forward
    modeling_qwen3_moe.Qwen3MoeTopKRouter.forward = _noisy_router_forward
    try:
        engine = HFRollout(backend_specs.rollout_spec(path, routing_replay="rollout", generation_batch_size=4))
        rng = np.random.default_rng(0)
        prompts = [list(rng.integers(3, 300, int(n))) for n in rng.integers(2, 8, 8)]
        batch = engine.generate(prompts, {"temperature": 1.0, "max_tokens": 10, "seed": 5})
        plain = HFRollout(backend_specs.rollout_spec(path, generation_batch_size=4)).generate(
            prompts, {"temperature": 1.0, "max_tokens": 10, "seed": 5})
    finally:
        modeling_qwen3_moe.Qwen3MoeTopKRouter.forward = original
    assert "routed_experts" not in plain  # replay off: no column
    n = len(prompts)
    batch["advantages"] = np.random.default_rng(2).normal(size=n).astype(np.float32)
    return path, batch


def _trainer_job(rank, world, path, batch):
    """On each trainer configuration: the log-probs, and the experts every MoE layer used for every token (one
    sample per micro-batch, unpadded: the routers' outputs in the sample's token order)."""
    import torch.distributed as dist  # noqa: F401

    from chatlearn.models.trainer.fsdp import FSDPTrainer
    from test_fsdp_trainer import trainer_spec

    def used_routes(t, b):
        seen = {}
        current = {}

        def pre(module, args, kwargs):
            current["ids"] = tuple(kwargs["input_ids"][0].tolist())
            current["routes"] = []

        def post(module, args, out):
            current["routes"].append(out[2].detach().clone())

        decoder = t.model.get_decoder()
        hooks = [decoder.register_forward_pre_hook(pre, with_kwargs=True)]
        hooks += [r.register_forward_hook(post) for r in routers(t.model)]
        logp = t.compute_logprobs(b)
        for h in hooks:
            h.remove()
        seen[current["ids"]] = torch.stack(current["routes"], 1).numpy()
        return logp, seen

    out = {}
    for name, over in (("replay", dict(routing_replay="rollout")), ("own", dict(routing_replay="off"))):
        t = FSDPTrainer(trainer_spec(path, logprob_micro_batch_size=1, kl_coef=0.0, entropy_coef=0.0, **over))
        routes = {}
        for i in range(len(batch["prompt_lens"])):
            from chatlearn.batch import select_samples

            logp, seen = used_routes(t, select_samples(batch, [i]))
            routes.update(seen)
        out[name] = {"logp": t.compute_logprobs(batch), "routes": routes}
        grads = t.compute_grads(dict(batch, old_logprobs=out[name]["logp"]))
        out[name]["metrics"] = grads
        out[name]["router_grads"] = [float(g.abs().sum()) for n, g in t.full_grads().items()
                                     if n.endswith("mlp.gate.weight")]
    for name, over in (("packed", dict(packing=True)), ("shared", dict(share_prompt=True)),
                       ("padded", dict(logprob_micro_batch_size=3, train_micro_batch_size=3)),
                       ("ckpt", dict(gradient_checkpointing=True, train_micro_batch_size=3))):
        t = FSDPTrainer(trainer_spec(path, routing_replay="rollout", kl_coef=0.0, entropy_coef=0.0, **over))
        logp = t.compute_logprobs(batch)
        out[name] = {"logp": logp, "metrics": t.compute_grads(dict(batch, old_logprobs=logp)),
                     "share_prompt": t.share_prompt}
    return out


@pytest.fixture(scope="module")
def trained(rollout_batch, tmp_path_factory):
    from test_fsdp_trainer import run_ranks

    path, batch = rollout_batch
    return run_ranks(_trainer_job, 1, tmp_path_factory.mktemp("replay_job"), path, batch, timeout=240)[0]


@pytest.mark.timeout(400)
def test_replayed_top_k_equals_the_recorded_one_bit_for_bit(rollout_batch, trained):
    _, batch = rollout_batch
    off, tokens = batch["offsets"], batch["tokens"]
    differs = 0
    for i in range(len(batch["prompt_lens"])):
        key = tuple(int(x) for x in tokens[off[i]:off[i + 1]])
        recorded = layout.decode(batch["routed_experts"][off[i]:off[i + 1]])
        has = (recorded >= 0).all((-1, -2))
        assert has[:-1].all() and not has[-1]  # every token but the last sampled one has its record
        replayed, own = trained["replay"]["routes"][key], trained["own"]["routes"][key]
        assert np.array_equal(replayed[has], recorded[has])  # bit for bit, in the recorded order
        differs += int((np.sort(own[has], -1) != np.sort(recorded[has], -1)).any((-1, -2)).sum())
    assert differs > 0  # the case is one where the trainer's own routing is not the rollout's


@pytest.mark.timeout(400)
def test_replay_closes_the_logprob_gap(rollout_batch, trained):
    from chatlearn.models.base import response_mask

    _, batch = rollout_batch
    mask = response_mask(batch)
    gap = {name: np.abs(trained[name]["logp"][mask] - batch["rollout_logprobs"][mask])
           for name in ("replay", "own", "packed", "shared", "padded", "ckpt")}
    print({name: (float(g.mean()), float(g.max())) for name, g in gap.items()})
    assert gap["replay"].max() < 1e-4, gap["replay"].max()
    assert gap["own"].mean() > 20 * max(gap["replay"].mean(), 1e-7), (gap["own"].mean(), gap["replay"].mean())
    for name in ("packed", "shared", "padded", "ckpt"):  # every layout of the micro-batches replays alike
        assert gap[name].max() < 1e-4, (name, gap[name].max())
    assert trained["shared"]["share_prompt"]


@pytest.mark.timeout(400)
def test_replay_reports_agreement_and_trains_the_router(trained):
    agreement = trained["replay"]["metrics"]["moe/routing_agreement"]
    print("routing agreement", agreement)
    assert 0.5 < agreement < 1.0  # the noisy rollout chose otherwise for some tokens
    for name in ("packed", "shared", "padded", "ckpt"):
        assert trained[name]["metrics"]["moe/routing_agreement"] == pytest.approx(agreement, abs=0.02), name
    assert "moe/routing_agreement" not in trained["own"]["metrics"]
    assert all(g > 0 for g in trained["replay"]["router_grads"])


def _two_rank_job(rank, world, path, batch):
    from chatlearn.models.trainer.fsdp import FSDPTrainer
    from test_fsdp_trainer import trainer_spec

    t = FSDPTrainer(trainer_spec(path, routing_replay="rollout", kl_coef=0.0, entropy_coef=0.0,
                                 logprob_micro_batch_size=3, train_micro_batch_size=3))
    logp = t.compute_logprobs(batch)
    return {"logp": logp, "metrics": t.compute_grads(dict(batch, old_logprobs=logp))}


@pytest.mark.timeout(400)
def test_two_ranks_replay_as_one(rollout_batch, trained, tmp_path):
    from test_fsdp_trainer import run_ranks

    path, batch = rollout_batch
    ranks = run_ranks(_two_rank_job, 2, tmp_path, path, batch, timeout=240)
    for res in ranks:
        np.testing.assert_allclose(res["logp"], trained["padded"]["logp"], rtol=0, atol=1e-5)
        # the agreement is counted over both ranks' tokens (all-reduced)
        assert res["metrics"]["moe/routing_agreement"] == pytest.approx(
            trained["padded"]["metrics"]["moe/routing_agreement"], abs=0.02)


def test_a_rollout_without_routes_stops_the_first_generate_naming_the_key():
    from omegaconf import OmegaConf

    from chatlearn.config.schema import Config
    from chatlearn.errors import UserError
    from chatlearn.runtime.driver.sampling import Sampling

    cfg = OmegaConf.structured(Config)
    batch = {"tokens": np.arange(4), "offsets": np.array([0, 4]), "prompt_lens": np.array([2])}
    Sampling(cfg, None, None, None, None).check_routes(batch)  # replay off: nothing asked
    cfg.models.policy_trainer.routing_replay = "rollout"
    cfg.runtime_args.rollout_backend = "sglang"
    with pytest.raises(UserError, match=r"^models.policy_trainer.routing_replay: .*\(sglang\).*routing_replay: off"):
        Sampling(cfg, None, None, None, None).check_routes(batch)
    Sampling(cfg, None, None, None, None).check_routes(
        dict(batch, routed_experts=layout.empty(4, layout.MoeLayout(2, 2, 8))))
