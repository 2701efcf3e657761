"""algorithm: gkd's on-policy fraction (gkd_lambda, TRL's lmbda): each episode trains on the student's samples with
probability lambda, drawn from (seed, episode) alone, else on the prompt rows' reference responses (their last,
assistant message) tokenized with the chat template: lambda 0 gives the dataset's answers as the batch's responses,
lambda 1 samples as before, in between the draw follows the seed; the policy's metrics say which."""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import OmegaConf

from chatlearn.algorithms.gkd_lambda import on_policy
from chatlearn.config.teacher_keys import check_gkd_lambda
from chatlearn.data.dataset import load_prompts, load_tokenizer
from chatlearn.errors import ConfigError, UserError
from chatlearn.runtime.driver.algorithm import GKDAlgorithm, Trained
from chatlearn.runtime.driver.engine import Engine
from chatlearn.runtime.driver.sampling import Prompts, Sampling, reference_batch
from conftest import REPO

ASSETS = os.path.join(REPO, "assets")
DATA = os.path.join(ASSETS, "arith_sft", "eval.jsonl")
MAX_RESPONSE = 16


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(os.path.join(ASSETS, "tiny_qwen2"), trust_remote_code=False, key="models.policy.load")


@pytest.fixture(scope="module")
def prompt_set(tokenizer):
    return load_prompts([DATA], tokenizer, max_prompt_tokens=64, enable_thinking=False, prompt_key="messages",
                        ground_truth_key="reward_model.ground_truth", responses=True)


def test_the_draw_is_a_function_of_seed_and_episode():
    episodes = range(1, 401)
    assert all(on_policy(1234, e, 1.0) for e in episodes)
    assert not any(on_policy(1234, e, 0.0) for e in episodes)
    half = [on_policy(1234, e, 0.5) for e in episodes]
    assert half == [on_policy(1234, e, 0.5) for e in episodes]  # no state: a resumed run draws the same
    assert 0.4 < np.mean(half) < 0.6
    assert half != [on_policy(1235, e, 0.5) for e in episodes]  # another seed, other episodes
    # a larger lambda keeps every on-policy episode of a smaller one (the same uniform draw)
    assert all(on_policy(1234, e, 0.8) for e in episodes if on_policy(1234, e, 0.3))


def test_reference_responses_are_the_chat_template_tokens_of_the_answers(tokenizer, prompt_set):
    plain = load_prompts([os.path.join(ASSETS, "arith", "eval.jsonl")], tokenizer, max_prompt_tokens=64,
                         enable_thinking=False, prompt_key="prompt", ground_truth_key="reward_model.ground_truth")
    assert prompt_set.prompt_ids == plain.prompt_ids  # the reply taken off: the same prompts as assets/arith
    assert prompt_set.ground_truths == plain.ground_truths
    for i in range(5):
        ids, reply = prompt_set.responses[i], prompt_set.messages[i]
        assert tokenizer.decode(ids) == "\\boxed{%s}<|im_end|>" % prompt_set.ground_truths[i]
        assert ids[-1] == tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]  # ends at the EOS, as sampled
        whole = tokenizer.apply_chat_template([*reply, {"role": "assistant", "content": tokenizer.decode(ids[:-1])}],
                                              tokenize=False)
        assert tokenizer.encode(whole, add_special_tokens=False)[:len(prompt_set.prompt_ids[i]) + len(ids)] == \
            prompt_set.prompt_ids[i] + ids


def test_a_row_without_a_reply_is_refused_naming_it(tokenizer, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": [{"role": "user", "content": "1 + 2?"}, {"role": "assistant", "content": "3"}]}\n'
                    '{"prompt": "2 + 2?"}\n')
    with pytest.raises(UserError, match=r"rows.jsonl:2: the row has no reference response"):
        load_prompts([str(path)], tokenizer, max_prompt_tokens=64, enable_thinking=False, prompt_key="prompt",
                     ground_truth_key=None, responses=True)


def test_the_evaluation_set_of_such_rows_drops_the_replies(tokenizer, prompt_set):
    evald = load_prompts([DATA], tokenizer, max_prompt_tokens=64, enable_thinking=False, prompt_key="messages",
                         ground_truth_key="reward_model.ground_truth", drop_replies=True)
    assert evald.prompt_ids == prompt_set.prompt_ids and not evald.responses
    kept = load_prompts([DATA], tokenizer, max_prompt_tokens=64, enable_thinking=False, prompt_key="messages",
                        ground_truth_key="reward_model.ground_truth")
    assert kept.prompt_ids[0] != prompt_set.prompt_ids[0]  # without it the answer would stay in the prompt


def test_reference_batch_cuts_to_the_response_limit():
    b = reference_batch([[1, 2], [3]], [[7, 8, 9], [5]], 2)
    assert b["tokens"].tolist() == [1, 2, 7, 8, 3, 5]
    assert b["offsets"].tolist() == [0, 4, 6] and b["prompt_lens"].tolist() == [2, 1]
    assert b["finish_reasons"].tolist() == [0, 1]


class _Sampling(Sampling):
    """The real references(); sample() records the call instead of running a rollout engine."""

    def sample(self, prompts, sampling, what, episode=None):
        return {"sampled": episode}


def _engine(tokenizer, lam: float, seed: int = 1234):
    cfg = OmegaConf.create({"runtime_args": {"seed": seed, "data_rerank": False},
                            "models": {"policy": {"seed": seed, "max_response_tokens_length": MAX_RESPONSE},
                                       "policy_trainer": {"gkd_lambda": lam}}})
    policy = SimpleNamespace(model="policy_trainer", replay_columns=(),
                             train=lambda batch, episode: Trained({"train/loss": 1.0}))
    alg = GKDAlgorithm(cfg, SimpleNamespace(passes=lambda: []), policy, SimpleNamespace(columns=()))
    sched = SimpleNamespace(ensure=lambda *a, **k: None)
    sampling = _Sampling(cfg, tokenizer, None, None, None)
    sampling.params = lambda eval_mode, seed: {"seed": seed}
    return SimpleNamespace(cfg=cfg, algorithm=alg, sampling=sampling, sched=sched)


def _episode(engine, prompts, episode):
    return Engine.sample_episode(engine, episode, prompts)


def test_lambda_0_trains_every_episode_on_the_dataset_answers(tokenizer, prompt_set):
    engine = _engine(tokenizer, 0.0)
    prompts = Prompts.of(prompt_set, [3, 0, 7], 2)
    for episode in (1, 2, 3):
        batch = _episode(engine, prompts, episode)
        assert "sampled" not in batch
        off, plen = batch["offsets"], batch["prompt_lens"]
        for i, row in enumerate([3, 3, 0, 0, 7, 7]):
            seq = batch["tokens"][off[i]:off[i + 1]].tolist()
            assert seq[:plen[i]] == prompt_set.prompt_ids[row]
            answer = "\\boxed{%s}<|im_end|>" % prompt_set.ground_truths[row]
            assert seq[plen[i]:] == tokenizer.encode(answer, add_special_tokens=False)
        assert batch["finish_reasons"].tolist() == [1] * 6
        assert engine.algorithm.train("policy_trainer", batch, episode).metrics["train/gkd_offpolicy_frac"] == 1.0


def test_lambda_1_samples_as_before(tokenizer, prompt_set):
    engine = _engine(tokenizer, 1.0)
    prompts = Prompts.of(prompt_set, [0, 1], 2)
    for episode in (1, 2, 3):
        assert _episode(engine, prompts, episode) == {"sampled": episode}
        assert engine.algorithm.train("policy_trainer", {}, episode).metrics["train/gkd_offpolicy_frac"] == 0.0


def test_lambda_between_follows_the_seeded_draw(tokenizer, prompt_set):
    prompts = Prompts.of(prompt_set, [0, 1], 1)
    kinds = {}
    for seed in (1234, 99):
        engine = _engine(tokenizer, 0.5, seed)
        kinds[seed] = ["sampled" in _episode(engine, prompts, e) for e in range(1, 21)]
        assert kinds[seed] == [on_policy(seed, e, 0.5) for e in range(1, 21)]
        assert 0 < sum(kinds[seed]) < 20  # both kinds of episode
    assert kinds[1234] != kinds[99]


def _cfg(lam, environment=None, dynamic=False):
    return OmegaConf.create({"runtime_args": {"dynamic_sampling": dynamic},
                             "models": {"policy": {"multi_turn": {"environment": environment}},
                                        "policy_trainer": {"gkd_lambda": lam}}})


def test_lambda_refusals():
    check_gkd_lambda(_cfg(1.0, environment="env.py:Env", dynamic=True))  # lambda 1: nothing to refuse
    check_gkd_lambda(_cfg(0.5))
    with pytest.raises(ConfigError, match=r"is -0.1: the share of episodes"):
        check_gkd_lambda(_cfg(-0.1))
    with pytest.raises(ConfigError, match=r"multi-turn"):
        check_gkd_lambda(_cfg(0.5, environment="env.py:Env"))
    with pytest.raises(ConfigError, match=r"dynamic_sampling"):
        check_gkd_lambda(_cfg(0.5, dynamic=True))
