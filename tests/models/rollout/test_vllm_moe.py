"""The vLLM rollout on mixture-of-experts models (Qwen3-MoE; Qwen2-MoE with a shared expert), on vLLM's CPU
backend (its ``CPUUnquantizedExperts`` kernel: fp32 here), in-process, one engine per model kind.

* The engine's log-probs (probe and sampled tokens) equal a full-sequence transformers forward.
* A weight push of the trainer's tensors (transformers 5 names: fused ``mlp.experts.gate_up_proj`` [E, 2I, H] and
  ``mlp.experts.down_proj`` [E, H, I], what the FSDP trainer's ``weight_specs`` lists), in buckets planned as
  the push plans them and small enough to split an MoE layer over several, lands: the probe's log-probs equal
  the pushed model's. So does a push of per-expert names (``mlp.experts.{e}.gate_proj.weight``: a Hugging
  Face folder's), a second push (the CPU kernel's prepacking is not applied twice), a push after the weights
  were offloaded and woken empty, and a reload from the model folder.
* The expert weights on the CPU backend are prepacked after loading, a step vLLM 0.32 skips on every reload
  (``repack_cpu_moe_on_reload``): a strict fake of its method checks that the step runs exactly once per load,
  with vLLM 0.32's method and with one that runs it itself.
"""
from __future__ import annotations

import copy
import os
import types

import numpy as np
import pytest
import torch
from backend_specs import rollout_spec
from tiny_moe_models import KINDS, make_tiny_moe_model, per_expert, perturbed

TOL = 1e-4
PROBE = list(range(5, 45))


@pytest.fixture(scope="module")
def restore_threads():
    threads, setter = torch.get_num_threads(), torch.set_num_threads
    yield
    torch.set_num_threads = setter
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=KINDS)
def moe(request, tmp_path_factory, restore_threads):
    """(engine, folder model) of one kind: moe_intermediate_size 48, which the CPU kernel pads to 64."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from chatlearn.models.rollout.vllm import VLLMRollout

    path = make_tiny_moe_model(str(tmp_path_factory.mktemp(request.param) / "m"), request.param,
                               moe_intermediate_size=48)
    rollout = VLLMRollout(rollout_spec(path, cpu_threads=1, max_prompt_tokens_length=48,
                                       max_response_tokens_length=12))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield rollout, model
    rollout.shutdown()


@torch.no_grad()
def hf_probe(model, tokens: list[int]) -> np.ndarray:
    logp = model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
    return np.array([logp[i - 1, t].item() for i, t in enumerate(tokens) if i > 0], dtype=np.float32)


def gap(rollout, model) -> float:
    return float(np.abs(rollout.probe_logprobs(PROBE)["logprobs"] - hf_probe(model, PROBE)).max())


def push(rollout, named, bucket_bytes: int) -> list[list[str]]:
    """One update of ``named`` in the buckets the weight push plans (``plan_buckets``: each trainer parameter its
    own group, as ``weight_specs`` gives them); returns the names per bucket."""
    from chatlearn.models.weight_buckets import plan_buckets

    tensors = dict(named)
    specs = [(n, "float32", tuple(t.shape), i) for i, (n, t) in enumerate(named)]
    buckets = [list(index.names) for index in plan_buckets(specs, bucket_bytes)]
    rollout.begin_weight_update()
    for names in buckets:
        rollout.load_weight_bucket([(n, tensors[n].detach().clone()) for n in names])
    rollout.finish_weight_update()
    return buckets


def trainer_tensors(model) -> list:
    """What the FSDP trainer pushes: its parameters under their names (a tied lm_head is not among them)."""
    return [(n, p.detach()) for n, p in model.named_parameters()]


def test_folder_logprobs_equal_transformers(moe):
    rollout, model = moe
    assert gap(rollout, model) < TOL
    batch = rollout.generate([[5, 6, 7, 8], [20, 21, 22]] * 3,
                             {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 12, "seed": 3})
    off, plens = batch["offsets"], batch["prompt_lens"]
    assert (np.diff(off) > plens).all()  # every sample has response tokens
    for i in range(len(plens)):
        tokens = batch["tokens"][off[i]:off[i + 1]].tolist()
        expect = hf_probe(model, tokens)[int(plens[i]) - 1:]
        got = batch["rollout_logprobs"][off[i] + int(plens[i]):off[i + 1]]
        np.testing.assert_allclose(got, expect, atol=TOL)


def test_push_of_fused_expert_tensors_lands(moe):
    rollout, model = moe
    new = perturbed(copy.deepcopy(model), seed=11)
    assert gap(rollout, new) > 0.05  # the push has something to show
    named = trainer_tensors(new)
    experts = [n for n, _ in named if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert experts and all(dict(named)[n].dim() == 3 for n in experts)
    buckets = push(rollout, named, bucket_bytes=96 * 1024)
    where = {n: i for i, names in enumerate(buckets) for n in names}
    # an MoE layer's gate/up and down tensors arrive in different buckets: the layer is split over them
    assert any(where[n] != where[n.replace("gate_up_proj", "down_proj")] for n in experts if "gate_up" in n)
    assert gap(rollout, new) < TOL
    push(rollout, named, bucket_bytes=1 << 30)  # again, one bucket: nothing packed twice
    assert gap(rollout, new) < TOL


def test_push_of_per_expert_names_lands(moe):
    rollout, model = moe
    new = perturbed(copy.deepcopy(model), seed=12)
    push(rollout, per_expert(trainer_tensors(new)), bucket_bytes=64 * 1024)
    assert gap(rollout, new) < TOL


def test_push_after_offload_and_folder_reload(moe):
    rollout, model = moe
    new = perturbed(copy.deepcopy(model), seed=13)
    rollout.offload(["weights", "kv_cache"])
    rollout.onload(["weights", "kv_cache"])
    push(rollout, trainer_tensors(new), bucket_bytes=128 * 1024)
    assert gap(rollout, new) < TOL
    # vLLM's own reload from the folder goes through the same post-load processing
    rollout.llm.collective_rpc("chatlearn_reload_from_folder")
    rollout.llm.reset_prefix_cache()
    assert gap(rollout, model) < TOL


# -- the repacking on reload, against strict fakes of vLLM 0.32's classes ----------------------------------

def _fake_layer_and_method(runs_experts_step_on_update: bool):
    """A RoutedExperts-like layer whose ``quant_method`` behaves as vLLM 0.32's ``UnquantizedFusedMoEMethod``
    (the experts' own ``process_weights_after_loading`` on the first load only) or, with
    ``runs_experts_step_on_update``, as a vLLM that runs it on every load."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    experts = object.__new__(CPUUnquantizedExperts)
    experts.steps = 0

    def experts_step(layer):
        experts.steps += 1

    experts.process_weights_after_loading = experts_step
    method = types.SimpleNamespace(moe_kernel=None)

    def process_weights_after_loading(layer):
        update = method.moe_kernel is not None
        if not update:
            method.moe_kernel = types.SimpleNamespace(fused_experts=experts)
        if not update or runs_experts_step_on_update:
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    method.process_weights_after_loading = process_weights_after_loading
    layer = torch.nn.Module()
    layer.quant_method = method
    return layer, method, experts


@pytest.mark.parametrize("upstream_runs_it", [False, True])
def test_cpu_experts_are_prepacked_once_per_load(upstream_runs_it):
    pytest.importorskip("vllm")
    from chatlearn.models.rollout.vllm import repack_cpu_moe_on_reload

    layer, method, experts = _fake_layer_and_method(upstream_runs_it)
    model = torch.nn.Sequential(layer)
    method.process_weights_after_loading(layer)  # the engine's first load: the kernel is built
    assert experts.steps == 1
    assert repack_cpu_moe_on_reload(model) == 1
    assert repack_cpu_moe_on_reload(model) == 0  # once per layer
    for load in range(2, 4):  # reloads
        method.process_weights_after_loading(layer)
        assert experts.steps == load


def test_installed_vllm_skips_the_experts_step_on_updates():
    """What :func:`repack_cpu_moe_on_reload` works around is still in the installed vLLM: the update branch
    of ``UnquantizedFusedMoEMethod._setup_kernel`` does not reach the experts' own processing."""
    pytest.importorskip("vllm")
    import inspect

    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    lines = inspect.getsource(UnquantizedFusedMoEMethod._setup_kernel).splitlines()
    guard = next(i for i, line in enumerate(lines) if "if not is_weight_update" in line)
    calls = [i for i, line in enumerate(lines) if "fused_experts.process_weights_after_loading" in line]

    def indent(line: str) -> int:
        return len(line) - len(line.lstrip())

    assert calls and all(i > guard and indent(lines[i]) > indent(lines[guard]) for i in calls)


# -- which path loads the pushed weights -----------------------------------------------------------------

def test_moe_kernels_that_relayout_take_the_layerwise_path():
    from chatlearn.models.rollout.vllm import weight_load_path

    assert weight_load_path(on_cpu=False, quantized=False, layerwise=True, moe_relayout=False) == "load_weights"
    assert weight_load_path(on_cpu=False, quantized=False, layerwise=True, moe_relayout=True) == "layerwise"
    with pytest.raises(NotImplementedError, match="MoE layers"):
        weight_load_path(on_cpu=False, quantized=False, layerwise=False, moe_relayout=True)


def test_relayout_layers_are_those_of_backends_that_change_the_layout():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    from chatlearn.models.rollout.vllm import AS_LOADED_MOE_BACKENDS, moe_relayout_layers

    assert set(AS_LOADED_MOE_BACKENDS) <= {b.name for b in UnquantizedMoeBackend}

    def model(*backends):
        root = torch.nn.Module()
        for i, b in enumerate(backends):
            layer = torch.nn.Module()
            layer.quant_method = types.SimpleNamespace(unquantized_backend=UnquantizedMoeBackend[b])
            root.add_module(f"experts{i}", layer)
        root.add_module("dense", torch.nn.Linear(2, 2))
        return root

    assert moe_relayout_layers(model("TRITON", "TRITON")) == []
    assert moe_relayout_layers(model("TRITON", "FLASHINFER_CUTLASS")) == ["experts1"]
    assert moe_relayout_layers(model("CPU")) == ["experts0"]


# -- models.policy.expert_model_parallel_size -------------------------------------------------------------

def test_expert_parallel_reaches_the_engine(tmp_path, monkeypatch):
    """> 1: vLLM's enable_expert_parallel (the engine's arguments, recorded by a stand-in LLM, on a platform that
    is not the CPU backend, which refuses it)."""
    pytest.importorskip("vllm")
    import vllm
    from vllm.platforms import current_platform

    from chatlearn.models.rollout.vllm import VLLMRollout

    seen = {}

    class Stop(Exception):
        pass

    def fake_llm(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    path = make_tiny_moe_model(str(tmp_path / "m"), "qwen3_moe")
    for ep, expected in ((1, False), (2, True)):
        with pytest.raises(Stop):
            VLLMRollout(rollout_spec(path, tensor_model_parallel_size=ep, expert_model_parallel_size=ep,
                                     kv_cache="utilization"))
        assert seen["enable_expert_parallel"] is expected and seen["tensor_parallel_size"] == ep


def _local_experts(worker) -> list:
    """Per MoE layer of this rank: the number of experts its w13_weight holds (run in each vLLM worker)."""
    model = worker.model_runner.get_model()
    return [int(m.w13_weight.shape[0]) for m in model.modules() if hasattr(m, "w13_weight")]


def test_expert_parallel_is_refused_on_the_cpu_backend(tmp_path):
    """vLLM 0.32's CPU MoE kernel ignores the expert map: with enable_expert_parallel (TP 2 x EP 2) its worker
    died of a segmentation fault at the first forward; the rollout refuses before the engine starts."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the CPU backend's refusal")
    from chatlearn.errors import ConfigError
    from chatlearn.models.rollout.vllm import VLLMRollout

    path = make_tiny_moe_model(str(tmp_path / "m"), "qwen3_moe")
    with pytest.raises(ConfigError, match="models.policy.expert_model_parallel_size: is 2, but vLLM's CPU backend"):
        VLLMRollout(rollout_spec(path, cpu_threads=1, tensor_model_parallel_size=2, expert_model_parallel_size=2))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(600)
def test_vllm_expert_parallel_two_gpus(tmp_path, restore_threads):
    """tensor_model_parallel_size 2 with expert_model_parallel_size 2 (vLLM's enable_expert_parallel): each rank
    holds half of the experts whole, the engine's log-probs are the model's (fp32), and a push of the trainer's
    fused expert tensors (every rank receives the full tensors and keeps its experts) lands."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from chatlearn.models.rollout.vllm import VLLMRollout

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # _local_experts through collective_rpc: test only
    path = make_tiny_moe_model(str(tmp_path / "m"), "qwen3_moe", moe_intermediate_size=48)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = VLLMRollout(rollout_spec(path, device="cuda", tensor_model_parallel_size=2,
                                      expert_model_parallel_size=2, max_prompt_tokens_length=48,
                                      max_response_tokens_length=12, deterministic_inference=False))
    try:
        assert engine.llm.llm_engine.vllm_config.parallel_config.enable_expert_parallel
        assert engine.llm.collective_rpc(_local_experts) == [[2, 2], [2, 2]]  # 4 experts over 2 ranks, 2 layers
        assert gap(engine, model) < 1e-3
        new = perturbed(copy.deepcopy(model), seed=21)
        push(engine, trainer_tensors(new), bucket_bytes=96 * 1024)
        assert gap(engine, new) < 1e-3
    finally:
        engine.shutdown()


def test_cpu_moe_kernel_shape_is_checked_before_the_engine_starts(tmp_path):
    from chatlearn.errors import ConfigError
    from chatlearn.models.rollout.vllm import cpu_moe_problem

    assert cpu_moe_problem({"num_experts": 8, "hidden_size": 128}) is None
    assert cpu_moe_problem({"hidden_size": 80}) is None  # dense: vLLM's linear layers take any size
    assert "hidden_size 80" in cpu_moe_problem({"num_local_experts": 8, "hidden_size": 80})
    assert cpu_moe_problem({"text_config": {"num_experts": 4, "hidden_size": 96}}) is None
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the CPU backend's check")
    import json

    from chatlearn.models.rollout.vllm import VLLMRollout

    path = make_tiny_moe_model(str(tmp_path / "m"), "qwen3_moe")
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    conf.update(hidden_size=80)
    (tmp_path / "m" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match="models.policy.load: .*hidden_size 80 is not a multiple of 32"):
        VLLMRollout(rollout_spec(path, cpu_threads=1))
