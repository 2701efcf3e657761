"""LoRA adapter push (``lora.push: adapters``) into the vLLM rollout of a mixture-of-experts model (Qwen2-MoE:
routed experts and a shared expert), on vLLM's CPU backend.

The adapters sit on attention (``q_proj``, ``v_proj``: fused by vLLM into ``qkv_proj``) and on the shared
expert's ``down_proj`` (a plain linear layer in both transformers and vLLM); ``model.norm`` trains in full.
The routed experts are fused 3D parameters in transformers 5, which peft's ``target_modules`` does not adapt:
they stay the base folder's, and the rollout's partial reload leaves vLLM's expert layers (prepacked on the
CPU) as they are. The engine then samples what it samples after a push of the merged weights, also after an
offload that drops its weights (the rest come back from the base folder)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_moe_models import make_tiny_moe_model

from chatlearn.models.specs import LoraSpec
from tests.models.rollout.test_lora_push import SAMPLING, TOL, _adapter_push, _full_push
from tests.models.rollout.test_rollout_cpu import _spec as rollout_spec
from tests.models.rollout.test_rollout_cpu import prompts
from tests.models.trainer.test_fsdp_trainer import TEMPERATURE, make_batch, run_ranks, trainer_spec

LORA = LoraSpec(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"),
                modules_to_save=("model.norm",), push="adapters")


def job(rank, world, path, out):
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    trainer = FSDPTrainer(trainer_spec(path, lora=LORA, lr=1e-2, kl_coef=0.0))
    trainer.train(make_batch(trainer.model.config.vocab_size), TEMPERATURE)
    view = trainer.push_view()
    return {"manifest": view.manifest,
            "adapters": [(n, t.clone()) for n, t in view.export_tensors([s[0] for s in view.weight_specs()])],
            "merged": {n: t.clone() for n, t in trainer.export_tensors([s[0] for s in trainer.weight_specs()])}}


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_push_moe")
    path = make_tiny_moe_model(str(root / "base"), "qwen2_moe", moe_intermediate_size=48)
    out = root / "job"
    out.mkdir()
    return {"path": path, **run_ranks(job, 1, out, path, str(out))[0]}


def test_adapters_are_on_attention_and_the_shared_expert(pushed):
    adapted = [w for w, *_ in pushed["manifest"]["layers"]]
    assert "model.layers.0.self_attn.q_proj.weight" in adapted
    assert "model.layers.1.mlp.shared_expert.down_proj.weight" in adapted
    assert not [w for w in adapted if ".mlp.experts." in w]  # the fused routed experts are not adapted
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in pushed["merged"])  # the full push carries them


@pytest.mark.timeout(300)
def test_vllm_adapter_push_on_moe_equals_the_merged_push(pushed):
    pytest.importorskip("vllm")
    from chatlearn.models.rollout.vllm import VLLMRollout

    threads, setter = torch.get_num_threads(), torch.set_num_threads
    engine = VLLMRollout(rollout_spec(pushed["path"]))

    def generate():
        return engine.generate(prompts(8, seed=1), dict(SAMPLING))

    try:
        base = generate()
        _adapter_push(engine, pushed)
        adapted = generate()
        _adapter_push(engine, pushed)  # a second push: the experts are not packed again
        again = generate()
        engine.offload(["weights", "kv_cache"])
        engine.onload(["weights", "kv_cache"])
        _adapter_push(engine, pushed)
        woken = generate()
        _full_push(engine, pushed)
        full = generate()
    finally:
        engine.shutdown()
        torch.set_num_threads = setter
        torch.set_num_threads(threads)
    mask = np.array_equal(base["tokens"], full["tokens"])
    assert not mask or np.abs(base["rollout_logprobs"] - full["rollout_logprobs"]).max() > 1e-3  # the push shows
    for got in (adapted, again, woken):
        assert np.array_equal(got["tokens"], full["tokens"])
        assert np.abs(got["rollout_logprobs"] - full["rollout_logprobs"]).max() <= TOL


def test_an_expert_module_trained_in_full_is_not_reloaded_from_the_base_folder(tmp_path):
    """``modules_to_save`` naming an MoE layer's experts: the trainer sends its fused tensors, the folder holds
    them per expert; the merge at ``finish`` must not load the folder's experts over the pushed ones."""
    from chatlearn.models.rollout.lora_push import AdapterMerge, fused_expert_name

    assert fused_expert_name("model.layers.1.mlp.experts.3.up_proj.weight") == "model.layers.1.mlp.experts.gate_up_proj"
    assert fused_expert_name("model.layers.1.mlp.experts.0.down_proj.weight") == "model.layers.1.mlp.experts.down_proj"
    assert fused_expert_name("model.layers.1.mlp.shared_expert.down_proj.weight") is None
    path = make_tiny_moe_model(str(tmp_path / "m"), "qwen3_moe")
    experts = "model.layers.0.mlp.experts"
    merge = AdapterMerge({"base": path, "layers": [], "saved": [f"{experts}.gate_up_proj", f"{experts}.down_proj"],
                          "full_bytes": 0, "renames": {}})
    assert merge.groups == [experts]  # vLLM's expert layer of that name is reloaded: by the pushed tensors alone
    assert not [n for names in merge.plan for n in names if n.startswith(experts + ".")]
