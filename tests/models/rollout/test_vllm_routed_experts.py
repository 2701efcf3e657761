"""Routing replay on the vLLM rollout: vLLM 0.32's routed experts, the fake that models them held to the
installed vLLM, and the adapter's capture on the fake.

Against the installed vLLM (skipped without it, or another release than the fake models): one subprocess
reports what the fake models of it: ``CompletionOutput``'s fields (``routed_experts`` among them, the fake's
in the same order with the same defaults), ``EngineArgs.enable_return_routed_experts`` (the switch the
adapter passes), ``SamplingParams.routed_experts_prompt_start`` (0: the prompt's routes from its first token),
and, from vLLM's source, the rules the fake follows: the rows' dtype (uint8 for 256 experts or fewer, else
uint16), their layer axis (every decoder layer: ``get_total_num_hidden_layers``), their token range (up to
``num_tokens - 1``: the last sampled token has none) and the configurations vLLM refuses (Model Runner V1, a
dense model, prefix caching off).

On the fake: the adapter's batch carries ``routed_experts`` aligned with the tokens, the MoE layers' rows
only, the last token without record; a model with no MoE and a vLLM that returns none stop with one
paragraph naming ``models.policy_trainer.routing_replay``.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from test_vllm_weight_paths import _spec, fake_vllm, restore_threads  # noqa: F401

from chatlearn.errors import UserError
from chatlearn.models.moe import layout

MODELLED = "0.32"

REAL_FACTS = r'''
import dataclasses, inspect, json
import vllm
from vllm.outputs import CompletionOutput
from vllm.engine.arg_utils import EngineArgs
from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams
import msgspec
from vllm.model_executor.layers.fused_moe import routed_experts_capturer as cap
from vllm.distributed.aux_output_connector import connector as conn
out = {"version": vllm.__version__}
out["completion_fields"] = [[f.name, "<none>" if f.default is dataclasses.MISSING else repr(f.default)]
                            for f in dataclasses.fields(CompletionOutput)]
out["engine_arg"] = repr({f.name: f.default for f in dataclasses.fields(EngineArgs)}["enable_return_routed_experts"])
out["prompt_start"] = repr({f.name: f.default for f in msgspec.structs.fields(SamplingParams)}
                           .get("routed_experts_prompt_start", "<absent>"))
out["capturer"] = inspect.getsource(cap.RoutedExpertsCapturer.__init__)
out["shape"] = inspect.getsource(cap._get_routed_experts_shape)
out["take_output"] = inspect.getsource(conn.AuxOutputSchedulerConnector.take_output)
out["verify"] = inspect.getsource(VllmConfig._verify_aux_output_compatibility)
print("FACTS" + json.dumps(out))
'''


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    spec = importlib.util.find_spec("vllm")
    if spec is None or "fake_vllm" in (spec.origin or ""):
        pytest.skip("vLLM is not installed (the fake is compared with the real package)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    proc = subprocess.run([sys.executable, "-c", REAL_FACTS], capture_output=True, text=True, env=env,
                          cwd=str(tmp_path_factory.mktemp("real_vllm_routes")), timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FACTS")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    facts = json.loads(lines[-1][len("FACTS"):])
    if facts["version"].split(".")[:2] != MODELLED.split("."):
        pytest.skip(f"the fake models vLLM {MODELLED}; vLLM {facts['version']} is installed")
    return facts


def test_fake_completion_output_is_vllms(real):
    with fake_vllm():
        from vllm.outputs import CompletionOutput

        fake = [[f.name, "<none>" if f.default is dataclasses.MISSING else repr(f.default)]
                for f in dataclasses.fields(CompletionOutput)]
    names = [f[0] for f in real["completion_fields"]]
    assert "routed_experts" in names
    for field in fake:  # each of the fake's fields is vLLM's, with its default
        assert field in real["completion_fields"], field
    assert [f[0] for f in fake] == [n for n in names if n in {f[0] for f in fake}]  # same order: positional use


def test_the_rules_the_fake_follows_are_in_vllms_source(real):
    assert real["engine_arg"] == "False" and real["prompt_start"] == "0"
    assert '"uint8" if num_experts <= 256 else "uint16"' in real["capturer"]
    assert "self.shape_per_token = (num_layers, num_experts_per_tok)" in real["capturer"]
    assert "get_total_num_hidden_layers()" in real["shape"]  # every decoder layer has a row
    assert "token_end = request.num_tokens - 1" in real["take_output"]  # no row for the last sampled token
    for refusal in ("requires Model Runner V2", "only supports MoE models", "requires prefix caching"):
        assert refusal in real["verify"], refusal


# ----------------------------------------------------------------------------- the adapter on the fake

def _moe_folder(tiny_model_dir: str, folder, **extra) -> str:
    """The tiny (dense) model with a config.json that declares experts: the fake engine loads its weights as
    they are and reports routes for its MoE layers (here layer 1 alone: layer 0 is mlp_only)."""
    shutil.copytree(tiny_model_dir, folder)
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        conf = json.load(f)
    conf.update({"num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [0],
                 **extra})
    with open(path, "w", encoding="utf-8") as f:
        json.dump(conf, f)
    return str(folder)


def test_vllm_rollout_records_the_routes_of_every_token_but_the_last(  # noqa: F811 (restore_threads)
        tiny_model_dir, tmp_path, restore_threads):
    path = _moe_folder(tiny_model_dir, tmp_path / "moe")
    lay = layout.layout_of_folder(path)
    assert lay.layers == 1 and lay.decoder_layers == (1,)
    with fake_vllm():
        from vllm.v1.engine import _fake_sampling

        from chatlearn.models.rollout.vllm import VLLMRollout

        engine = VLLMRollout(_spec(path, routing_replay="rollout"))
        prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
        batch = engine.generate(prompts, {"temperature": 1.0, "max_tokens": 5, "seed": 1})
        fingerprint = engine.llm.llm_engine.worker.model_runner.weights_fingerprint()
        config = engine.llm.llm_engine.model_config
        col = batch["routed_experts"]
        assert col.dtype == np.uint8 and col.shape == (len(batch["tokens"]), 1, 2)
        off = batch["offsets"]
        for i in range(len(prompts)):
            tokens = [int(t) for t in batch["tokens"][off[i]:off[i + 1]]]
            got = layout.decode(col[off[i]:off[i + 1]])
            want = _fake_sampling.routed_experts(tokens, fingerprint, config)  # every decoder layer
            assert np.array_equal(got[:-1], want[:, [1]].astype(np.int64))  # the MoE layer's rows, in order
            assert (got[-1] == -1).all()  # the last sampled token: no record
        off_engine = VLLMRollout(_spec(path))  # routing_replay off: no column, vLLM not asked
        assert "routed_experts" not in off_engine.generate(prompts, {"temperature": 1.0, "max_tokens": 3, "seed": 1})
        assert off_engine.llm.llm_engine.vllm_config.aux_output_config.enable_return_routed_experts is False


def test_vllm_routes_missing_or_refused_say_which_key(  # noqa: F811 (restore_threads)
        tiny_model_dir, tmp_path, restore_threads, monkeypatch):
    path = _moe_folder(tiny_model_dir, tmp_path / "moe")
    with fake_vllm():
        from chatlearn.models.rollout.vllm import VLLMRollout

        engine = VLLMRollout(_spec(path, routing_replay="rollout"))
        real_generate = engine.llm.generate

        def without_routes(*args, **kwargs):  # an engine that does not return them
            outs = real_generate(*args, **kwargs)
            for o in outs:
                for c in o.outputs:
                    c.routed_experts = None
            return outs

        monkeypatch.setattr(engine.llm, "generate", without_routes)
        with pytest.raises(UserError, match="models.policy_trainer.routing_replay") as err:
            engine.generate([[3, 4]], {"temperature": 1.0, "max_tokens": 3, "seed": 1})
        assert "enable_return_routed_experts" in str(err.value) and "routing_replay: off" in str(err.value)
        # vLLM's own refusals at start (a dense model, Model Runner V1) name the key too
        with pytest.raises(UserError, match="models.policy_trainer.routing_replay.*only supports MoE models"):
            VLLMRollout(_spec(tiny_model_dir, routing_replay="rollout"))
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
        with pytest.raises(UserError, match="models.policy_trainer.routing_replay.*Model Runner V2"):
            VLLMRollout(_spec(path, routing_replay="rollout"))


REAL_RUN = r'''
import json, sys
sys.path.insert(0, sys.argv[3])
import numpy as np
import backend_specs
from chatlearn.errors import UserError
from chatlearn.models.moe import layout
from chatlearn.models.rollout.vllm import VLLMRollout

if __name__ == "__main__":
    spec = backend_specs.rollout_spec(sys.argv[1], routing_replay="rollout", generation_batch_size=4, device="cpu",
                                      max_prompt_tokens_length=16, max_response_tokens_length=8)
    try:
        engine = VLLMRollout(spec)
    except UserError as err:
        print("RESULT" + json.dumps({"refused": str(err)}))
        sys.exit(0)
    prompts = json.loads(sys.argv[2])
    batch = engine.generate(prompts, {"temperature": 0.0, "max_tokens": 6, "seed": 1})
    print("RESULT" + json.dumps({"tokens": batch["tokens"].tolist(), "offsets": batch["offsets"].tolist(),
                                 "routes": layout.decode(batch["routed_experts"]).tolist()}))
    engine.shutdown()
'''


@pytest.mark.timeout(400)
def test_the_installed_vllm_returns_routes_or_refuses_naming_the_key(real, tmp_path):
    """The adapter on the installed vLLM and a tiny Qwen3-MoE: where vLLM can return routed experts (Model
    Runner V2, with Triton), they are the transformers model's own top-k (float32, greedy); where it cannot
    (this machine's CPU build has no Triton), the engine's start stops with the paragraph naming the key."""
    import torch
    from tiny_moe import make_tiny_moe
    from transformers import AutoModelForCausalLM

    from chatlearn.models.moe.routing import routers

    path = make_tiny_moe(str(tmp_path / "moe"), seed=1)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
    support = os.path.join(os.path.dirname(__file__), "..", "..", "support")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "ERROR",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                         if p and "fake_vllm" not in p]])}
    proc = subprocess.run([sys.executable, "-c", REAL_RUN, path, json.dumps(prompts), support], capture_output=True,
                          text=True, env=env, cwd=str(tmp_path), timeout=360)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    found = json.loads(lines[-1][len("RESULT"):])
    if "refused" in found:
        assert found["refused"].startswith("models.policy_trainer.routing_replay:"), found
        assert "Model Runner V2" in found["refused"] and "routing_replay: off" in found["refused"]
        return
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rec = []
    for r in routers(model):
        r.register_forward_hook(lambda m, i, o: rec.append(o[2]))
    off, routes = found["offsets"], np.array(found["routes"])
    agree = total = 0
    for i in range(len(prompts)):
        rec.clear()
        with torch.no_grad():
            model(input_ids=torch.tensor(found["tokens"][off[i]:off[i + 1]])[None])
        own = np.sort(torch.stack(rec, 1).numpy(), -1)
        got = routes[off[i]:off[i + 1]]
        has = (got >= 0).all((-1, -2))
        assert has[:-1].all() and not has[-1]
        agree += int((np.sort(got[has], -1) == own[has]).all(-1).sum())
        total += int(has.sum()) * own.shape[1]
    assert agree >= 0.9 * total, (agree, total)


def test_the_refusal_gives_vllms_reason_without_pydantics_wrapping():
    from chatlearn.errors import UserError
    from chatlearn.models.rollout.vllm import routes_refused

    raised = ("1 validation error for VllmConfig\n  Value error, AuxOutput Connector requires Model Runner V2; set "
              "VLLM_USE_V2_MODEL_RUNNER=1. [type=value_error, input_value=ArgsKwargs((), {'model': 'x'}), "
              "input_type=ArgsKwargs]")
    with pytest.raises(UserError) as info:
        with routes_refused("rollout"):
            raise ValueError(raised)
    text = str(info.value)
    assert "routing replay is on, but this vLLM cannot return the routed experts: AuxOutput Connector requires " \
           "Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1. vLLM 0.32" in text
    assert "ArgsKwargs" not in text and "type=" not in text and info.value.key == "models.policy_trainer.routing_replay"
    with pytest.raises(ValueError):  # replay off: vLLM's own error, untouched
        with routes_refused("off"):
            raise ValueError(raised)
