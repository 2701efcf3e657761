"""Every reward source's ``normalize``: ``none`` adds ``weight x score``, ``batch`` adds ``weight x`` the score
whitened over the batch, ``(s - mean) / (std + 1e-6)`` (population std; zeros for one sample), before the weighted
sum. Reward functions here (reward models and judges: tests/models/reward/test_judge.py), checked against plain
numpy, over the whole batch although the reward workers each score a share of it; evaluations never whiten."""
from __future__ import annotations

import numpy as np
import pytest
from omegaconf import OmegaConf

from chatlearn.config.reward_entries import check_functions, resolve_entries
from chatlearn.config.schema import Config
from chatlearn.errors import ConfigError
from chatlearn.models.reward.functions import RewardManager
from chatlearn.models.specs import RewardSpec
from chatlearn.runtime.driver.sampling import Sampling, whiten

REWARDS = '''
def value(*, prompts, responses, ground_truths, data_sources, extra):
    return [float(t) for t in ground_truths]


def square(*, prompts, responses, ground_truths, data_sources, extra):
    return [float(t) ** 2 for t in ground_truths]
'''
TRUTHS = ["1", "4", "0", "2", "7"]


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


def _batch(n: int) -> dict:
    return {"tokens": np.ones(3 * n, np.int64), "offsets": np.arange(n + 1, dtype=np.int64) * 3,
            "prompt_lens": np.full(n, 2, np.int64), "finish_reasons": np.ones(n, np.int8)}


def _score(tmp_path, functions: list[dict], truths=TRUTHS, normalize=True):
    (tmp_path / "rewards.py").write_text(REWARDS)
    entries = resolve_entries({"functions": [{"weight": 1.0, "kwargs": {}, "normalize": "none", **f}
                                             for f in functions], "correct_score": 1.0, "incorrect_score": 0.0})
    spec = RewardSpec(functions=tuple(entries), base_dir=str(tmp_path), timeout_s=0.0)
    sampling = Sampling(OmegaConf.structured(Config), _Tokenizer(), None, _RewardGroup(spec, 2), spec)
    n = len(truths)
    return sampling.score(_batch(n), list(truths), ["s"] * n, [{}] * n, normalize=normalize)


def test_whiten_is_the_formula():
    x = np.array([1.0, 4.0, 0.0, 2.0, 7.0])
    mean, std = x.sum() / 5, np.sqrt(((x - x.sum() / 5) ** 2).sum() / 5)
    np.testing.assert_allclose(whiten(x), (x - mean) / (std + 1e-6), rtol=1e-12)
    assert abs(whiten(x).mean()) < 1e-12 and whiten(x).std() == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_array_equal(whiten(np.array([3.0])), [0.0])
    np.testing.assert_allclose(whiten(np.full(4, 2.0)), np.zeros(4))  # no spread: nothing added


def test_reward_functions_are_whitened_over_the_whole_batch_before_the_weighted_sum(tmp_path):
    rewards, parts = _score(tmp_path, [{"name": "v", "path": "rewards.py:value", "weight": 0.5},
                                       {"name": "sq", "path": "rewards.py:square", "weight": 2.0,
                                        "normalize": "batch"}])
    v = np.array([1.0, 4.0, 0.0, 2.0, 7.0])
    sq = v ** 2
    want = 0.5 * v + 2.0 * (sq - sq.mean()) / (sq.std() + 1e-6)
    np.testing.assert_allclose(rewards, want.astype(np.float32), rtol=1e-6)
    np.testing.assert_array_equal(parts["sq/score"], sq)  # the metrics keep the raw score
    # an evaluation (normalize=False) adds the raw weighted scores
    rewards, _ = _score(tmp_path, [{"name": "v", "path": "rewards.py:value", "weight": 0.5},
                                   {"name": "sq", "path": "rewards.py:square", "weight": 2.0, "normalize": "batch"}],
                        normalize=False)
    np.testing.assert_allclose(rewards, (0.5 * v + 2.0 * sq).astype(np.float32))


def test_none_keeps_the_sum_as_it_was(tmp_path):
    rewards, _ = _score(tmp_path, [{"name": "v", "path": "rewards.py:value", "weight": 0.5},
                                   {"name": "sq", "path": "rewards.py:square", "weight": 2.0}])
    v = np.array([1.0, 4.0, 0.0, 2.0, 7.0])
    np.testing.assert_allclose(rewards, (0.5 * v + 2.0 * v ** 2).astype(np.float32))


def test_an_unknown_normalize_is_a_config_error():
    with pytest.raises(ConfigError, match=r"models.reward.functions\[0\].normalize: normalize is 'zscore'"):
        check_functions({"functions": [{"name": "m", "path": "builtin:math", "weight": 1.0, "kwargs": {},
                                        "normalize": "zscore"}], "correct_score": 1.0, "incorrect_score": 0.0})
