"""Runs that cannot learn say so (docs/reliability.md, "Runs that cannot learn").

- group size 1 with an estimator whose advantages are then all 0 is refused when the config is loaded;
- an episode whose every response is cut at ``max_response_tokens_length`` is warned about, once;
- an environment or a tool that fails on every call of an episode is warned about loudly, and after
  ``runtime_args.max_failed_env_episodes`` such episodes in a row the run stops naming it and its
  first error (a step time-out counts as a failure); a tool's first error is shown;
- data that repeats within an episode (fewer prompts than an episode draws) is warned about at start.

Unit-level: the config loader, the multi-turn loop against a scripted engine, the episode report.
"""
from __future__ import annotations

import types

import multiturn_envs
import numpy as np
import pytest
from omegaconf import OmegaConf

from chatlearn.config import load as config_load
from chatlearn.config.schema import Config
from chatlearn.errors import ConfigError, UserError
from chatlearn.runtime.driver.sampling import Prompts

TEMPLATE = "template/grpo_fsdp.yaml"
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 64, "seed": 7}


# ---------------------------------------------------------------------------- 1. group size 1
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_size_one_is_refused_where_every_advantage_would_be_zero(paths_overrides, estimator):
    with pytest.raises(ConfigError) as err:
        config_load.load_config(TEMPLATE, paths_overrides + [
            "models.policy.num_inference_per_prompt=1",
            f"models.policy_trainer.advantage_estimator={estimator}"])
    text = str(err.value)
    assert err.value.key == "models.policy.num_inference_per_prompt" and "\n" not in text
    assert f"advantage_estimator: {estimator}" in text and "every advantage" in text
    assert "at least 2" in text and "gae" in text and "reinforce_plus_plus" in text


def test_the_refused_estimators_are_those_whose_advantages_vanish_without_groups():
    from chatlearn.algorithms.advantages import GROUP_ESTIMATORS, compute_advantages
    from chatlearn.config.registry import GROUP_BASELINE_ESTIMATORS

    rewards = np.array([0.0, 1.0, 0.5, 2.0])
    for estimator in GROUP_ESTIMATORS:
        adv = compute_advantages(rewards, 1, estimator, np.full(4, 3), np.ones(4))
        assert (estimator in GROUP_BASELINE_ESTIMATORS) == (not adv.any()), estimator


def test_group_size_one_is_accepted_where_the_advantages_need_no_group(paths_overrides):
    # REINFORCE++ whitens the raw rewards over the batch when there is no group: it learns
    cfg = config_load.load_config(TEMPLATE, paths_overrides + [
        "models.policy.num_inference_per_prompt=1",
        "models.policy_trainer.advantage_estimator=reinforce_plus_plus"])
    assert cfg.models.policy.num_inference_per_prompt == 1


# ---------------------------------------------------------------------------- 2. every response cut
class _Trainer:
    @staticmethod
    def call(method):
        return [{}], None


def _report():
    from chatlearn.runtime.driver.observe import EpisodeReport
    from chatlearn.runtime.driver.sampling import Sampling

    cfg = OmegaConf.structured(Config)
    cfg.models.policy.max_response_tokens_length = 1
    plan = types.SimpleNamespace(old_logprob_pass_from=0, group_size=2)
    return EpisodeReport(cfg, plan, Sampling(cfg, None, None, None, None), None, _Trainer())


def _single_turn_samples(finished: list[bool]):
    from chatlearn.runtime.driver.sampling import EpisodeSamples, Scored

    n = len(finished)
    offsets = np.arange(n + 1, dtype=np.int64) * 3  # 2 prompt tokens and 1 response token each
    batch = {"tokens": np.ones(3 * n, np.int64), "offsets": offsets, "prompt_lens": np.full(n, 2, np.int64),
             "finish_reasons": np.array(finished, np.int8), "old_logprobs": np.zeros(3 * n, np.float32),
             "rollout_logprobs": np.zeros(3 * n, np.float32)}
    rewards = np.zeros(n, np.float32)
    return EpisodeSamples(prompts=None, batch=batch, scored=Scored(rewards, {}, rewards))


def test_an_episode_whose_every_response_is_cut_is_warned_about_once(capsys):
    report = _report()
    m = report.metrics(1, _single_turn_samples([False] * 4), {})
    assert m["train/truncated_frac"] == 1.0
    report.metrics(2, _single_turn_samples([False] * 4), {})
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "max_response_tokens_length" in line]
    assert len(lines) == 1, out
    assert lines[0].startswith("[chatlearn] warning: episode 1: every one of the 4 responses")
    assert "models.policy.max_response_tokens_length (1)" in lines[0]


def test_an_episode_with_a_finished_response_is_not_warned_about(capsys):
    report = _report()
    report.metrics(1, _single_turn_samples([False, False, True, False]), {})
    assert "max_response_tokens_length" not in capsys.readouterr().out


def test_multi_turn_trajectories_warn_when_every_one_ran_out_of_tokens(capsys):
    from chatlearn.runtime.driver.multiturn import MAX_TURNS, TOKEN_LIMIT

    report = _report()
    unfinished = np.zeros(4, np.int8)  # finish_reasons: 1 for done only
    report.warn_all_truncated(1, {"env/status": np.full(4, MAX_TURNS, np.int8), "finish_reasons": unfinished})
    assert capsys.readouterr().out == ""  # ended by max_turns: not cut
    report.warn_all_truncated(2, {"env/status": np.full(4, TOKEN_LIMIT, np.int8), "finish_reasons": unfinished})
    assert "episode 2: every one of the 4 trajectories ran out of tokens" in capsys.readouterr().out


# ---------------------------------------------------------------------------- 3. environments and tools
@pytest.fixture(scope="module")
def tok():
    from tiny_model import make_tokenizer

    return make_tokenizer()


class Engine:
    """Every model turn of every trajectory is ``text`` and the end-of-turn token."""

    def __init__(self, tok, text: str = "a"):
        self.ids = tok.encode(text, add_special_tokens=False) + tok.encode("<|im_end|>", add_special_tokens=False)

    def __call__(self, prompts, sampling):
        from chatlearn.models.rollout.common import pack_samples

        outs = [self.ids[:sampling["max_tokens"]] for _ in prompts]
        return pack_samples([list(p) for p in prompts], outs, [[-0.1] * len(o) for o in outs],
                            [len(o) == len(self.ids) for o in outs])


def loop(tok, max_failed: int = 3, **multi_turn):
    from chatlearn.runtime.driver.multiturn import MultiTurnLoop

    cfg = OmegaConf.structured(Config)
    p = cfg.models.policy
    p.max_prompt_tokens_length, p.max_response_tokens_length = 256, 512
    cfg.runtime_args.max_failed_env_episodes = max_failed
    for k, v in {"environment": "multiturn_envs:ScriptedEnv", "max_turns": 2, "num_workers": 4,
                 "step_timeout_s": 5.0, **multi_turn}.items():
        p.multi_turn[k] = v
    return MultiTurnLoop(cfg, tok)


def prompts(tok, keys: list[str]) -> Prompts:
    messages = [[{"role": "user", "content": k}] for k in keys]
    ids = [tok.encode(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
           for m in messages]
    return Prompts(ids=ids, truths=["1"] * len(ids), sources=["s"] * len(ids), extra=[{}] * len(ids),
                   messages=messages)


def episodes(roll, engine, keys, numbers) -> None:
    for episode in numbers:
        roll.run(engine, keys, SAMPLING, f"the rollouts of episode {episode}", episode=episode)


RAISES = {"script": {k: ["raise", "raise"] for k in ("p0", "p1", "p2", "ok")}}


def test_an_environment_failing_every_call_is_warned_about_and_stops_the_run(tok, capsys):
    roll = loop(tok, environment_kwargs=RAISES)
    keys = prompts(tok, ["p0", "p1", "p2"])
    episodes(roll, Engine(tok), keys, [1, 2])
    out = capsys.readouterr().out
    for episode in (1, 2):
        assert (f"warning: the rollouts of episode {episode}: environment 'multiturn_envs:ScriptedEnv' failed on "
                "every call: 3 of 3 trajectories ended by an error or time-out (the first, trajectory 0: step 1: "
                "ValueError: step 1 of p0 failed") in out
        assert f"runtime_args.max_failed_env_episodes: 3; {episode} so far" in out
    with pytest.raises(UserError) as err:
        episodes(roll, Engine(tok), keys, [3])
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("environment 'multiturn_envs:ScriptedEnv' (models.policy.multi_turn.environment) failed "
                           "on every call of 3 episodes in a row (episodes 1-3)")
    assert "step 1: ValueError: step 1 of p0 failed" in text and "runtime_args.max_failed_env_episodes" in text


def test_a_successful_episode_or_zero_resets_the_count(tok, capsys):
    script = {"p0": ["raise"] * 2, "ok": [[None, 1.0, True, {}]] * 2}
    roll = loop(tok, environment_kwargs={"script": script})
    bad, good = prompts(tok, ["p0", "p0"]), prompts(tok, ["p0", "ok"])
    for episode, keys in enumerate([bad, bad, good, bad, bad], start=1):  # never 3 in a row
        episodes(roll, Engine(tok), keys, [episode])
    never = loop(tok, max_failed=0, environment_kwargs={"script": script})
    episodes(never, Engine(tok), bad, range(1, 6))
    out = capsys.readouterr().out
    assert out.count("failed on every call") == 4 + 5
    assert "the run goes on (runtime_args.max_failed_env_episodes: 0)" in out


def test_evaluation_rollouts_do_not_count(tok, capsys):
    roll = loop(tok, max_failed=1, environment_kwargs=RAISES)
    for _ in range(2):  # no episode: warned, not counted
        roll.run(Engine(tok), prompts(tok, ["p0"]), SAMPLING, "the evaluation set")
    out = capsys.readouterr().out
    assert out.count("the evaluation set: environment 'multiturn_envs:ScriptedEnv' failed on every call") == 2
    assert "so far" not in out
    with pytest.raises(UserError):  # a training episode is
        episodes(roll, Engine(tok), prompts(tok, ["p0"]), [1])


def test_a_step_time_out_on_every_call_counts_as_a_failure(tok):
    script = {"p0": ["sleep"] * 2}
    roll = loop(tok, max_failed=2, step_timeout_s=0.05, environment_kwargs={"script": script, "sleep_s": 0.3})
    with pytest.raises(UserError) as err:
        episodes(roll, Engine(tok), prompts(tok, ["p0", "p0"]), [1, 2])
    assert "failed on every call of 2 episodes in a row" in str(err.value)
    assert "no answer within 0.05 s (models.policy.multi_turn.step_timeout_s)" in str(err.value)


TOOL_CALL = '<tool_call>{"name": "lookup", "arguments": {"query": "x"}}</tool_call>'


def tool_loop(tok, path: str, max_failed: int = 2):
    from chatlearn.config.schema import ToolEntry

    return loop(tok, max_failed=max_failed, environment="builtin:tools", tools=[ToolEntry(name="lookup", path=path)])


def test_a_tool_failing_every_call_is_shown_warned_about_and_stops_the_run(tok, capsys):
    roll = tool_loop(tok, "multiturn_envs:unreachable_lookup")
    keys = prompts(tok, ["p0", "p1"])
    episodes(roll, Engine(tok, TOOL_CALL), keys, [1])
    out = capsys.readouterr().out
    assert ("warning: the rollouts of episode 1: tool 'lookup' failed on every call: it raised on 4 of 4 calls (the "
            "first: ConnectionError: lookup service unreachable (at ") in out and "unreachable_lookup)" in out
    assert "runtime_args.max_failed_env_episodes: 2; 1 so far" in out
    with pytest.raises(UserError) as err:
        episodes(roll, Engine(tok, TOOL_CALL), keys, [2])
    text = str(err.value)
    assert text.startswith("tool 'lookup' (models.policy.multi_turn.tools) failed on every call of 2 episodes in a "
                           "row (episodes 1-2)") and "ConnectionError: lookup service unreachable" in text


def test_a_tool_that_sometimes_raises_is_shown_once_and_never_stops_the_run(tok, capsys):
    roll = tool_loop(tok, "multiturn_envs:flaky_lookup", max_failed=1)
    episodes(roll, Engine(tok, TOOL_CALL), prompts(tok, ["p0", "p1"]), [1, 2, 3])
    out = capsys.readouterr().out
    assert out.count("tool 'lookup' raised on") == 1  # its first error, once
    assert "failed on every call" not in out


# ---------------------------------------------------------------------------- 4. data that repeats
def test_data_repeating_within_an_episode_is_warned_about_at_start(capsys):
    from chatlearn.runtime.driver.run import warn_repeated_prompts

    plan = types.SimpleNamespace(prompts_per_episode=32, group_size=8)
    warn_repeated_prompts(5, plan)
    out = capsys.readouterr().out
    assert out.startswith("[chatlearn] warning: the train data has 5 prompts, fewer than the 32 prompts an episode "
                          "draws") and "about 6.4 times" in out and out.count("\n") == 1
    warn_repeated_prompts(32, plan)
    assert capsys.readouterr().out == ""
