"""MegatronTrainer on mixture-of-experts models (Qwen3-MoE, Qwen2-MoE with a shared expert), on CPU
under the test-only device shim, against plain transformers and the FSDP2 trainer: log-probs,
gradients and one optimizer step for expert parallelism 1, 2 and TP 2 x EP 2; the weight export
(transformers' fused expert tensors); routing replay (the trainer's top-k is the given one, -1 routes
itself); checkpoint resume and the offline merge of an EP-sharded checkpoint.

Tiny random models are built here (a handful of experts, top-2), so that no asset is needed. The
router's auxiliary loss is set to 0 where gradients are compared with FSDP (megatron-core's switch
loss and Hugging Face's differ in their normalisation; FSDP adds none unless asked).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from test_fsdp_trainer import add_logprobs, hf_logprobs, make_batch, run_ranks, trainer_spec
from test_megatron_gpu_paths import _fake_te_spec, fake_transformer_engine  # noqa: F401 (a fixture)
from test_megatron_trainer import needs_megatron

pytestmark = [needs_megatron, pytest.mark.timeout(600)]  # the rank jobs: 4 of 1 to 4 ranks, about 40 s in all

TEMPERATURE = 0.8
LR = 1e-4
JOB_TIMEOUT_S = 240


def make_moe_model(path: str, kind: str = "qwen3_moe", seed: int = 0, **over) -> str:
    """A random tiny Qwen3-MoE (q/k norms, 4 experts, top-2, renormalised) or Qwen2-MoE (a shared
    expert with its sigmoid gate, qkv bias, top-2 not renormalised), saved with save_pretrained
    (per-expert tensor names on disk) and a copy of the tiny dense model's tokenizer files."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  router_aux_loss_coef=0.0)
    if kind == "qwen3_moe":
        conf = Qwen3MoeConfig(**{**common, "head_dim": 16, "norm_topk_prob": True, **over})
    else:
        conf = Qwen2MoeConfig(**{**common, "shared_expert_intermediate_size": 48, "norm_topk_prob": False, **over})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # routers with a clear preference, so top-2 is stable
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(path)
    return path


def hf_routing(path: str, batch: dict) -> np.ndarray:
    """The experts transformers' own router picks for every token of ``batch`` (one forward per
    sample, as :func:`hf_logprobs`): int64 ``[tokens, moe_layers, k]``, the column a rollout records."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    k = model.config.num_experts_per_tok
    out = np.zeros((len(batch["tokens"]), len(gates), k), np.int64)
    seen: list = []
    hooks = [g.register_forward_hook(lambda mod, args, res: seen.append(res[2])) for g in gates]
    off = batch["offsets"]
    with torch.no_grad():
        for i in range(len(off) - 1):
            seen.clear()
            model(input_ids=torch.from_numpy(batch["tokens"][off[i]:off[i + 1]])[None])
            for j, idx in enumerate(seen):
                out[off[i]:off[i + 1], j] = idx.numpy()
    for h in hooks:
        h.remove()
    return out


def shuffled_routing(routing: np.ndarray, experts: int, seed: int = 3) -> np.ndarray:
    """Another valid routing (k distinct experts per token, none the router's first choice where
    possible), with some tokens without a record (-1)."""
    rng = np.random.default_rng(seed)
    out = np.empty_like(routing)
    for t in range(routing.shape[0]):
        for j in range(routing.shape[1]):
            out[t, j] = rng.permutation(experts)[:routing.shape[2]]
    out[::5] = -1  # no record: the trainer routes these itself
    return out


def _exported(trainer) -> dict:
    return {k: v for b in trainer.export_weights(bucket_mb=1) for k, v in b}


def _parity(trainer, batch) -> dict:
    """Export, log-probs, gradients, one step, export (as the dense tests' ``_parity_part``)."""
    weights0 = _exported(trainer)
    logp, ent = trainer.compute_logprobs(batch, temperature=TEMPERATURE, with_entropy=True)
    metrics = trainer.compute_grads(batch)
    grads = trainer.full_grads()
    trainer.zero_grad()
    step = trainer.train(batch)
    return {"weights0": weights0, "logp": logp, "entropy": ent, "metrics": metrics, "grads": grads,
            "step": step, "weights1": _exported(trainer)}


def _replay(trainer, batch, own: np.ndarray, other: np.ndarray) -> dict:
    """Log-probs replaying the router's own routing (= no replay), another routing (differs), and the
    experts each router used for the latter (its top-k per layer, gathered back into token order on
    one micro-batch of the whole batch)."""
    logp_own = trainer.compute_logprobs(dict(batch, routed_experts=own))
    logp_other = trainer.compute_logprobs(dict(batch, routed_experts=other))
    used = [r.recorded_topk_idx.clone() for r in trainer._replays]
    metrics = trainer.compute_grads(dict(batch, routed_experts=other))  # training forward (and backward) too
    used_train = [r.recorded_topk_idx.clone() for r in trainer._replays]
    trainer.zero_grad()
    own_metrics = trainer.compute_grads(dict(batch, routed_experts=own))
    trainer.zero_grad()
    return {"replay_own": logp_own, "replay_other": logp_other, "used": used, "used_train": used_train,
            "replay_metrics": metrics, "replay_own_metrics": own_metrics}


MOE_KEYS = {"expert_tensor_parallel_size": "expert_tensor_parallel_size", "moe_layer_recompute": "layer_recompute",
            "moe_token_dispatcher_type": "token_dispatcher_type", "moe_aux_loss_coeff": "aux_loss_coeff"}


def moe_spec(path: str, tp: int = 1, ep: int = 1, **over):
    """The trainer spec of the MoE tests: the router's aux loss off (``moe_aux_loss_coeff`` 0), one
    micro-batch of the replica's samples; the config keys of ``MOE_KEYS`` go to ``spec.moe``."""
    import dataclasses

    from backend_specs import MOE_DEFAULTS

    moe = {MOE_KEYS[k]: over.pop(k) for k in list(over) if k in MOE_KEYS}
    moe = dataclasses.replace(MOE_DEFAULTS, **{"aux_loss_coeff": 0.0, "expert_model_parallel_size": ep, **moe})
    return trainer_spec(path, **{"lr": LR, "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": 1,
                                 "sequence_parallel": False, "use_distributed_optimizer": False, "moe": moe,
                                 "logprob_micro_batch_size": 8, "train_micro_batch_size": 8, **over})


def job_reference(rank, world, setup, out):
    """1 rank: the FSDP2 trainer and Megatron EP1 on the Qwen3-MoE; Megatron on the Qwen2-MoE."""
    from megatron_shim import cpu_device_shim

    from chatlearn.models.trainer.fsdp import FSDPTrainer

    res = {"fsdp": _parity(FSDPTrainer(trainer_spec(setup["q3"], lr=LR)), setup["batch"]),
           "fsdp_q2": _parity(FSDPTrainer(trainer_spec(setup["q2"], lr=LR)), setup["batch"])}
    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        res["ep1"] = _parity(MegatronTrainer(moe_spec(setup["q3"])), setup["batch"])
        res["q2_ep1"] = MegatronTrainer(moe_spec(setup["q2"], trainable=False)).compute_logprobs(setup["batch"])
        for name, moe in (("aux", {"aux_loss_coeff": 0.1}), ("z", {"z_loss_coeff": 0.1}),
                          ("force", {"force_load_balancing": True})):
            import dataclasses

            spec = moe_spec(setup["q3"])
            trainer = MegatronTrainer(dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, **moe)))
            metrics = trainer.compute_grads(setup["batch"])
            res[f"key_{name}"] = {"metrics": metrics, "grads": trainer.full_grads(),
                                  "logp": trainer.compute_logprobs(setup["batch"], temperature=TEMPERATURE)}
    return res


def job_ep2(rank, world, setup, out):
    """EP2 (each rank 2 of the 4 experts): parity, replay, resume, a checkpoint to merge; the
    Qwen2-MoE with allgather dispatch."""
    from megatron_shim import cpu_device_shim

    batch = setup["batch"]
    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        cfg = moe_spec(setup["q3"], ep=2)
        trainer = MegatronTrainer(cfg)
        res = _parity(trainer, batch)
        trainer.save_checkpoint(os.path.join(out, "checkpoint"))
        res["saved_weights"] = _exported(trainer)
        expected = trainer.train(batch)
        resumed = MegatronTrainer(cfg)
        resumed.load_checkpoint(os.path.join(out, "checkpoint"))
        res["resume"] = (expected, resumed.train(batch))
        res["resume_weights"] = (_exported(trainer), _exported(resumed))
        rep = MegatronTrainer(moe_spec(setup["q3"], ep=2, routing_replay="rollout", gradient_checkpointing=True))
        res.update(_replay(rep, batch, setup["q3_routing"], setup["q3_other"]))
        res["replay_none"] = rep.compute_logprobs(batch)
        try:
            rep.compute_logprobs(dict(batch, routed_experts=setup["q3_routing"][:, :1]))
            res["replay_bad"] = ""
        except Exception as err:  # noqa: BLE001 (the message is what is checked)
            res["replay_bad"] = str(err)
        q2 = MegatronTrainer(moe_spec(setup["q2"], ep=2, moe_token_dispatcher_type="allgather"))
        res["q2_ep2"] = q2.compute_logprobs(batch)
        res["q2_parity"] = _parity(q2, batch)
        critic = MegatronTrainer(moe_spec(setup["q3"], ep=2, role="critic", cliprange_value=0.2, value_loss_coef=0.5,
                                          routing_replay="rollout"))
        res["critic_values"] = critic.compute_values(batch)
        res["critic_step"] = critic.train(setup["critic_columns"])
        res["critic_after"] = critic.compute_values(batch)
    return res


def job_tp2ep2(rank, world, setup, out):
    """TP2 x EP2 on 4 ranks (sequence parallel; each expert whole on its rank: expert tensor parallel 1):
    parity and a checkpoint to merge."""
    from megatron_shim import cpu_device_shim

    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        trainer = MegatronTrainer(moe_spec(setup["q3"], tp=2, ep=2, sequence_parallel=True,
                                            expert_tensor_parallel_size=1))
        res = _parity(trainer, setup["batch"])
        trainer.save_checkpoint(os.path.join(out, "checkpoint"))
        res["saved_weights"] = _exported(trainer)
        res["saved_logp"] = trainer.compute_logprobs(setup["batch"])
    return res


def job_pp2(rank, world, setup, out):
    """PP2 (one MoE layer per stage) with routing replay and full recomputation: each stage replays its
    own layer's records, in the forward and in the backward's recomputation."""
    from megatron_shim import cpu_device_shim

    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        trainer = MegatronTrainer(moe_spec(setup["q3"], pipeline_model_parallel_size=2, routing_replay="rollout",
                                           gradient_checkpointing=True))
        res = _replay(trainer, setup["batch"], setup["q3_routing"], setup["q3_other"])
        res["stage_slots"] = trainer._stage_moe_slots
        other = dict(setup["batch"], routed_experts=setup["q3_other"])
        trainer.compute_grads(other)
        res["grads_full_recompute"] = trainer.full_grads()
        trainer.zero_grad()
        res["step"] = trainer.train(other)
        layer = MegatronTrainer(moe_spec(setup["q3"], pipeline_model_parallel_size=2, routing_replay="rollout",
                                         moe_layer_recompute=True))
        res["layer_recompute"] = layer.config.recompute_granularity, list(layer.config.recompute_modules)
        res["layer_recompute_metrics"] = layer.compute_grads(other)
        res["grads_layer_recompute"] = layer.full_grads()
        plain = MegatronTrainer(moe_spec(setup["q3"], pipeline_model_parallel_size=2, routing_replay="rollout"))
        plain.compute_grads(other)
        res["grads_no_recompute"] = plain.full_grads()
    return res


def job_etp2(rank, world, setup, out):
    """TP2 x EP2 with megatron-core's default expert tensor parallelism (= TP: each expert split over 2
    ranks), sequence parallel: parity."""
    from megatron_shim import cpu_device_shim

    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        trainer = MegatronTrainer(moe_spec(setup["q3"], tp=2, ep=2, sequence_parallel=True))
        res = _parity(trainer, setup["batch"])
        res["etp"] = trainer.etp
    return res


def job_ep2pp2(rank, world, setup, out):
    """EP2 x PP2 on 4 ranks (each stage one MoE layer, its experts over 2 ranks; 2 data-parallel
    replicas) with the distributed optimizer: log-probs, loss, one step."""
    from megatron_shim import cpu_device_shim

    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        trainer = MegatronTrainer(moe_spec(setup["q3"], ep=2, pipeline_model_parallel_size=2,
                                           use_distributed_optimizer=True))
        weights0 = _exported(trainer)
        logp, ent = trainer.compute_logprobs(setup["batch"], temperature=TEMPERATURE, with_entropy=True)
        step = trainer.train(setup["batch"])
        return {"weights0": weights0, "logp": logp, "entropy": ent, "step": step, "weights1": _exported(trainer)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    q3 = make_moe_model(str(tmp_path_factory.mktemp("q3moe")), "qwen3_moe")
    q2 = make_moe_model(str(tmp_path_factory.mktemp("q2moe")), "qwen2_moe", seed=1)
    batch = make_batch(96)
    logp, _ = hf_logprobs(q3, batch)
    routing = hf_routing(q3, batch)
    from test_fsdp_critic import hf_values, value_columns
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(0)  # the trainers seed the new value head with their seed (0)
    critic = AutoModelForTokenClassification.from_pretrained(q3, num_labels=1, dtype=torch.float32).eval()
    values = hf_values(critic, batch)
    return {"q3": q3, "q2": q2, "batch": add_logprobs(batch, logp), "q3_hf_logp": logp,
            "critic_values": values, "critic_columns": value_columns(batch, values),
            "q3_hf_logp_t": hf_logprobs(q3, batch, temperature=TEMPERATURE)[0],
            "q2_hf_logp": hf_logprobs(q2, batch)[0], "q3_routing": routing,
            "q3_other": shuffled_routing(routing, 4)}


def _run(job, world, setup, tmp_path_factory):
    out = tmp_path_factory.mktemp(job.__name__)
    return run_ranks(job, world, out, setup, str(out), timeout=JOB_TIMEOUT_S), out


@pytest.fixture(scope="module")
def reference(setup, tmp_path_factory):
    return _run(job_reference, 1, setup, tmp_path_factory)[0][0]


@pytest.fixture(scope="module")
def ep2(setup, tmp_path_factory):
    return _run(job_ep2, 2, setup, tmp_path_factory)


@pytest.fixture(scope="module")
def pp2(setup, tmp_path_factory):
    return _run(job_pp2, 2, setup, tmp_path_factory)[0]


@pytest.fixture(scope="module")
def ep2pp2(setup, tmp_path_factory):
    return _run(job_ep2pp2, 4, setup, tmp_path_factory)[0]


@pytest.fixture(scope="module")
def etp2(setup, tmp_path_factory):
    return _run(job_etp2, 4, setup, tmp_path_factory)[0]


@pytest.fixture(scope="module")
def tp2ep2(setup, tmp_path_factory):
    return _run(job_tp2ep2, 4, setup, tmp_path_factory)


def _megatron_runs(reference, ep2, tp2ep2, etp2=None) -> dict:
    runs = {"ep1": [reference["ep1"]], "ep2": ep2[0], "tp2xep2": tp2ep2[0]}
    if etp2 is not None:
        runs["tp2xep2xetp2"] = etp2
    return runs


def test_moe_logprobs_match_transformers_and_fsdp(setup, reference, ep2, tp2ep2, etp2):
    """Qwen3-MoE (q/k norms, renormalised top-2) at EP1, EP2 and TP2 x EP2, and Qwen2-MoE (shared
    expert and its gate, qkv bias, top-2 not renormalised) at EP1 and EP2 with the allgather
    dispatcher: the log-probs of plain transformers and of the FSDP2 trainer."""
    fsdp = reference["fsdp"]
    np.testing.assert_allclose(fsdp["logp"], setup["q3_hf_logp_t"], rtol=0, atol=1e-5)
    assert etp2[0]["etp"] == 2
    for name, ranks in _megatron_runs(reference, ep2, tp2ep2, etp2).items():
        for res in ranks:
            np.testing.assert_allclose(res["logp"], fsdp["logp"], rtol=0, atol=1e-5, err_msg=name)
            np.testing.assert_allclose(res["entropy"], fsdp["entropy"], rtol=0, atol=1e-5, err_msg=name)
            for key in ("loss", "policy_loss", "kl", "entropy", "clip_frac"):
                assert res["metrics"][key] == pytest.approx(fsdp["metrics"][key], abs=1e-5), (name, key)
    np.testing.assert_allclose(reference["q2_ep1"], setup["q2_hf_logp"], rtol=0, atol=1e-5)
    for res in ep2[0]:
        np.testing.assert_allclose(res["q2_ep2"], setup["q2_hf_logp"], rtol=0, atol=1e-5)


def module_weights(path: str) -> dict:
    """The parameters of transformers' model loaded from ``path``, by module name, as numpy."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {k: v.detach().numpy().copy() for k, v in model.named_parameters()}


def test_moe_export_is_transformers_module_layout(setup, reference, ep2, tp2ep2, etp2):
    """The weight export before any step: transformers' module tensors (a layer's experts fused,
    gate_up_proj [E, 2I, H] and down_proj [E, H, I], the names the FSDP2 trainer exports), equal to
    the model's own bit for bit, on rank 0 only; the other ranks' buckets are empty."""
    initial = module_weights(setup["q3"])
    assert initial["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    assert set(reference["fsdp"]["weights0"]) == set(initial)
    for name, ranks in _megatron_runs(reference, ep2, tp2ep2, etp2).items():
        got = ranks[0]["weights0"]
        assert set(got) == set(initial), name
        for key, w in initial.items():
            assert np.array_equal(got[key], w), (name, key)
        for other in ranks[1:]:
            assert other["weights0"] == {}, name


def test_moe_gradients_and_step_match_fsdp(setup, reference, ep2, tp2ep2, etp2):
    """Gradients of every tensor (experts gathered over the expert-parallel ranks), the clipped
    grad norm and the weights after one Adam step: those of the FSDP2 trainer."""
    fsdp = reference["fsdp"]
    initial = module_weights(setup["q3"])
    moved = [k for k, w in fsdp["weights1"].items() if not np.array_equal(w, initial[k])]
    assert "model.layers.1.mlp.experts.gate_up_proj" in moved and "model.layers.0.mlp.gate.weight" in moved
    for name, ranks in _megatron_runs(reference, ep2, tp2ep2, etp2).items():
        res = ranks[0]
        assert set(res["grads"]) == set(fsdp["grads"]), name
        for key, g in fsdp["grads"].items():
            np.testing.assert_allclose(res["grads"][key].numpy(), g.numpy(), rtol=1e-4, atol=1e-6,
                                       err_msg=f"{name} {key}")
        assert res["step"]["grad_norm"] == pytest.approx(fsdp["step"]["grad_norm"], rel=1e-4), name
        for key, w in fsdp["weights1"].items():
            np.testing.assert_allclose(res["weights1"][key], w, rtol=0, atol=1e-5, err_msg=f"{name} {key}")


def test_routing_replay_uses_the_given_experts(setup, ep2):
    """routing_replay: rollout at EP2 (with full recomputation, so the backward's recomputed forward
    replays too): replaying the router's own choices gives the log-probs without replay; another
    routing changes them; the experts every router used are the given ones, and the router's own
    top-k for the tokens without a record (-1)."""
    own, other = setup["q3_routing"], setup["q3_other"]
    batch = setup["batch"]
    off = batch["offsets"]
    for rank, res in enumerate(ep2[0]):  # data-parallel replica r: samples 4r .. 4r+3
        np.testing.assert_allclose(res["replay_own"], setup["q3_hf_logp"], rtol=0, atol=1e-5)
        assert np.abs(res["replay_other"] - res["replay_own"]).max() > 1e-2
        for used in (res["used"], res["used_train"]):
            assert len(used) == other.shape[1]
            for layer, idx in enumerate(used):
                # one micro-batch of the replica's 4 samples, right-padded: router tokens in [s, b] order
                width = idx.shape[0] // 4
                idx = idx.reshape(width, 4, -1)
                for row in range(4):
                    i = 4 * rank + row
                    n = int(off[i + 1] - off[i])
                    given = other[off[i]:off[i + 1], layer]
                    got = idx[:n, row].numpy()
                    recorded = given[:, 0] >= 0
                    assert recorded.any() and not recorded.all() or n < 5
                    assert np.array_equal(got[recorded], given[recorded])
                    if layer == 0:  # later layers' inputs depend on the routing before them
                        assert np.array_equal(np.sort(got[~recorded], -1),
                                              np.sort(own[off[i]:off[i + 1], layer][~recorded], -1))
                    assert all(len(set(r)) == len(r) and min(r) >= 0 for r in got.tolist())


def test_moe_checkpoint_resumes_bit_for_bit(ep2):
    for res in ep2[0]:
        expected, got = res["resume"]
        assert got == expected and got["grad_norm"] > 0
    before, after = ep2[0][0]["resume_weights"]
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)


def test_merge_of_expert_parallel_checkpoints(setup, ep2, tp2ep2, tmp_path):
    """``chatlearn merge`` of the EP2 and the TP2 x EP2 checkpoints: a folder in save_pretrained's
    layout (per-expert tensor names) that transformers loads, with the trainer's weights and the
    trainer's log-probs."""
    from safetensors import safe_open
    from test_fsdp_trainer import hf_logprobs as hf_lp
    from transformers import AutoModelForCausalLM

    from chatlearn.checkpoint.merge import merge_checkpoint

    for name, (ranks, out) in (("ep2", ep2), ("tp2xep2", tp2ep2)):
        folder = str(tmp_path / name)
        merge_checkpoint(os.path.join(str(out), "checkpoint"), folder)
        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys, name
        assert not any(k.endswith("gate_up_proj") for k in keys), name
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        params = dict(model.named_parameters())
        for key, w in ranks[0]["saved_weights"].items():
            assert np.array_equal(params[key].detach().numpy(), w), (name, key)
        if "saved_logp" in ranks[0]:
            logp, _ = hf_lp(folder, setup["batch"])
            np.testing.assert_allclose(logp, ranks[0]["saved_logp"], rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- without ranks


@pytest.fixture(scope="module")
def q3_folder(tmp_path_factory):
    return make_moe_model(str(tmp_path_factory.mktemp("q3arch")), "qwen3_moe")


def _check(q3_folder, world, tp=1, pp=1, ep=1, etp=None):
    from chatlearn.checkpoint.megatron_mapping import HFArch
    from chatlearn.models.trainer.megatron.trainer import check_parallel_sizes

    check_parallel_sizes(world, tp, pp, ep, etp, HFArch.from_folder(q3_folder),
                         lambda k: f"models.policy_trainer.{k}")


@pytest.mark.parametrize("world,tp,ep,etp,key,words", [
    (3, 1, 2, None, "expert_model_parallel_size", "3 trainer ranks do not divide"),
    (4, 2, 4, None, "expert_model_parallel_size", "expert_tensor_parallel_size 2 x expert_model_parallel_size 4"),
    (6, 1, 3, None, "expert_model_parallel_size", "4 experts do not divide"),
    (3, 1, 1, 3, "expert_tensor_parallel_size", "does not divide the experts' intermediate size"),
    (3, 2, 1, None, "tensor_model_parallel_size", "do not divide into tensor_model_parallel_size 2"),
])
def test_parallel_layout_is_checked_before_start(q3_folder, world, tp, ep, etp, key, words):
    """EP x ETP x PP (and TP x PP) against the trainer's ranks, experts over EP, ETP against the experts'
    intermediate size: one paragraph naming the key, before any process group is made."""
    from chatlearn.errors import UserError

    with pytest.raises(UserError) as err:
        _check(q3_folder, world, tp=tp, ep=ep, etp=etp)
    assert err.value.key == f"models.policy_trainer.{key}" and words in str(err.value)
    _check(q3_folder, 4, tp=2, ep=2)  # TP2 x EP2 on 4 ranks, EP2 x DP2, ETP1 x EP4: fine
    _check(q3_folder, 4, ep=2)
    _check(q3_folder, 4, tp=1, ep=4, etp=1)


def test_moe_config_matches_hugging_face_routing(q3_folder, tmp_path):
    """The router's settings: renormalised top-k (norm_topk_prob) = softmax over the top-k logits
    (pre-softmax off); without renormalisation pre-softmax on; mlp_only_layers / decoder_sparse_step keep
    dense layers (moe_layer_freq); top-1 with renormalisation refused with the reason."""
    from chatlearn.checkpoint.megatron_mapping import HFArch
    from chatlearn.models.trainer.megatron.model import MoEOptions, moe_config

    arch = HFArch.from_folder(q3_folder)
    conf = moe_config(arch, MoEOptions(ep=2, aux_loss_coeff=None), None)
    assert conf["moe_router_pre_softmax"] is False and conf["moe_router_topk"] == 2
    assert conf["moe_layer_freq"] == [1, 1] and conf["moe_aux_loss_coeff"] == arch.router_aux_loss_coef
    assert conf["expert_model_parallel_size"] == 2 and conf["moe_shared_expert_intermediate_size"] is None
    q2 = HFArch.from_folder(make_moe_model(str(tmp_path / "q2"), "qwen2_moe", num_hidden_layers=4,
                                           mlp_only_layers=[1], decoder_sparse_step=1))
    conf = moe_config(q2, MoEOptions(aux_loss_coeff=0.5, layer_recompute=True), "full")
    assert conf["moe_router_pre_softmax"] is True and conf["moe_layer_freq"] == [1, 0, 1, 1]
    assert conf["moe_shared_expert_intermediate_size"] == 48 and conf["moe_shared_expert_gate"] is True
    assert conf["moe_aux_loss_coeff"] == 0.5 and conf["moe_layer_recompute"] is False  # full covers it
    top1 = HFArch.from_folder(make_moe_model(str(tmp_path / "top1"), "qwen3_moe", num_experts_per_tok=1))
    with pytest.raises(NotImplementedError, match="norm_topk_prob"):
        moe_config(top1, MoEOptions(), None)


def test_mapping_covers_the_saved_tensors_of_both_models(q3_folder, tmp_path):
    """Every tensor save_pretrained writes (per-expert names) has exactly one Megatron parameter, with
    the shapes of the mapping; the module view fuses a layer's experts as transformers holds them."""
    from safetensors import safe_open

    from chatlearn.checkpoint.megatron_mapping import HFArch, fuse_module_view, hf_shapes, mappings, module_views

    q2 = make_moe_model(str(tmp_path / "q2"), "qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1])
    for folder in (q3_folder, q2):
        arch = HFArch.from_folder(folder)
        with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        ms = mappings(arch)
        mapped = {n: s for m in ms for n, s in zip(m.hf, hf_shapes(arch, m))}
        assert mapped == saved
        assert len({m.megatron for m in ms}) == len(ms)
    arch = HFArch.from_folder(q3_folder)
    views = {v[0]: v for v in module_views(arch, [n for m in mappings(arch) for n in m.hf])}
    name, shape, parts, fusion = views["model.layers.1.mlp.experts.gate_up_proj"]
    gate_up = fuse_module_view(fusion, [torch.full((32, 64), float(i)) for i in range(len(parts))])
    assert gate_up.shape == shape == (4, 64, 64) and parts[2] == "model.layers.1.mlp.experts.1.gate_proj.weight"
    assert gate_up[1, :32].eq(2).all() and gate_up[1, 32:].eq(3).all()  # expert 1: its gate rows, then up


def test_checkpoint_of_another_expert_count_is_refused(tmp_path):
    from chatlearn.checkpoint import megatron_format as fmt
    from chatlearn.checkpoint import sharded
    from chatlearn.errors import UserError

    layout = {"world_size": 2, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
              "use_distributed_optimizer": False, "dtype": "float32", "expert_model_parallel_size": 2,
              "expert_tensor_parallel_size": 1, "num_experts": 8}
    fmt.write_meta(str(tmp_path), {**layout, "hf_source": "/models/eight"})
    sharded.mark_complete(str(tmp_path))
    assert fmt.read_meta(str(tmp_path), layout)["num_experts"] == 8
    with pytest.raises(UserError, match="8 experts per MoE layer, and the model loaded now has 4"):
        fmt.read_meta(str(tmp_path), {**layout, "num_experts": 4})
    with pytest.raises(UserError, match="expert_model_parallel_size 2"):
        fmt.read_meta(str(tmp_path), {**layout, "expert_model_parallel_size": 1})


def test_critic_on_moe_works_at_ep2(setup, ep2):
    """PPO's critic on the MoE model at EP2: the values of transformers' token-classification model with
    the same initial head, and a finite step that moves them; it routes itself (routing_replay applies to
    the policy and the reference)."""
    for res in ep2[0]:
        np.testing.assert_allclose(res["critic_values"], setup["critic_values"], rtol=0, atol=1e-5)
        assert np.isfinite(res["critic_step"]["loss"]) and res["critic_step"]["grad_norm"] > 0
        assert np.abs(res["critic_after"] - res["critic_values"]).max() > 1e-4


def test_routing_replay_with_pipeline_parallelism(setup, ep2, pp2):
    """PP2: stage s replays MoE layer s's records; the log-probs under the router's own routing are
    transformers', under another routing those of EP2 with the same routing; training replays too."""
    assert [r["stage_slots"] for r in pp2] == [[0], [1]]
    for res in pp2:
        np.testing.assert_allclose(res["replay_own"], setup["q3_hf_logp"], rtol=0, atol=1e-5)
        np.testing.assert_allclose(res["replay_other"], ep2[0][0]["replay_other"], rtol=0, atol=1e-5)
        assert res["replay_metrics"]["loss"] == pytest.approx(ep2[0][0]["replay_metrics"]["loss"], abs=1e-5)
        assert np.isfinite(res["step"]["grad_norm"]) and res["step"]["grad_norm"] > 0
    for stage, res in enumerate(pp2):  # the experts stage s's router used: layer s's given ones
        given = setup["q3_other"][:, stage]
        used = res["used"][0].reshape(-1, 8, 2)
        off = setup["batch"]["offsets"]
        for i in range(8):
            n = int(off[i + 1] - off[i])
            rec = given[off[i]:off[i + 1], 0] >= 0
            assert np.array_equal(used[:n, i].numpy()[rec], given[off[i]:off[i + 1]][rec])


def test_routed_experts_column_is_decoded_as_declared():
    """The column's compact encodings (chatlearn/batch.py): uint8 with 255, int16 with -1, for no record."""
    from chatlearn.models.trainer.megatron.replay import decode_column

    for dtype, none in ((np.uint8, 255), (np.int16, -1)):
        col = np.array([[[1, none], [3, 2]], [[none, none], [0, 1]]], dtype)
        got = decode_column(col, 2, 2)
        assert got.dtype == np.int64 and got.tolist() == [[[1, -1], [3, 2]], [[-1, -1], [0, 1]]]


def test_moe_metrics(reference, ep2, pp2):
    """``moe/load_imbalance`` (max over mean top-k choices per expert, >= 1) on every MoE training step;
    ``moe/routing_agreement`` under replay: 1 when the rollout's routing is the router's own, below 1 for
    another routing (PP2 and EP2 agree: the counts are over all ranks)."""
    assert reference["ep1"]["metrics"]["moe/load_imbalance"] >= 1.0
    assert "moe/routing_agreement" not in reference["ep1"]["metrics"]
    for runs in (ep2[0], pp2):
        for res in runs:
            assert res["replay_own_metrics"]["moe/routing_agreement"] == 1.0
            assert 0.0 < res["replay_metrics"]["moe/routing_agreement"] < 0.9
            assert res["replay_metrics"]["moe/load_imbalance"] >= 1.0
    assert pp2[0]["replay_metrics"]["moe/routing_agreement"] == pytest.approx(
        ep2[0][0]["replay_metrics"]["moe/routing_agreement"])


def test_replay_under_moe_layer_recompute(pp2):
    """moe_layer_recompute (megatron-core's selective recompute of the MoE layer) and full recomputation
    replay the same routing in the recomputation: the loss, agreement and gradients without
    recomputation."""
    for res in pp2:
        assert res["layer_recompute"][0] == "selective" and "moe" in res["layer_recompute"][1]
        assert res["layer_recompute_metrics"]["loss"] == pytest.approx(res["replay_metrics"]["loss"], abs=1e-6)
        assert res["layer_recompute_metrics"]["moe/routing_agreement"] == res["replay_metrics"]["moe/routing_agreement"]
    plain = pp2[0]["grads_no_recompute"]
    for name in ("grads_full_recompute", "grads_layer_recompute"):
        got = pp2[0][name]
        assert set(got) == set(plain) and len(plain) > 0
        for key, g in plain.items():
            np.testing.assert_allclose(got[key].numpy(), g.numpy(), rtol=1e-5, atol=1e-7, err_msg=f"{name} {key}")


def test_qwen2_moe_shared_expert_trains_as_fsdp(reference, ep2):
    """Qwen2-MoE at EP2 with the allgather dispatcher: the shared expert and its sigmoid gate, the
    router and the experts get FSDP2's gradients, and one step gives its weights."""
    fsdp = reference["fsdp_q2"]
    res = ep2[0][0]["q2_parity"]
    assert "model.layers.0.mlp.shared_expert_gate.weight" in fsdp["grads"]
    assert set(res["grads"]) == set(fsdp["grads"])
    for key, g in fsdp["grads"].items():
        np.testing.assert_allclose(res["grads"][key].numpy(), g.numpy(), rtol=1e-4, atol=1e-6, err_msg=key)
    assert res["step"]["grad_norm"] == pytest.approx(fsdp["step"]["grad_norm"], rel=1e-4)
    for key, w in fsdp["weights1"].items():
        np.testing.assert_allclose(res["weights1"][key], w, rtol=0, atol=1e-5, err_msg=key)


def test_transformer_engine_moe_spec_and_grouped_expert_names(fake_transformer_engine):
    """On CUDA with TransformerEngine: the TE layer spec with the experts (grouped GEMM where asked) and
    Qwen3's q/k norms; TEGroupedMLP's ``weight<j>`` of a grouped linear is local expert j's weight.
    Without CUDA (or TE) grouped GEMM is reported unavailable, with the reason."""
    from chatlearn.models.trainer.megatron import model

    assert model.layer_spec(True, num_experts=4, grouped_gemm=True, qk_norm=True) == "te-layer-spec"
    assert fake_transformer_engine.calls[-1] == dict(num_experts=4, qk_layernorm=True,
                                                     multi_latent_attention=False, moe_grouped_gemm=True)
    assert model.grouped_gemm_available(torch.device("cuda", 0)) == (True, "")
    ok, why = model.grouped_gemm_available(torch.device("cpu"))
    assert not ok and "CPU" in why
    assert model.canonical_name("decoder.layers.1.mlp.experts.linear_fc1.weight3") == \
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    assert model.canonical_name("decoder.layers.0.mlp.experts.linear_fc2.weight0") == \
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"
    local = model.layer_spec(False, num_experts=4, qk_norm=True)  # the CPU twin
    attention = local.submodules.self_attention.submodules
    assert attention.q_layernorm is model.RMSNorm and attention.k_layernorm is model.RMSNorm


def test_expert_parallelism_with_pipeline_parallelism(setup, reference, ep2pp2):
    """EP2 x PP2 (and the distributed optimizer over the replicas): FSDP2's log-probs, grad norm and
    weights after one step, exported from both stages and both expert-parallel ranks."""
    fsdp = reference["fsdp"]
    for res in ep2pp2:
        np.testing.assert_allclose(res["logp"], fsdp["logp"], rtol=0, atol=1e-5)
        assert res["step"]["grad_norm"] == pytest.approx(fsdp["step"]["grad_norm"], rel=1e-4)
        assert res["step"]["loss"] == pytest.approx(fsdp["step"]["loss"], abs=1e-5)
    got = ep2pp2[0]["weights1"]
    assert set(got) == set(fsdp["weights1"])
    for key, w in fsdp["weights1"].items():
        np.testing.assert_allclose(got[key], w, rtol=0, atol=1e-5, err_msg=key)


def test_replay_without_the_column_routes_itself_and_a_wrong_column_is_refused(setup, ep2):
    """Under replay a batch without routed_experts (the weight push's landing probe) routes itself: the
    log-probs of no replay; a column of another shape is one paragraph naming routing_replay."""
    for res in ep2[0]:
        np.testing.assert_allclose(res["replay_none"], setup["q3_hf_logp"], rtol=0, atol=1e-5)
        assert "models.policy_trainer.routing_replay" in res["replay_bad"] and "another model" in res["replay_bad"]


def test_router_loss_keys_and_forced_balancing_act(reference):
    """moe_aux_loss_coeff and moe_z_loss_coeff add megatron-core's router losses to the gradients (the
    router's and everything before it), not to the reported loss; moe_router_force_load_balancing routes
    by random logits (other log-probs)."""
    base = reference["ep1"]
    assert "moe/aux_loss" not in base["metrics"] and "moe/z_loss" not in base["metrics"]  # no coefficient: none
    for name in ("aux", "z"):
        got = reference[f"key_{name}"]
        # the loss without its coefficient, logged: the Switch loss (1 when even, at most E / k) / the z-loss
        value = got["metrics"][f"moe/{name}_loss"]
        assert (0.5 < value < 8) if name == "aux" else value > 0, (name, value)
        assert got["metrics"]["loss"] == pytest.approx(base["metrics"]["loss"], abs=1e-6), name
        router = "model.layers.1.mlp.gate.weight"
        assert not np.allclose(got["grads"][router].numpy(), base["grads"][router].numpy(), atol=1e-6), name
        lm = "lm_head.weight"  # after the last router: untouched
        np.testing.assert_allclose(got["grads"][lm].numpy(), base["grads"][lm].numpy(), rtol=1e-5, atol=1e-8)
    forced = reference["key_force"]
    assert np.abs(forced["logp"] - base["logp"]).max() > 1e-3
