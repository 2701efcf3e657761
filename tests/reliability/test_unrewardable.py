"""Data and rewards that cannot teach anything say so (docs/reliability.md, "Runs that cannot learn"), and a
reward too large for float32 stops the run (docs/reliability.md, "Numbers that stop being numbers").

- rows whose ground truth is null or empty are counted when the data is read: every row so is refused,
  some are warned about with the count;
- a reward function that scores every sample of ``runtime_args.max_constant_reward_episodes`` training
  episodes in a row alike is warned about, once;
- dynamic sampling that finds no group of unequal rewards in all its rounds is warned about, naming
  ``runtime_args.dynamic_sampling_max_rounds``;
- a finite float64 reward past float32's largest number (it would train as inf) stops the run naming the
  reward function (or reward model) and the sample.

Unit-level: the data loader, the episode report, dynamic sampling and the driver's scoring against
in-process reward workers; the CLI's rows are in test_reliability_cases.py. One real run (``slow``)
meets a reward past float32.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
from omegaconf import OmegaConf

from chatlearn.config.schema import Config
from chatlearn.data.dataset import load_prompts
from chatlearn.errors import UserError
from chatlearn.models.reward.functions import RewardManager, resolve_entries
from chatlearn.models.specs import RewardSpec
from chatlearn.runtime.driver.sampling import EpisodeSamples, Prompts, Sampling, Scored
from conftest import REPO

KEYS = {"prompt_key": "prompt", "ground_truth_key": "reward_model.ground_truth"}


# ---------------------------------------------------------------------------- 1. data without answers
@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _data(tmp_path, truths: list) -> str:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "reward_model": {"ground_truth": t}}) + "\n"
                            for i, t in enumerate(truths)))
    return str(path)


@pytest.mark.parametrize("empty", [None, "", "  ", [], {}])
def test_data_whose_every_ground_truth_is_empty_is_refused(tmp_path, tokenizer, empty):
    path = _data(tmp_path, [empty] * 3)
    with pytest.raises(UserError) as err:
        load_prompts([path], tokenizer, max_prompt_tokens=64, enable_thinking=False, **KEYS)
    text = " ".join(str(err.value).split())
    for word in ("runtime_args.data_path: every one of the 3 prompts has an empty ground truth",
                 "runtime_args.ground_truth_key 'reward_model.ground_truth'", f"the first: {path}:1",
                 "train on nothing", "set runtime_args.ground_truth_key to the field that holds them, or to null"):
        assert word in text, text


def test_data_with_some_empty_ground_truths_is_warned_about_with_the_count(tmp_path, tokenizer):
    path = _data(tmp_path, ["1", None, "3", "", 0])
    ps = load_prompts([path], tokenizer, max_prompt_tokens=64, enable_thinking=False,
                      what="runtime_args.eval_data_path", **KEYS)
    assert len(ps) == 5 and ps.ground_truths == ["1", None, "3", "", 0]  # kept: the warning says what they get
    text = ps.empty_truth_warning
    assert text.startswith("runtime_args.eval_data_path: 2 of the 5 prompts have an empty ground truth"), text
    assert f"the first: {path}:2" in text and "Fill in the answers, or remove those rows" in text
    good = load_prompts([_data(tmp_path, ["1", 0, False])], tokenizer, max_prompt_tokens=64, enable_thinking=False,
                        **KEYS)
    assert good.empty_truth_warning is None  # 0 and false are answers


def test_data_without_a_ground_truth_key_is_not_checked(tmp_path, tokenizer):
    ps = load_prompts([_data(tmp_path, [None, None])], tokenizer, max_prompt_tokens=64, enable_thinking=False,
                      prompt_key="prompt", ground_truth_key=None)
    assert len(ps) == 2 and ps.empty_truth_warning is None


# ---------------------------------------------------------------------------- 2. a reward without signal
class _Trainer:
    @staticmethod
    def call(method):
        return [{}], None


def _report(limit: int = 3):
    from chatlearn.runtime.driver.observe import EpisodeReport

    cfg = OmegaConf.structured(Config)
    cfg.runtime_args.max_constant_reward_episodes = limit
    plan = types.SimpleNamespace(old_logprob_pass_from=0, group_size=2)
    return EpisodeReport(cfg, plan, Sampling(cfg, None, None, None, None), None, _Trainer())


def _samples(scores: dict[str, list]):
    n = len(next(iter(scores.values())))
    offsets = np.arange(n + 1, dtype=np.int64) * 3
    batch = {"tokens": np.ones(3 * n, np.int64), "offsets": offsets, "prompt_lens": np.full(n, 2, np.int64),
             "finish_reasons": np.ones(n, np.int8), "old_logprobs": np.zeros(3 * n, np.float32),
             "rollout_logprobs": np.zeros(3 * n, np.float32)}
    parts = {f"{name}/score": np.asarray(v, np.float64) for name, v in scores.items()}
    rewards = np.sum(list(parts.values()), axis=0).astype(np.float32)
    return EpisodeSamples(prompts=None, batch=batch, scored=Scored(rewards, parts, rewards))


def test_a_reward_function_that_scores_every_sample_alike_is_warned_about_once(capsys):
    report = _report()
    for episode in range(1, 7):
        report.metrics(episode, _samples({"math": [0.0] * 4, "fmt": [0.0, 1.0, 1.0, 1.0]}), {})
        if episode == 2:
            assert "without signal" not in capsys.readouterr().out  # 2 episodes: not yet
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "without signal" in line]
    assert len(lines) == 1, out
    line = lines[0]
    assert line.startswith("[chatlearn] warning: episode 3: reward function 'math' (models.reward.functions) gave "
                           "every sample the same score, 0, in 3 training episodes in a row (episodes 1-3"), line
    assert "runtime_args.max_constant_reward_episodes: 3" in line and "'fmt'" not in out


def test_equal_groups_or_a_varied_episode_do_not_count(capsys):
    report = _report(limit=2)
    # every group equal, the episode not: GRPO's usual all-right and all-wrong groups
    for episode in (1, 2, 3):
        report.metrics(episode, _samples({"math": [1.0, 1.0, 0.0, 0.0]}), {})
    # constant, varied, constant: the count starts again
    for episode, scores in ((4, [1.0] * 4), (5, [1.0, 0.0, 0.0, 0.0]), (6, [1.0] * 4)):
        report.metrics(episode, _samples({"math": scores}), {})
    assert "without signal" not in capsys.readouterr().out
    report.metrics(7, _samples({"math": [1.0] * 4}), {})
    assert "episode 7: reward function 'math'" in capsys.readouterr().out
    off = _report(limit=0)
    for episode in range(1, 5):
        off.metrics(episode, _samples({"math": [0.0] * 4}), {})
    assert "without signal" not in capsys.readouterr().out


def test_a_negative_limit_is_refused(paths_overrides):
    from chatlearn.config import load as config_load
    from chatlearn.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        config_load.load_config("template/grpo_fsdp.yaml", paths_overrides + [
            "runtime_args.max_constant_reward_episodes=-1"])
    assert err.value.key == "runtime_args.max_constant_reward_episodes" and "0 (never warn)" in str(err.value)


# ---------------------------------------------------------------------------- 3. dynamic sampling that keeps nothing
class _Run:
    @staticmethod
    def stage(*args):
        return contextlib.nullcontext()


class _Sampling:
    """Scores every sample of a call with ``rewards`` (per call, cycled)."""

    def __init__(self, rewards: list[list[float]]):
        self.rewards, self.calls = rewards, 0

    def scored(self, batch, prompts, what):
        r = np.asarray(self.rewards[self.calls % len(self.rewards)], np.float32)
        self.calls += 1
        return Scored(r, {}, r.astype(np.float64))

    @staticmethod
    def params(eval_mode, seed):
        return {"seed": seed}

    @staticmethod
    def sample(prompts, params, what, episode=None):
        return _batch(len(prompts.ids))


def _batch(n: int) -> dict:
    return {"tokens": np.ones(3 * n, np.int64), "offsets": np.arange(n + 1, dtype=np.int64) * 3,
            "prompt_lens": np.full(n, 2, np.int64), "finish_reasons": np.ones(n, np.int8),
            "loss_mask": np.ones(3 * n, np.int8)}


def _prompts(n: int) -> Prompts:
    return Prompts(ids=[[1, 2]] * n, truths=["1"] * n, sources=["s"] * n, extra=[{}] * n)


def _dynamic(rewards: list[list[float]], rounds: int = 3):
    from chatlearn.runtime.driver.dynamic import dynamic_sampling

    cfg = OmegaConf.structured(Config)
    cfg.runtime_args.dynamic_sampling_max_rounds = rounds
    plan = types.SimpleNamespace(group_size=2, prompts_per_episode=2)
    first = EpisodeSamples(_prompts(4), _batch(4))
    return dynamic_sampling(_Run(), 5, first, _Sampling(rewards), lambda: _prompts(4), cfg, plan)


def test_dynamic_sampling_that_finds_no_varied_group_is_warned_about(capsys):
    samples = _dynamic([[1.0, 1.0, 0.0, 0.0]])  # every group's rewards equal, round after round
    assert samples.metrics["train/dynamic_sampling_kept_frac"] == 0.0
    out = " ".join(capsys.readouterr().out.split())
    assert ("warning: episode 5: dynamic sampling found no group of unequal rewards in 3 rounds "
            "(runtime_args.dynamic_sampling_max_rounds; 6 prompts x 2 responses)") in out, out
    assert "advantages are all 0" in out


def test_dynamic_sampling_that_keeps_a_group_is_not_warned_about(capsys):
    samples = _dynamic([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert samples.metrics["train/dynamic_sampling_kept_frac"] > 0
    assert "dynamic sampling found no group" not in capsys.readouterr().out


# ---------------------------------------------------------------------------- 4. a reward past float32
REWARDS = '''
def huge(*, prompts, responses, ground_truths, data_sources, extra):
    return [float(t) for t in ground_truths]


def big(*, prompts, responses, ground_truths, data_sources, extra):
    return [3e38] * len(responses)


def small(*, prompts, responses, ground_truths, data_sources, extra):
    return [1.0] * len(responses)
'''


class _Tokenizer:
    @staticmethod
    def batch_decode(seqs, skip_special_tokens=True):
        return ["text"] * len(seqs)


class _RewardGroup:
    """Reward workers in this process, each scoring its share (as the driver's reward group does)."""

    def __init__(self, spec: RewardSpec, workers: int):
        self.workers = [RewardManager(spec) for _ in range(workers)]

    def __len__(self) -> int:
        return len(self.workers)

    def call_each(self, method, args, timeout=None):
        return [getattr(w, method)(*a) for w, a in zip(self.workers, args)], None


def _score(tmp_path, functions: list[dict], workers: int = 2):
    (tmp_path / "rewards.py").write_text(REWARDS)
    entries = resolve_entries({"functions": [{"weight": 1.0, "kwargs": {}, **f} for f in functions],
                               "correct_score": 1.0, "incorrect_score": 0.0})
    spec = RewardSpec(functions=tuple(entries), base_dir=str(tmp_path), timeout_s=0.0)
    sampling = Sampling(OmegaConf.structured(Config), _Tokenizer(), None, _RewardGroup(spec, workers), spec)
    truths = ["1.0", "1e39", "2.0", "1e40"]  # what huge returns
    return sampling.score(_batch(4), truths, ["s"] * 4, [{}] * 4, what="the rollouts of episode 2")


def test_a_reward_past_float32_names_the_function_and_the_sample(tmp_path):
    with pytest.raises(UserError) as err:
        _score(tmp_path, [{"name": "ok", "path": "rewards.py:small"}, {"name": "huge", "path": "rewards.py:huge"}])
    text = " ".join(str(err.value).split())
    for word in ("reward function 'huge' (models.reward.functions[1], 'rewards.py:huge') gave sample 1 of the "
                 "rollouts of episode 2 the reward 1e+39 (its score x weight 1) (2 of the 4 samples overflow)",
                 "float32's largest number (3.403e+38)", "inf", "the run stops before anything is trained on it",
                 "lower models.reward.functions[1].weight"):
        assert word in text, text
    assert "\n" not in str(err.value)


def test_a_weighted_sum_past_float32_names_the_functions(tmp_path):
    with pytest.raises(UserError) as err:  # each 3e38 fits; their sum does not
        _score(tmp_path, [{"name": "a", "path": "rewards.py:big"}, {"name": "b", "path": "rewards.py:big"}])
    text = " ".join(str(err.value).split())
    assert "the reward of sample 0 of the rollouts of episode 2 is 6e+38 (4 of the 4 samples overflow)" in text, text
    assert "('a' 3e+38, 'b' 3e+38)" in text
    with pytest.raises(UserError) as err:  # a weight that takes a fitting score past it
        _score(tmp_path, [{"name": "w", "path": "rewards.py:big", "weight": 2.0}])
    assert "reward function 'w' (models.reward.functions[0]" in str(err.value)
    assert "(its score x weight 2)" in str(err.value)


def test_rewards_that_fit_are_float32(tmp_path):
    rewards, parts = _score(tmp_path, [{"name": "a", "path": "rewards.py:big"}])
    assert rewards.dtype == np.float32 and np.isfinite(rewards).all() and parts["a/score"][0] == 3e38


def test_a_reward_model_that_takes_a_reward_past_float32_is_named():
    from chatlearn.runtime.driver.reward_models import RewardModels

    models = RewardModels.__new__(RewardModels)
    models.settings = {"judge": types.SimpleNamespace(weight=1e36, normalize="none",
                                                      weight_key="models.judge.weight")}
    rewards = np.ones(3, np.float32)
    with pytest.raises(UserError) as err:
        models.add(Scored(rewards, {}, rewards), {"judge": np.array([1.0, 500.0, 2.0], np.float32)})
    text = " ".join(str(err.value).split())
    assert "reward model 'judge' adds 5e+38 (models.judge.weight 1e+36 x its score) to the reward of sample 1" in text
    assert "Lower models.judge.weight" in text
    fine, _ = models.add(Scored(rewards, {}, rewards), {"judge": np.array([1.0, 2.0, 3.0], np.float32)})
    assert fine.rewards.dtype == np.float32 and np.isfinite(fine.rewards).all()


@pytest.mark.slow
def test_a_run_whose_reward_overflows_float32_stops_before_training(tmp_path):
    """A real run (single process, hf rollout): before, its console printed ``reward inf``, its metrics
    ``null``, and it ended with exit 0."""
    (tmp_path / "rewards.py").write_text(REWARDS.replace("return [float(t) for t in ground_truths]",
                                                         "return [1e39] + [1.0] * (len(responses) - 1)"))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", "runtime_args.num_episode=2",
         "runtime_args.sample_per_episode=16", "runtime_args.train_global_batch_size=16",
         "runtime_args.train_micro_batch_size=16", "models.policy.num_inference_per_prompt=4",
         "runtime_args.enable_eval_before_training=False", "runtime_args.eval_episode_interval=0",
         "runtime_args.rollout_backend=hf", f"runtime_args.output_dir={out}",
         f"models.reward.functions=[{{name: huge, path: '{tmp_path / 'rewards.py'}:huge'}}]"],
        cwd=REPO, capture_output=True, text=True, timeout=400, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert ("reward function 'huge' (models.reward.functions[0]" in text and "gave sample 0 of the rollouts of "
            "episode 1 the reward 1e+39" in text and "float32's largest number" in text), text
    assert "Traceback" not in proc.stderr and "reward inf" not in proc.stdout
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()
