"""LoRA adapter push (models.policy_trainer.lora.push: adapters; chatlearn/models/rollout/lora_push.py): the
trainer sends A, B and the modules_to_save copies alone, the rollout merges them onto the base weights it reads
from the base folder, and generates what it generates after a push of the merged weights (hf, vLLM, SGLang's
strict fake), with the adapters' bytes on the wire.

One spawned FSDP job (1 rank) trains the adapters one step and gives: the pushed tensors and manifest, the
merged weights, a fused push (``local_push``) into two transformers rollouts (adapters vs merged) and the
``shm`` transport's Endpoint pair carrying the adapters into a third. The engines of the main process then take
the job's adapters through ``AdapterMerge`` and the merged weights through a plain update."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from chatlearn.models.specs import LoraSpec
from tests.models.rollout.test_rollout_cpu import _spec as rollout_spec
from tests.models.rollout.test_rollout_cpu import fake_sglang, prompts
from tests.models.trainer.test_fsdp_trainer import TEMPERATURE, make_batch, make_tiny_model, run_ranks, trainer_spec

# q_proj, v_proj (fused with k_proj into vLLM's qkv_proj), down_proj; the final norm trained in full
LORA = LoraSpec(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"),
                modules_to_save=("model.norm",), push="adapters")
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 12, "seed": 3}
TOL = 1e-5


def _generate(engine) -> dict:
    return engine.generate(prompts(8, seed=1), dict(SAMPLING))


def _params(engine) -> dict:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def job(rank, world, path, out):
    from chatlearn.models.rollout.hf import HFRollout
    from chatlearn.models.trainer.fsdp import FSDPTrainer
    from chatlearn.models.weight_buckets import plan_buckets
    from chatlearn.runtime.weight_push.stream import Endpoint, local_push

    spec = trainer_spec(path, lora=LORA, lr=1e-2, kl_coef=0.0)
    trainer = FSDPTrainer(spec)
    trainer.train(make_batch(trainer.model.config.vocab_size), TEMPERATURE)
    view = trainer.push_view()
    res = {"specs": view.weight_specs(), "manifest": view.manifest,
           "adapters": [(n, t.clone()) for n, t in view.export_tensors([s[0] for s in view.weight_specs()])],
           "merged": {n: t.clone() for n, t in trainer.export_tensors([s[0] for s in trainer.weight_specs()])}}
    bucket = 2048  # many buckets
    fused = HFRollout(rollout_spec(path))
    res["fused_bytes"] = local_push(trainer, fused, bucket)
    res["fused"] = (_generate(fused), _params(fused))
    # shm transport: the trainer's Endpoint writes the adapter buckets, the rollout's merges them
    sender, receiver, streamed = Endpoint(trainer), Endpoint(HFRollout(rollout_spec(path))), None
    info = sender.specs()
    buckets = plan_buckets(info["specs"], bucket)
    receiver.open_receiver("shm", buckets, sender.open_sender("shm", buckets, 2))
    sender.release_names()
    receiver.expect_adapters(info["adapters"])
    receiver.begin()
    res["shm_bytes"] = 0
    for k in range(len(buckets)):
        res["shm_bytes"] += sender.send(k, k % 2)
        receiver.recv(k, k % 2)
    receiver.finish()
    streamed = receiver.obj
    res["shm"] = (_generate(streamed), _params(streamed))
    trainer.spec = trainer.spec.replace(lora=LORA.replace(push="merged"))  # the full push of the merged weights
    full = HFRollout(rollout_spec(path))
    res["full_bytes"] = local_push(trainer, full, bucket)
    res["full"] = (_generate(full), _params(full))
    return res


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_push")
    path = make_tiny_model(str(root / "base"))
    out = root / "job"
    out.mkdir()
    return {"path": path, **run_ranks(job, 1, out, path, str(out))[0]}


def _same(a: tuple, b: tuple) -> None:
    """Two (generate batch, parameters) results: the same tokens, log-probs within TOL, weights within TOL."""
    assert np.array_equal(a[0]["tokens"], b[0]["tokens"])
    assert np.abs(a[0]["rollout_logprobs"] - b[0]["rollout_logprobs"]).max() <= TOL
    assert a[1].keys() == b[1].keys()
    assert max(float((a[1][n] - b[1][n]).abs().max()) for n in a[1]) <= TOL


def test_trainer_sends_the_adapters_and_the_saved_modules_alone(pushed):
    names = [n for n, *_ in pushed["specs"]]
    assert names and all(n.endswith((".lora_A.weight", ".lora_B.weight")) or n == "model.norm.weight" for n in names)
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in names and "model.norm.weight" in names
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in pushed["adapters"])
    merged_bytes = sum(t.numel() * t.element_size() for t in pushed["merged"].values())
    assert pushed["manifest"]["full_bytes"] == merged_bytes
    # bytes per push: the adapters' (every tensor here fills whole 64-byte rows: no alignment padding)
    assert pushed["fused_bytes"] == pushed["shm_bytes"] == adapter_bytes < merged_bytes / 10
    assert pushed["full_bytes"] == merged_bytes
    layers = {w: (a, b, s) for w, a, b, s, _ in pushed["manifest"]["layers"]}
    assert layers["model.layers.1.mlp.down_proj.weight"][2] == pytest.approx(2.0)  # alpha / rank
    assert pushed["manifest"]["saved"] == ["model.norm.weight"]


def test_fused_and_shm_adapter_push_equal_the_merged_push(pushed):
    """The trained adapters are in the rollout (its weights moved from the base) and equal to the merged push."""
    from safetensors.torch import load_file

    base = load_file(f"{pushed['path']}/model.safetensors")
    moved = pushed["full"][1]["model.layers.0.self_attn.q_proj.weight"] - base["model.layers.0.self_attn.q_proj.weight"]
    assert float(moved.abs().max()) > 1e-4
    _same(pushed["fused"], pushed["full"])
    _same(pushed["shm"], pushed["full"])


def _adapter_push(engine, pushed) -> None:
    from chatlearn.models.rollout.lora_push import AdapterMerge

    merge = AdapterMerge(pushed["manifest"])
    merge.begin(engine)
    adapters = pushed["adapters"]
    merge.take(engine, adapters[:3])
    merge.take(engine, adapters[3:])
    merge.finish(engine)


def _full_push(engine, pushed) -> None:
    engine.begin_weight_update()
    engine.load_weight_bucket(list(pushed["merged"].items()))
    engine.finish_weight_update()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.timeout(300)
def test_vllm_adapter_push_equals_the_merged_push(pushed):
    """vLLM's CPU backend (layerwise reload): the adapter push reloads only the groups it touches (the other
    layers silently keep their tensors) and the engine then samples what it samples after the merged push;
    so it does after an offload, which on the CPU drops the weights (the rest come from the base folder)."""
    pytest.importorskip("vllm")
    from chatlearn.models.rollout.vllm import VLLMRollout

    threads, setter = torch.get_num_threads(), torch.set_num_threads
    engine = VLLMRollout(rollout_spec(pushed["path"]))
    records = _Records()
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    log.addHandler(records)
    try:
        _adapter_push(engine, pushed)
        adapted = _generate(engine)
        _adapter_push(engine, pushed)  # a second push: the reload's state is reset between pushes
        again = _generate(engine)
        engine.offload(["weights", "kv_cache"])  # on the CPU the weights come back empty: the push refills them
        engine.onload(["weights", "kv_cache"])
        _adapter_push(engine, pushed)
        woken = _generate(engine)
        log.removeHandler(records)
        _full_push(engine, pushed)
        full = _generate(engine)
    finally:
        log.removeHandler(records)
        engine.llm.llm_engine.engine_core.shutdown()
        torch.set_num_threads = setter
        torch.set_num_threads(threads)
    assert not [m for m in records.messages if "Failed to load" in m], records.messages
    for got in (adapted, again, woken):
        assert np.array_equal(got["tokens"], full["tokens"])
        assert np.abs(got["rollout_logprobs"] - full["rollout_logprobs"]).max() <= TOL


def test_sglang_adapter_push_equals_the_merged_push(pushed):
    """SGLang (strict fake of update_weights_from_tensor): the merged groups reach the engine by name, and its
    weights equal those of the merged push."""
    from chatlearn.models.rollout.sglang import SGLangRollout

    with fake_sglang():
        engine = SGLangRollout(rollout_spec(pushed["path"]))
    try:
        model = engine.engine.model
        base = _params_of(model)
        _adapter_push(engine, pushed)
        adapted = _params_of(model)
        _full_push(engine, pushed)
        full = _params_of(model)
    finally:
        engine.shutdown()
    assert max(float((adapted[n] - base[n]).abs().max()) for n in base) > 1e-4
    assert max(float((adapted[n] - full[n]).abs().max()) for n in base) <= TOL


def _params_of(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}
