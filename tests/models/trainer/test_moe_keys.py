"""The FSDP side of the MoE keys (``chatlearn/models/trainer/moe.py``) on a small random Qwen3-MoE, in
process: the router's load-balancing loss against transformers' ``load_balancing_loss_func`` (padding
masked) and a plain per-layer reference, the z-loss, the loss term a micro-batch adds, forced load
balancing spreading the tokens, the warnings of the keys that mean nothing on FSDP."""
from __future__ import annotations

import logging

import backend_specs
import pytest
import torch

from chatlearn.models.trainer import moe as moe_lib

E, K = 8, 2


def tiny_moe(layers: int = 2, skew: float = 0.0):
    """A random Qwen3-MoE (hidden 64, ``E`` experts, top-``K``); ``skew``: expert 0's router weight set to
    ``skew`` times the direction of the mean router input, so that most tokens choose it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                            num_experts=E, num_experts_per_tok=K, norm_topk_prob=True, num_hidden_layers=layers,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, router_aux_loss_coef=0.02)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
        if skew:
            seen = []
            handle = model.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, o: seen.append(a[0]))
            model(input_ids=torch.randint(0, 96, (4, 32), generator=torch.Generator().manual_seed(9)))
            handle.remove()
            mean = seen[0].reshape(-1, 64).mean(0)
            model.model.layers[0].mlp.gate.weight[0] = skew * mean / mean.norm()
    return model


def plain_aux(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One layer's Switch loss written out: E / k * sum_e (share of top-k choices of e) * (mean prob of e)."""
    z = logits[mask.reshape(-1).bool()].double()
    probs = torch.softmax(z, -1)
    top = probs.topk(K, -1).indices
    counts = torch.stack([(top == e).sum() for e in range(E)]).double()
    return E / K * sum(counts[e] / z.shape[0] * probs[:, e].mean() for e in range(E))


def batch_with_padding():
    ids = torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[0, 7:] = 0
    mask[2, 4:] = 0
    return ids, mask


def test_aux_loss_matches_transformers_for_one_layer_and_a_plain_reference_per_layer():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = tiny_moe(layers=3)
    ids, mask = batch_with_padding()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, output_router_logits=True).router_logits
    flat = mask.reshape(-1).bool()
    for layer in logits:
        ours = moe_lib.switch_aux_loss(layer[flat], layer[flat].topk(K, -1).indices, E, K)
        # transformers' loss of one layer, padding masked, is k times the per-layer Switch loss
        hf = load_balancing_loss_func((layer,), E, K, attention_mask=mask)
        assert float(ours) == pytest.approx(float(hf) / K, rel=1e-6)
        assert float(ours) == pytest.approx(float(plain_aux(layer, mask)), rel=1e-6)
    # with padding counted the loss differs: the mask acts
    layer = logits[0]
    unmasked = moe_lib.switch_aux_loss(layer, layer.topk(K, -1).indices, E, K)
    assert float(unmasked) != pytest.approx(float(plain_aux(layer, mask)), rel=1e-6)


def test_z_loss_is_the_mean_squared_logsumexp():
    z = torch.randn(13, E, generator=torch.Generator().manual_seed(2)) * 3
    expected = sum(float(torch.log(torch.exp(row.double()).sum())) ** 2 for row in z) / 13
    assert float(moe_lib.z_loss(z)) == pytest.approx(expected, rel=1e-6)


def test_the_micro_batch_term_is_the_coefficients_times_the_losses_summed_over_layers():
    model = tiny_moe(layers=2)
    spec = backend_specs.MOE_DEFAULTS.replace(z_loss_coeff=0.003)  # aux: null, config.json's 0.02
    taps = moe_lib.RouterTaps(model, spec)
    assert taps.aux_coeff == 0.02 and len(taps.routers) == 2
    ids, mask = batch_with_padding()
    taps.begin(mask)
    out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    term = taps.end(micro_steps=4)
    expected = sum(0.02 * plain_aux(z, mask) + 0.003 * torch.logsumexp(z[mask.reshape(-1).bool()].double(), -1)
                   .square().mean() for z in out.router_logits) / 4
    assert float(term) == pytest.approx(float(expected), rel=1e-5)
    term.backward()  # the gradient reaches the routers
    assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0
    metrics = taps.step_metrics(torch.device("cpu"))
    assert metrics["moe/aux_loss"] == pytest.approx(
        float(sum(plain_aux(z, mask) for z in out.router_logits)) / 2, rel=1e-5)
    assert metrics["moe/load_imbalance"] >= 1.0
    # no coefficient: no term, the metrics all the same
    off = moe_lib.RouterTaps(model, spec.replace(aux_loss_coeff=0.0, z_loss_coeff=0.0))
    off.begin(mask)
    model(input_ids=ids, attention_mask=mask)
    assert off.end(micro_steps=1) is None and off.step_metrics(torch.device("cpu"))["moe/aux_loss"] > 0


def test_forced_load_balancing_spreads_the_tokens_evenly():
    model = tiny_moe(layers=1, skew=30.0)
    ids = torch.randint(0, 96, (8, 64), generator=torch.Generator().manual_seed(3))
    loads = {}
    for forced in (False, True):
        taps = moe_lib.RouterTaps(model, backend_specs.MOE_DEFAULTS.replace(force_load_balancing=forced))
        taps.begin(None)
        torch.manual_seed(0)
        with torch.no_grad():
            model(input_ids=ids)
        taps.end(1)
        counts = taps.counts[0]
        loads[forced] = float(counts.max() / counts.mean())
        for handle in taps._handles:
            handle.remove()
    # the skewed router sends most tokens to expert 0; random routing spreads 1024 choices evenly
    assert loads[False] > 3.0  # (4: every token chooses expert 0)
    assert loads[True] < 1.25


def test_forced_balancing_passes_the_gradient_straight_through():
    z = torch.randn(5, E, requires_grad=True)
    torch.manual_seed(0)
    out = moe_lib._RandomSTE.apply(z)
    assert not torch.equal(out, z)
    (out * torch.arange(E)).sum().backward()
    assert torch.equal(z.grad, torch.arange(E, dtype=z.dtype).expand(5, E))


def test_keys_without_meaning_on_fsdp_are_warned(caplog):
    model = tiny_moe(layers=1)
    spec = backend_specs.MOE_DEFAULTS.replace(token_dispatcher_type="allgather", shared_expert_overlap=True)
    with caplog.at_level(logging.WARNING, logger="chatlearn.models.trainer.moe"):
        moe_lib.apply(model, spec, lambda k: f"models.policy_trainer.{k}")
    text = caplog.text
    assert "models.policy_trainer.moe_token_dispatcher_type" in text and "no token is dispatched" in text
    assert "models.policy_trainer.moe_shared_expert_overlap" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chatlearn.models.trainer.moe"):
        moe_lib.apply(tiny_moe(layers=1), backend_specs.MOE_DEFAULTS, lambda k: k)
    assert caplog.text == ""


def test_groupgemm_sets_the_experts_implementation_and_a_dense_model_is_left_alone():
    model = tiny_moe(layers=1)
    moe_lib.apply(model, backend_specs.MOE_DEFAULTS.replace(groupgemm=True), lambda k: k)
    assert model.config._experts_implementation == "grouped_mm"
    moe_lib.apply(model, backend_specs.MOE_DEFAULTS, lambda k: k)
    assert model.config._experts_implementation == "eager"
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dense = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert moe_lib.apply(dense, backend_specs.MOE_DEFAULTS, lambda k: k) is None


def test_the_moe_toy_asset_is_as_built():
    """assets/tiny_qwen3_moe (tools/build_default_assets.py --model tiny_qwen3_moe): Qwen3-MoE, every layer
    sparse, 8 experts, top-2, head_dim 32 (vLLM's CPU attention), tiny_qwen2's tokenizer files, small."""
    import filecmp
    import json
    import os

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    moe, dense = os.path.join(repo, "assets", "tiny_qwen3_moe"), os.path.join(repo, "assets", "tiny_qwen2")
    with open(os.path.join(moe, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe"
    assert config["num_local_experts"] == 8 and config["num_experts_per_tok"] == 2
    assert config["decoder_sparse_step"] == 1 and config["mlp_only_layers"] == []
    assert config["head_dim"] >= 32 and not config["output_router_logits"]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert filecmp.cmp(os.path.join(moe, name), os.path.join(dense, name), shallow=False), name
    assert os.path.getsize(os.path.join(moe, "model.safetensors")) < 1.2 * os.path.getsize(
        os.path.join(dense, "model.safetensors"))
