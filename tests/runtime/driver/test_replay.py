"""runtime_args.max_replay_episode: which samples each episode trains on, the optimizer steps
that follow, and the replay buffer across a checkpoint."""
from __future__ import annotations

import numpy as np
import pytest

from chatlearn.config.load import load_config
from chatlearn.config.plan import make_plan
from chatlearn.errors import ConfigError
from chatlearn.runtime.driver.replay import ReplayBuffer

TEMPLATE = "template/grpo_fsdp.yaml"
# what the GRPO algorithm's optimizer steps read (chatlearn.runtime.driver.algorithm.GRPO.replay_columns)
KEYS = ("tokens", "prompt_lens", "loss_mask", "old_logprobs", "ref_logprobs", "advantages", "sample_weights")


def episode_batch(episode: int, n: int = 4) -> dict:
    """n samples whose tokens and advantages name their episode and index."""
    lens = np.arange(n) % 3 + 2
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tokens = np.concatenate([np.full(k, 100 * episode + i) for i, k in enumerate(lens)]).astype(np.int64)
    return {"tokens": tokens, "offsets": offsets, "prompt_lens": np.ones(n, np.int64),
            "old_logprobs": -tokens.astype(np.float32), "advantages": episode + np.arange(n) / 10,
            "sample_weights": np.ones(n), "rollout_logprobs": np.zeros(len(tokens))}


def trained_on(buffer: ReplayBuffer, episodes: int) -> list[list[int]]:
    """The episodes whose samples each episode's training batch holds, in order."""
    seen = []
    for e in range(1, episodes + 1):
        batch = episode_batch(e)
        train = buffer.training_batch(batch)
        firsts = train["tokens"][train["offsets"][:-1]]
        seen.append(sorted({int(t) // 100 for t in firsts}))
        assert len(train["prompt_lens"]) == 4 * len(seen[-1])
        buffer.add(batch)
    return seen


@pytest.mark.parametrize("replay, expected", [
    (0, [[1], [2], [3], [4]]),
    (1, [[1], [1, 2], [2, 3], [3, 4]]),
    (2, [[1], [1, 2], [1, 2, 3], [2, 3, 4]]),
    (-1, [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4]]),
])
def test_each_episode_trains_on_its_own_and_the_replayed_samples(replay, expected):
    assert trained_on(ReplayBuffer(replay, KEYS), 4) == expected


def test_replayed_samples_keep_their_own_fields():
    buffer = ReplayBuffer(1, KEYS)
    first, second = episode_batch(1), episode_batch(2)
    buffer.add(first)
    train = buffer.training_batch(second)
    assert len(train["prompt_lens"]) == 8  # the trainer gets 2 episodes' samples
    np.testing.assert_array_equal(train["advantages"], np.concatenate([first["advantages"], second["advantages"]]))
    np.testing.assert_array_equal(train["old_logprobs"],
                                  np.concatenate([first["old_logprobs"], second["old_logprobs"]]))
    assert "rollout_logprobs" not in train


def test_the_buffer_survives_a_checkpoint(tmp_path):
    buffer = ReplayBuffer(2, KEYS)
    for e in (1, 2, 3):
        buffer.add(episode_batch(e))
    buffer.save(str(tmp_path))
    restored = ReplayBuffer(2, KEYS)
    restored.load(str(tmp_path))
    a, b = buffer.training_batch(episode_batch(4)), restored.training_batch(episode_batch(4))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    empty = ReplayBuffer(0, KEYS)
    empty.save(str(tmp_path / "none"))  # no folder needed: nothing is written
    empty.load(str(tmp_path))
    assert empty.episodes == []


def test_plan_counts_the_extra_optimizer_steps(paths_overrides):
    over = paths_overrides + ["runtime_args.num_episode=4", "runtime_args.sample_per_episode=64",
                              "runtime_args.train_global_batch_size=32",
                              "runtime_args.train_micro_batch_size=8"]
    plain = make_plan(load_config(TEMPLATE, over))
    assert plain.total_steps == 4 * plain.steps_per_episode == 8
    plan = make_plan(load_config(TEMPLATE, over + ["runtime_args.max_replay_episode=1"]))
    assert [plan.steps_in_episode(e) for e in range(1, 5)] == [2, 4, 4, 4]
    assert plan.total_steps == 14
    assert any("max_replay_episode" in line and "14 steps" in line for line in plan.describe())
    assert not any("max_replay_episode" in line for line in plain.describe())
    every = make_plan(load_config(TEMPLATE, over + ["runtime_args.max_replay_episode=-1"]))
    assert every.total_steps == 2 * (1 + 2 + 3 + 4)


def test_max_replay_episode_below_minus_one_is_refused(paths_overrides):
    with pytest.raises(ConfigError) as info:
        load_config(TEMPLATE, paths_overrides + ["runtime_args.max_replay_episode=-2"])
    assert info.value.key == "runtime_args.max_replay_episode"
    assert "-1" in str(info.value)
