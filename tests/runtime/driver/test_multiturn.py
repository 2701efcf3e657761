"""The multi-turn rollout loop (chatlearn.runtime.driver.multiturn) against a scripted engine and scripted
environments: the batch is the trajectories token for token, the loss mask covers the model's
tokens only, every way a trajectory ends is recorded, and environment calls are bounded in time
and concurrency."""
from __future__ import annotations

import threading
import time

import multiturn_envs
import numpy as np
import pytest
from omegaconf import OmegaConf

from chatlearn.config.schema import Config
from chatlearn.data.turns import TurnTemplate
from chatlearn.errors import UserError
from chatlearn.runtime.driver.multiturn import (DONE, ERROR, STATUSES, TIMEOUT, TURN_SEED_STRIDE,
                                         EnvCalls, MultiTurnLoop, env_metrics, trajectory_fields)
from chatlearn.runtime.driver.sampling import Prompts

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 64, "seed": 7}


@pytest.fixture(scope="module")
def tok():
    from tiny_model import make_tokenizer

    return make_tokenizer()


def make_cfg(**multi_turn):
    cfg = OmegaConf.structured(Config)
    p = cfg.models.policy
    p.max_prompt_tokens_length, p.max_response_tokens_length = 32, 64
    mt = {"environment": "multiturn_envs:ScriptedEnv", "max_turns": 3, "num_workers": 4, "step_timeout_s": 5.0,
          "reward_discount": 0.9, **multi_turn}
    for k, v in mt.items():
        p.multi_turn[k] = v
    return cfg


class FakeEngine:
    """A deterministic rollout engine: turn t of a trajectory (counted per prompt's first token) is the
    text ``a<t>`` then the end-of-turn token; log-probs -0.01 x (position in the call's response + 1);
    ``max_tokens`` and the context cut it as an engine does (finish reason 0)."""

    def __init__(self, tok, turn_texts: dict | None = None):
        self.tok, self.turn_texts = tok, turn_texts or {}
        self.eos = tok.encode("<|im_end|>", add_special_tokens=False)[0]
        self.counts: dict = {}
        self.calls: list = []  # (prompts, sampling, outputs)

    def __call__(self, prompts, sampling):
        outs = []
        for p in prompts:
            t = self.counts.get(p[0], 0)
            self.counts[p[0]] = t + 1
            text = self.turn_texts.get((p[0], t), f"a{t}")
            full = self.tok.encode(text, add_special_tokens=False) + [self.eos]
            outs.append(full[:sampling["max_tokens"]])
        self.calls.append(([list(p) for p in prompts], dict(sampling), outs))
        from chatlearn.models.rollout.common import pack_samples

        return pack_samples([list(p) for p in prompts], outs,
                            [[-0.01 * (j + 1) for j in range(len(o))] for o in outs],
                            [o[-1] == self.eos for o in outs])


def chat_ids(tok, messages) -> list:
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


def prompts_for(tok, keys: list[str], k: int = 1) -> Prompts:
    messages = [[{"role": "user", "content": key}] for key in keys for _ in range(k)]
    # the first token tells the fake engine's trajectories apart: a distinct token per sample
    ids = [[i + 3] + chat_ids(tok, m) for i, m in enumerate(messages)]
    return Prompts(ids=ids, truths=["1"] * len(ids), sources=["s"] * len(ids), extra=[{}] * len(ids),
                   messages=messages)


def test_trajectories_are_the_turns_and_observations_token_for_token(tok):
    multiturn_envs.RECORD.clear()
    script = {"t0": [["obs one", 0.5, False, {"hits": 1}], [None, 1.0, True, {"hits": 2}]],
              "t1": [["x", 0.0, False, {}], [[{"role": "tool", "content": "y"}], 0.0, False, {}],
                     ["z", 1.0, False, {}]],
              "t2": [[None, 2.0, True, {}]]}
    cfg = make_cfg(environment_kwargs={"script": script})
    roll = MultiTurnLoop(cfg, tok)
    engine = FakeEngine(tok)
    prompts = prompts_for(tok, ["t0", "t1", "t2"])
    batch = roll.run(engine, prompts, SAMPLING, "the test rollouts")

    template = TurnTemplate(tok, roles=("user", "tool"))
    eos = engine.eos

    def turn(t):
        return tok.encode(f"a{t}", add_special_tokens=False) + [eos]

    expected = {  # sample -> [(ids, is the model's)]
        0: [(turn(0), 1), (template.observation_ids([{"role": "user", "content": "obs one"}], eos), 0),
            (turn(1), 1)],
        1: [(turn(0), 1), (template.observation_ids([{"role": "user", "content": "x"}], eos), 0),
            (turn(1), 1), (template.observation_ids([{"role": "tool", "content": "y"}], eos), 0), (turn(2), 1)],
        2: [(turn(0), 1)],
    }
    off, plen = batch["offsets"], batch["prompt_lens"]
    for i, parts in expected.items():
        sample = batch["tokens"][off[i]:off[i + 1]]
        assert list(sample[:plen[i]]) == prompts.ids[i]
        assert list(sample[plen[i]:]) == [x for ids, _ in parts for x in ids]
        mask = batch["loss_mask"][off[i]:off[i + 1]]
        assert list(mask) == [0] * plen[i] + [m for ids, m in parts for _ in ids]
        lps = batch["rollout_logprobs"][off[i]:off[i + 1]]
        want = [0.0] * plen[i] + [(-0.01 * (j + 1) if m else 0.0) for ids, m in parts for j in range(len(ids))]
        np.testing.assert_allclose(lps, want, rtol=0, atol=1e-7)
    assert list(batch["finish_reasons"]) == [1, 0, 1]
    assert list(batch["env/turns"]) == [2, 3, 1]
    assert [STATUSES[s] for s in batch["env/status"]] == ["done", "max_turns", "done"]
    np.testing.assert_allclose(batch["env/reward"], [0.5 + 0.9 * 1.0, 0.81 * 1.0, 2.0])
    assert list(batch["env/info"]) == ['{"hits": 3.0}', "{}", "{}"]
    # the environments saw the turns' text, decoded without special tokens
    assert sorted(multiturn_envs.RECORD) == sorted([("t0", "a0"), ("t0", "a1"), ("t1", "a0"), ("t1", "a1"),
                                                     ("t1", "a2"), ("t2", "a0")])
    # one generate call per turn, for the trajectories still running, each turn with its own seed
    assert [len(c[0]) for c in engine.calls] == [3, 2, 1]
    assert [c[1]["seed"] for c in engine.calls] == [7 + t * TURN_SEED_STRIDE for t in range(3)]
    assert all(c[1]["continuation"] for c in engine.calls)
    m = env_metrics(batch, "train")
    assert m["train/env/turns_mean"] == 2.0 and m["train/env/done_frac"] == pytest.approx(2 / 3)
    assert m["train/env/info/hits"] == 1.0 and m["train/env/max_turns_frac"] == pytest.approx(1 / 3)
    assert m["train/env/model_tokens_mean"] == pytest.approx(sum(len(turn(t)) for t in (0, 1, 0, 1, 2, 0)) / 3)
    fields = trajectory_fields(tok, batch, 0)
    assert [s["role"] for s in fields["trajectory"]] == ["model", "observation", "model"]
    assert fields["trajectory"][0]["text"] == "a0<|im_end|>" and fields["env_status"] == "done"


def test_token_limits_end_trajectories(tok):
    script = {k: [["more", 0.0, False, {}]] * 5 for k in ("long", "short", "obs")}
    script["obs"] = [["word " * 40, 0.0, False, {}]] * 5
    texts = {(3, 0): "a" * 30}  # sample 0's first turn is longer than max_turn_tokens
    cfg = make_cfg(environment_kwargs={"script": script}, max_turn_tokens=12, max_turns=5,
                   max_observation_tokens=200)
    cfg.models.policy.max_response_tokens_length = 30
    roll = MultiTurnLoop(cfg, tok)
    engine = FakeEngine(tok, texts)
    batch = roll.run(engine, prompts_for(tok, ["long", "short", "obs"]), SAMPLING, "x")
    status = [STATUSES[s] for s in batch["env/status"]]
    assert status == ["token_limit"] * 3
    resp = np.diff(batch["offsets"]) - batch["prompt_lens"]
    assert resp[0] == 12  # cut by the engine at max_turn_tokens
    assert all(r <= 30 for r in resp)  # never past max_response_tokens_length
    assert batch["env/turns"][1] > 1 and batch["env/observation_tokens"][2] == 0  # the long observation never fit
    assert list(batch["finish_reasons"]) == [0, 0, 0]


def test_observations_are_shortened_to_their_limit(tok):
    script = {"t": [["0123456789 " * 50, 0.0, False, {}], [None, 1.0, True, {}]]}
    cfg = make_cfg(environment_kwargs={"script": script}, max_observation_tokens=40)
    cfg.models.policy.max_response_tokens_length = 200
    batch = MultiTurnLoop(cfg, tok).run(FakeEngine(tok), prompts_for(tok, ["t"]), SAMPLING, "x")
    assert STATUSES[batch["env/status"][0]] == "done"
    assert 0 < batch["env/observation_tokens"][0] <= 40
    obs = trajectory_fields(tok, batch, 0)["trajectory"][1]["text"]
    assert "...(truncated)<|im_end|>" in obs


def test_environment_errors_and_time_outs_end_only_their_trajectory(tok, capsys):
    script = {"ok": [[None, 1.0, True, {}]], "raises": ["raise"], "slow": ["sleep"], "bad": ["bad"],
              "reset": [[None, 1.0, True, {}]]}
    cfg = make_cfg(environment_kwargs={"script": script, "first": {"reset": "raise"}, "sleep_s": 3.0},
                   step_timeout_s=0.5)
    start = time.monotonic()
    batch = MultiTurnLoop(cfg, tok).run(FakeEngine(tok), prompts_for(tok, ["ok", "raises", "slow", "bad", "reset"]),
                                           SAMPLING, "the rollouts of episode 4")
    assert time.monotonic() - start < 2.5  # the slow step is not waited for
    assert list(batch["env/status"]) == [DONE, ERROR, TIMEOUT, ERROR, ERROR]
    errors = list(batch["env/error"])
    assert errors[0] == ""
    assert errors[1].startswith("step 1: ValueError: step 1 of raises failed (at ") and "multiturn_envs.py" in errors[1]
    assert errors[2] == "step 1: no answer within 0.5 s (models.policy.multi_turn.step_timeout_s)"
    assert errors[3].startswith("step 1: step returned the reward 'one'")
    assert errors[4].startswith("reset: RuntimeError: reset failed for reset")
    assert list(batch["env/turns"]) == [1] * 5  # a failed reset still gets its one model turn
    out = capsys.readouterr().out
    assert "warning: the rollouts of episode 4: 4 of 5 trajectories ended by an error or time-out of environment " \
           "'multiturn_envs:ScriptedEnv' (the first, trajectory 1: step 1: ValueError" in out
    m = env_metrics(batch, "eval")
    assert m["eval/env/error_frac"] == pytest.approx(0.6) and m["eval/env/timeout_frac"] == pytest.approx(0.2)


def test_reset_may_give_the_first_observation(tok):
    script = {"t": [[None, 1.0, True, {}]], "long": [[None, 1.0, True, {}]]}
    cfg = make_cfg(environment_kwargs={"script": script, "first": {"t": "Solve x."}})
    batch = MultiTurnLoop(cfg, tok).run(FakeEngine(tok), prompts_for(tok, ["t"]), SAMPLING, "x")
    prompt = batch["tokens"][:batch["prompt_lens"][0]]
    assert list(prompt) == chat_ids(tok, [{"role": "user", "content": "Solve x."}])
    cfg = make_cfg(environment_kwargs={"script": script, "first": {"long": "word " * 100}})
    with pytest.raises(UserError, match="reset returned a first observation of [0-9]+ tokens, more than "
                                        "models.policy.max_prompt_tokens_length \\(32\\)"):
        MultiTurnLoop(cfg, tok).run(FakeEngine(tok), prompts_for(tok, ["long"]), SAMPLING, "x")


def test_a_huge_first_observation_is_refused_before_it_is_tokenized(tok, monkeypatch):
    """A reset returning millions of characters was rendered and tokenized whole on the driver before its
    length was checked: now its characters alone refuse it (a token covers at most 32 of them)."""
    script = {"huge": [[None, 1.0, True, {}]]}
    cfg = make_cfg(environment_kwargs={"script": script, "first": {"huge": "x" * 3_000_000}})
    loop = MultiTurnLoop(cfg, tok)
    tokenized = []
    render = loop.template.prompt_ids
    monkeypatch.setattr(loop.template, "prompt_ids", lambda messages: tokenized.append(messages) or render(messages))
    with pytest.raises(UserError, match="reset returned a first observation of 3000000 characters, more than "
                                        "models.policy.max_prompt_tokens_length \\(32\\) tokens can hold"):
        loop.run(FakeEngine(tok), prompts_for(tok, ["huge"]), SAMPLING, "x")
    assert not [m for m in tokenized if m and "xxxx" in str(m[-1]["content"])]


def test_reward_models_score_the_prompt_the_reset_gave(tok):
    """A reset that returns the first observation replaces the row's prompt: the reward models' conversation
    (Sampling.conversations) starts with it, not with the dataset's prompt; a reset that returns None
    leaves the row's prompt. It survives selecting and joining samples (env/prompt)."""
    from chatlearn.batch import concat_batches, select_samples
    from chatlearn.runtime.driver.sampling import Sampling

    script = {"t": [[None, 1.0, True, {}]], "u": [[None, 1.0, True, {}]]}
    first = {"t": [{"role": "system", "content": "Hi."}, {"role": "user", "content": "x?"}]}
    cfg = make_cfg(environment_kwargs={"script": script, "first": first})
    prompts = prompts_for(tok, ["t", "u"])
    batch = MultiTurnLoop(cfg, tok).run(FakeEngine(tok), prompts, SAMPLING, "x")
    convs = Sampling(cfg, tok, None, None, None).conversations(batch, prompts)
    assert convs[0][:2] == first["t"] and convs[0][2]["role"] == "assistant" and len(convs[0]) == 3
    assert convs[1][:1] == [{"role": "user", "content": "u"}] and len(convs[1]) == 2
    joined = concat_batches([select_samples(batch, [1]), select_samples(batch, [0])])
    swapped = Sampling(cfg, tok, None, None, None).conversations(
        joined, Prompts(ids=prompts.ids[::-1], truths=prompts.truths, sources=prompts.sources, extra=prompts.extra,
                        messages=prompts.messages[::-1]))
    assert swapped == convs[::-1]


def test_a_constructor_that_raises_stops_the_run_naming_it(tok):
    cfg = make_cfg(environment_kwargs={"script": {}, "first": 5})  # dict.get on an int raises in reset, not here
    cfg.models.policy.multi_turn.environment_kwargs = {"script": {}, "nope": 1}
    with pytest.raises(UserError, match="environment 'multiturn_envs:ScriptedEnv' .* could not be built: TypeError"):
        MultiTurnLoop(cfg, tok).run(FakeEngine(tok), prompts_for(tok, ["t"]), SAMPLING, "x")


def test_the_same_rollout_twice_gives_the_same_batch(tok):
    script = {"t0": [["o", 0.5, False, {}], [None, 1.0, True, {}]], "t1": [["p", 0.0, False, {}]] * 3}
    cfg = make_cfg(environment_kwargs={"script": script}, num_workers=2)
    a = MultiTurnLoop(cfg, tok).run(FakeEngine(tok), prompts_for(tok, ["t0", "t1"], k=3), SAMPLING, "x")
    b = MultiTurnLoop(cfg, tok).run(FakeEngine(tok), prompts_for(tok, ["t0", "t1"], k=3), SAMPLING, "x")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


# ------------------------------------------------------------------------------ EnvCalls
def test_env_calls_run_at_most_workers_at_once_and_abandon_late_ones():
    running, peak, lock = [0], [0], threading.Lock()

    def work(seconds):
        def call():
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            time.sleep(seconds)
            with lock:
                running[0] -= 1
            return seconds
        return call

    calls = EnvCalls(workers=3, timeout=1.0)
    start = time.monotonic()
    out = calls.run([work(0.05) for _ in range(9)] + [work(5.0)])
    assert [o.value for o in out[:9]] == [0.05] * 9 and out[9].timed_out
    assert peak[0] <= 3 and time.monotonic() - start < 3.0 and calls.abandoned == 1
    # an abandoned call holds no worker's place: one worker, the first call hangs, the second still runs
    single = EnvCalls(workers=1, timeout=0.3)
    out = single.run([work(5.0), work(0.01)])
    assert out[0].timed_out and out[1].value == 0.01
    errors = single.run([lambda: 1 / 0])
    assert isinstance(errors[0].error, ZeroDivisionError)


# ------------------------------------------------------------------------------ batch operations
def scripted_batch(tok) -> dict:
    script = {"t0": [["o", 0.5, False, {"n": 1}], [None, 1.0, True, {}]], "t1": [[None, 0.0, True, {}]],
              "t2": ["raise"]}
    cfg = make_cfg(environment_kwargs={"script": script})
    return MultiTurnLoop(cfg, tok).run(FakeEngine(tok), prompts_for(tok, ["t0", "t1", "t2"]), SAMPLING, "x")


def test_selecting_and_joining_samples_keeps_the_mask_and_the_environment_columns(tok):
    """Dynamic sampling and replay select and join samples: the loss mask goes with the tokens, the
    env/ columns with their samples."""
    from chatlearn.batch import concat_batches, select_samples

    batch = scripted_batch(tok)
    picked = select_samples(batch, [2, 0])
    off, new = batch["offsets"], picked["offsets"]
    for j, i in enumerate([2, 0]):
        for key in ("tokens", "loss_mask", "rollout_logprobs"):
            np.testing.assert_array_equal(picked[key][new[j]:new[j + 1]], batch[key][off[i]:off[i + 1]])
        for key in ("env/turns", "env/status", "env/info", "env/error", "env/reward"):
            assert picked[key][j] == batch[key][i]
    joined = concat_batches([picked, batch])
    assert len(joined["env/error"]) == 5 and joined["env/error"][0].startswith("step 1: ValueError")
    np.testing.assert_array_equal(joined["loss_mask"], np.concatenate([picked["loss_mask"], batch["loss_mask"]]))
    prompts = prompts_for(tok, ["a", "b", "c"])
    both = Prompts.join([prompts.select([2]), prompts.select([0, 1])])
    assert both.messages == [prompts.messages[2], prompts.messages[0], prompts.messages[1]]


def test_rollouts_generated_ahead_keep_a_multi_turn_batch_in_the_checkpoint(tok, tmp_path):
    """max_staleness: a checkpoint keeps the rollouts ahead as arrays (no pickle), the env/ text columns too."""
    from chatlearn.runtime.driver.overlap import RolloutPipeline, kept_rollouts
    from chatlearn.runtime.driver.sampling import Scored

    batch = scripted_batch(tok)
    rewards = batch["env/reward"].astype(np.float32)

    def produce(episode, prompts):
        return dict(batch), Scored(rewards, {"math/score": rewards}, rewards), {}

    pipe = RolloutPipeline(1, lambda e: Prompts(ids=[[1]] * 3, truths=["1"] * 3, sources=["s"] * 3, extra=[{}] * 3,
                                                indices=[e]), produce, lambda rows: None)
    pipe.fill(1, 3)
    pipe.take(1, trainer_version=0)
    pipe.save(str(tmp_path))
    pipe.close()
    (episode, _, _, kept, _), = kept_rollouts(str(tmp_path), 1)
    assert episode == 2
    for key, value in batch.items():
        np.testing.assert_array_equal(kept[key], value)


def test_async_environments_run_on_the_step_threads(tok):
    cfg = make_cfg(environment="multiturn_envs:AsyncEnv", environment_kwargs={})
    batch = MultiTurnLoop(cfg, tok).run(FakeEngine(tok), prompts_for(tok, ["a", "b"]), SAMPLING, "x")
    assert [STATUSES[s] for s in batch["env/status"]] == ["done", "done"]
    assert list(batch["env/turns"]) == [2, 2]
    np.testing.assert_allclose(batch["env/reward"], [0.5 + 0.9, 0.5 + 0.9])


def test_a_huge_observation_is_cut_by_characters_before_it_is_tokenized(tok, monkeypatch):
    """An observation of millions of characters was rendered and tokenized whole on the driver (past the
    step's time limit, deaf to SIGTERM for a minute) before it was cut: now what is tokenized stays small."""
    script = {"t": [["x" * 3_000_000, 0.0, False, {}], [None, 1.0, True, {}]]}
    cfg = make_cfg(environment_kwargs={"script": script}, max_observation_tokens=40)
    cfg.models.policy.max_response_tokens_length = 200
    loop = MultiTurnLoop(cfg, tok)
    seen = []
    render = loop.template.observation_ids
    monkeypatch.setattr(loop.template, "observation_ids",
                        lambda messages, last: seen.append(sum(len(m["content"]) for m in messages)) or render(messages, last))
    batch = loop.run(FakeEngine(tok), prompts_for(tok, ["t"]), SAMPLING, "x")
    assert STATUSES[batch["env/status"][0]] == "done"
    assert 0 < batch["env/observation_tokens"][0] <= 40
    assert seen and max(seen) <= 40 * 32 + len(" ...(truncated)")
