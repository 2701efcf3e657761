"""presence / frequency / repetition penalties in every rollout backend, against vLLM's
definitions written out by hand."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_rollout_cpu import (MAX_RESPONSE, fake_sglang, hf, model_dirs,  # noqa: F401
                              prompts, push, reference, restore_threads, sglang, slices, vllm)

from chatlearn.models.rollout.common import parse_sampling
from chatlearn.models.rollout.hf import PenaltyLogitsProcessor


def penalise(logits: np.ndarray, prompt: list, output: list, presence=0.0, frequency=0.0,
             repetition=1.0) -> np.ndarray:
    """The reference: vLLM's penalties on one row of logits, token by token."""
    out = np.array(logits, dtype=np.float64)
    for v in set(prompt) | set(output):
        out[v] = out[v] / repetition if out[v] > 0 else out[v] * repetition
    for v in set(output):
        out[v] -= presence + frequency * output.count(v)
    return out


def test_logits_processor_matches_the_reference_formula():
    rng = np.random.default_rng(0)
    vocab, width = 11, 4
    prompts_ = [[3, 3, 5], [1, 2, 7, 2]]  # the first row has one slot of left padding (pad 0)
    outputs = [[5, 9, 9, 0], [2, 2, 4, 10]]
    ids = torch.tensor([[0] + prompts_[0] + outputs[0], prompts_[1] + outputs[1]])
    scores = torch.tensor(rng.normal(size=(2, vocab)), dtype=torch.float32)
    for presence, frequency, repetition in [(0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.8),
                                            (-0.4, 1.3, 0.6), (1.0, 0.25, 2.5)]:
        proc = PenaltyLogitsProcessor(width, [1, 0], presence, frequency, repetition)
        got = proc(ids, scores.clone()).numpy()
        for i in range(2):
            want = penalise(scores[i].numpy(), prompts_[i], outputs[i], presence, frequency, repetition)
            np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
        # the padding token 0 is penalised in row 0 only because the output holds it
        if repetition != 1.0:
            assert got[1][0] == pytest.approx(scores[1][0].item())


def test_parse_sampling_defaults_are_neutral():
    sp = parse_sampling({"temperature": 1.0, "max_tokens": 3})
    assert (sp["presence_penalty"], sp["frequency_penalty"], sp["repetition_penalty"]) == (0.0, 0.0, 1.0)


@pytest.fixture(params=["hf", "vllm", "sglang"])
def rollout(request, model_dirs):  # noqa: F811
    engine = request.getfixturevalue(request.param)
    push(engine, model_dirs["old"])
    return engine


@pytest.mark.timeout(300)
@pytest.mark.parametrize("penalties", [{"repetition_penalty": 2.0},
                                       {"presence_penalty": 2.0, "frequency_penalty": 1.5}],
                         ids=["repetition", "presence_frequency"])
def test_greedy_decoding_follows_the_penalised_logits(rollout, reference, penalties):
    """Greedy decoding picks, at each step, the argmax of the penalised logits of the full
    forward; and the penalties change the output compared to none."""
    sampling = {"temperature": 0.0, "max_tokens": MAX_RESPONSE}
    plain = rollout.generate(prompts(8), sampling)
    batch = rollout.generate(prompts(8), dict(sampling, **penalties))
    args = {"presence": penalties.get("presence_penalty", 0.0),
            "frequency": penalties.get("frequency_penalty", 0.0),
            "repetition": penalties.get("repetition_penalty", 1.0)}
    for sl, plen, logits in zip(slices(batch), batch["prompt_lens"], reference.logits("old", batch)):
        tokens = batch["tokens"][sl].tolist()
        prompt, resp = tokens[:int(plen)], tokens[int(plen):]
        for s, tok in enumerate(resp):
            row = penalise(logits[s].numpy(), prompt, resp[:s], **args)
            assert tok == int(np.argmax(row)), (s, tok, int(np.argmax(row)))
    assert not np.array_equal(plain["tokens"], batch["tokens"])


def test_training_and_eval_sampling_take_their_own_penalties():

    from omegaconf import OmegaConf

    from chatlearn.config.schema import Config
    from chatlearn.runtime.driver.sampling import Sampling

    cfg = OmegaConf.structured(Config)
    p = cfg.models.policy
    p.presence_penalty, p.frequency_penalty, p.repetition_penalty = 0.1, 0.2, 1.3
    p.eval_presence_penalty, p.eval_frequency_penalty, p.eval_repetition_penalty = -0.5, 0.7, 1.1
    host = Sampling(cfg, None, None, None, None)
    train = host.params(eval_mode=False, seed=1)
    evaluation = host.params(eval_mode=True, seed=1)
    got = lambda s: (s["presence_penalty"], s["frequency_penalty"], s["repetition_penalty"])  # noqa: E731
    assert got(train) == (0.1, 0.2, 1.3)
    assert got(evaluation) == (-0.5, 0.7, 1.1)
    assert parse_sampling(evaluation)["frequency_penalty"] == 0.7
