"""runtime_args.max_staleness: the rollout pipeline's versions (no trained sample is more than k
versions old, the generation calls keep the on-policy order, a checkpoint keeps the rollouts ahead),
the config's refusals (colocation names the key and the fix) and the plan's description."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from chatlearn.cli import main
from chatlearn.config.load import load_config, load_run
from chatlearn.config.plan import make_plan
from chatlearn.errors import ConfigError, UserError
from chatlearn.runtime.driver.overlap import RolloutPipeline, StaleSamples, kept_rollouts
from chatlearn.runtime.driver.sampling import Prompts, Scored

TEMPLATE = "template/grpo_fsdp.yaml"
APART = ["runtime_args.colocation=[]"]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)


class FakeEngine:
    """A rollout engine that holds a weight version and records the generate calls (and whether one
    ran while the weights changed)."""

    def __init__(self):
        self.version = 0
        self.calls: list[tuple[int, int]] = []  # (episode, version generated with)
        self.draws: list[int] = []
        self.busy = threading.Lock()
        self.torn = False

    def draw(self, episode):
        self.draws.append(episode)
        return self.prompts_of([episode])

    @staticmethod
    def prompts_of(rows):
        """Prompt row e (of episode e), four samples of it."""
        return Prompts(ids=[[int(e)] for e in rows for _ in range(4)], truths=[str(e) for e in rows for _ in range(4)],
                       sources=["fake"] * 4 * len(rows), extra=[{}] * 4 * len(rows), indices=[int(e) for e in rows])

    def produce(self, episode, prompts):
        with self.busy:
            v = self.version
            time.sleep(0.002)
            self.torn |= self.version != v
            self.calls.append((episode, v))
        n = len(prompts.ids)
        batch = {"offsets": np.arange(n + 1), "prompt_lens": np.ones(n, int), "tokens": np.full(n, episode, np.int64)}
        rewards = np.full(n, episode / 10)
        return batch, Scored(rewards, {"fake/score": rewards * 2}, rewards + 1), {"time/generate": 0.002}

    def push(self):
        with self.busy:
            self.version += 1


def drive(k: int, episodes: int, engine: FakeEngine, pipe: RolloutPipeline | None = None, start: int = 1,
          trained: list | None = None) -> list[tuple[int, int, np.ndarray]]:
    """The engine's loop: fill, take (the trainer at version episode - 1), train, drain, push."""
    pipe = pipe or RolloutPipeline(k, engine.draw, engine.produce, engine.prompts_of)
    trained = [] if trained is None else trained
    for episode in range(start, episodes + 1):
        pipe.fill(episode, episodes)
        rollout, metrics = pipe.take(episode, trainer_version=episode - 1)
        trained.append((episode, episode - 1, rollout.batch["policy_version"], metrics))
        time.sleep(0.001)  # training
        pipe.drain()
        engine.push()
        pipe.pushed()
    pipe.close()
    return trained


@pytest.mark.parametrize("k", [1, 2, 3])
def test_no_trained_sample_is_older_than_max_staleness(k):
    engine = FakeEngine()
    trained = drive(k, 9, engine)
    assert [e for e, *_ in trained] == list(range(1, 10))
    for episode, trainer_version, versions, metrics in trained:
        lag = trainer_version - versions
        assert lag.max() <= k and lag.min() >= 0
        # k behind once the pipeline is full; the first episodes use the initial weights
        assert set(lag.tolist()) == {min(k, episode - 1)}
        assert metrics["train/staleness_max"] == min(k, episode - 1) == metrics["train/staleness_mean"]
    # the generate calls and the prompt draws keep the on-policy order; no call saw the weights change
    assert [e for e, _ in engine.calls] == engine.draws == list(range(1, 10))
    assert not engine.torn
    # episode m generated with version m - k - 1 (the initial weights for the first k + 1)
    assert [v for _, v in engine.calls] == [max(0, m - k - 1) for m in range(1, 10)]


def test_a_batch_older_than_max_staleness_is_refused():
    engine = FakeEngine()
    pipe = RolloutPipeline(1, engine.draw, engine.produce, engine.prompts_of)
    pipe.fill(1, 5)  # episodes 1 and 2 with version 0
    pipe.take(1, trainer_version=0)
    with pytest.raises(StaleSamples, match="max_staleness: 1"):
        pipe.take(2, trainer_version=2)  # a push was skipped: 2 versions behind
    pipe.close()


def test_checkpoint_keeps_the_rollouts_ahead(tmp_path):
    """Saved after episode 3's training (before its push), loaded with the rollout at version 3: the
    resumed loop trains on the same versions and makes the same generate calls."""
    k, n = 2, 8
    whole = FakeEngine()
    expected = drive(k, n, whole)

    first = FakeEngine()
    pipe = RolloutPipeline(k, first.draw, first.produce, first.prompts_of)
    trained = []
    for episode in (1, 2, 3):
        pipe.fill(episode, n)
        rollout, metrics = pipe.take(episode, episode - 1)
        trained.append((episode, episode - 1, rollout.batch["policy_version"], metrics))
        if episode == 3:
            pipe.save(str(tmp_path))
        pipe.drain()
        first.push()
        pipe.pushed()
    pipe.close()

    again = FakeEngine()
    again.version = 3  # the checkpoint's weights pushed on resume
    pipe = RolloutPipeline(k, again.draw, again.produce, again.prompts_of)
    pipe.load(str(tmp_path))
    pipe.pushed(version=3)
    assert sorted(pipe.pending) == [4, 5]
    for m in (4, 5):  # restored from arrays (no pickle): the same prompts, samples and rewards
        r = pipe.pending[m].result()
        assert r.prompts == FakeEngine.prompts_of([m]) and r.version == (m - k - 1 if m > k + 1 else 0)
        assert r.batch["tokens"].tolist() == [m] * 4 and r.scored.parts["fake/score"].tolist() == [m / 5] * 4
        assert r.scored.shaped.tolist() == [m / 10 + 1] * 4
    drive(k, n, again, pipe, start=4, trained=trained)
    assert [(e, v, list(s)) for e, v, s, _ in trained] == [(e, v, list(s)) for e, v, s, _ in expected]
    assert first.calls[:5] + again.calls == whole.calls


@pytest.mark.parametrize("overrides, words", [
    ([], ["shares its devices with policy_trainer", "runtime_args.colocation=[]", "max_staleness=0"]),
    (["runtime_args.colocation=[policy,ref_policy]", "models.policy_trainer.kl_coef=0.01"],
     ["shares its devices with ref_policy"]),
    (APART + ["runtime_args.dynamic_sampling=true"], ["dynamic_sampling"]),
    (APART + ["runtime_args.max_replay_episode=1"], ["max_replay_episode=0"]),
])
def test_staleness_refusals_name_the_key_and_the_fix(paths_overrides, overrides, words):
    with pytest.raises(ConfigError) as info:
        make_plan(load_config(TEMPLATE, paths_overrides + ["runtime_args.max_staleness=1"] + overrides))
    assert info.value.key == "runtime_args.max_staleness"
    for w in words:
        assert w in str(info.value), str(info.value)


def test_negative_staleness_is_refused(paths_overrides):
    with pytest.raises(ConfigError) as info:
        make_plan(load_config(TEMPLATE, paths_overrides + APART + ["runtime_args.max_staleness=-1"]))
    assert info.value.key == "runtime_args.max_staleness"


def test_plan_with_staleness_resolves_decoupled_and_describes_the_overlap(paths_overrides, capsys):
    plan = make_plan(load_config(TEMPLATE, paths_overrides + APART + ["runtime_args.max_staleness=2"]))
    assert plan.max_staleness == 2 and plan.rollout_correction == "decoupled"
    chosen = make_plan(load_config(TEMPLATE, paths_overrides + APART + [
        "runtime_args.max_staleness=1", "models.policy_trainer.rollout_correction=tis"]))
    assert chosen.rollout_correction == "tis"
    default = make_plan(load_config(TEMPLATE, paths_overrides))
    assert default.max_staleness == 0 and default.rollout_correction == "none"
    assert not any(line.startswith("overlap") for line in default.describe())

    assert main(["run", "--dry-run", TEMPLATE, *paths_overrides, *APART, "runtime_args.max_staleness=2"]) == 0
    out = capsys.readouterr().out
    assert "overlap: max_staleness 2: while episode n trains (device group 1), the rollout engine " \
           "(device group 0) generates and the reward workers score episodes n+1..n+2" in out
    assert "episode n trains on samples of policy version n-3" in out
    assert "rollout correction: decoupled" in out


def test_correction_keys_are_read_when_staleness_resolves_auto_to_decoupled(paths_overrides):
    """rollout_correction_level is refused while auto resolves to none, accepted once max_staleness
    makes it decoupled."""
    level = ["models.policy_trainer.rollout_correction_level=sequence"]
    with pytest.raises(ConfigError) as info:
        load_run(TEMPLATE, paths_overrides + APART + level)
    assert info.value.key == "models.policy_trainer.rollout_correction_level"
    _, plan = load_run(TEMPLATE, paths_overrides + APART + level + ["runtime_args.max_staleness=1"])
    assert plan.rollout_correction == "decoupled"


def test_a_checkpoint_with_rollouts_ahead_resumes_only_with_its_staleness(tmp_path):
    engine = FakeEngine()
    pipe = RolloutPipeline(2, engine.draw, engine.produce, engine.prompts_of)
    pipe.fill(1, 9)
    pipe.take(1, 0)
    pipe.save(str(tmp_path))  # episodes 2 and 3 ahead
    pipe.close()
    assert [r[0] for r in kept_rollouts(str(tmp_path), 2)] == [2, 3]
    for other in (0, 1, 3):
        with pytest.raises(UserError, match="runtime_args.max_staleness=2"):
            kept_rollouts(str(tmp_path), other)
    assert kept_rollouts(str(tmp_path / "none"), 0) == []  # an on-policy checkpoint keeps nothing
    last = RolloutPipeline(1, engine.draw, engine.produce, engine.prompts_of)
    (tmp_path / "last").mkdir()
    last.save(str(tmp_path / "last"))  # nothing ahead (the final episode's checkpoint): any value resumes
    assert kept_rollouts(str(tmp_path / "last"), 0) == []
    last.close()
