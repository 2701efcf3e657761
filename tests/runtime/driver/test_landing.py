"""The check that a weight push landed (chatlearn/runtime/driver/landing.py): the probe, the
tolerance by precision, the comparison of every replica against the trainer, and the paragraph of a
push that did not land."""
from __future__ import annotations

import numpy as np
import pytest

from chatlearn.errors import UserError
from chatlearn.runtime.driver.landing import (PROBE_TOKENS, TOLERANCE, LandingCheck, largest_gap, probe_tokens,
                                              tolerance)


class Group:
    """A worker group whose ``call`` returns one answer per actor and records the calls."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def call(self, method, *args):
        import ray

        self.calls.append((method, [ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args]))
        return list(self.answers), 0.0


@pytest.fixture(autouse=True)
def no_ray_put(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "put", lambda x: x)


def test_probe_is_the_first_prompts_tail_and_ids_spread_over_the_vocabulary():
    prompt = list(range(1000, 1100))
    tokens = probe_tokens(prompt, vocab_size=900, limit=512)
    assert len(tokens) == PROBE_TOKENS and tokens == probe_tokens(prompt, 900, 512)  # chosen the same each time
    assert tokens[:24] == prompt[-24:] and tokens[24:] == [100, 200, 300, 400, 500, 600, 700, 800]
    assert len(probe_tokens(prompt, 900, limit=6)) == 6  # a prompt the engines admit
    assert len(probe_tokens([], 900, 512)) == 8 and len(probe_tokens([7], 2, 1)) == 2


def test_tolerance_follows_the_coarser_precision_unless_configured():
    assert tolerance(["float32", "float32"], None) == TOLERANCE["float32"]
    assert tolerance(["float32", "bfloat16"], None) == TOLERANCE["bfloat16"]
    assert tolerance(["float16", "float32"], None) == TOLERANCE["float16"]
    assert TOLERANCE["float32"] < TOLERANCE["float16"] < TOLERANCE["bfloat16"]
    assert tolerance(["bfloat16", "bfloat16"], 0.03) == 0.03


def test_largest_gap():
    assert largest_gap(np.array([-1.0, -2.0]), np.array([-1.5, -2.1])) == pytest.approx(0.5)
    assert largest_gap(np.array([np.nan, -2.0]), np.array([-1.0, -2.0])) == float("inf")
    assert largest_gap(np.array([-1.0]), np.array([-1.0, -2.0])) == float("inf")


def _check(configured=None, dp=2):
    return LandingCheck([11, 12, 13, 14], trainer_dp=dp, configured=configured, model="/models/tiny_qwen2",
                        backend="hf")


def test_trainer_gets_one_probe_per_data_parallel_rank():
    check = _check(dp=2)
    trainer = Group([{"logprobs": np.array([0, -1, -2, -3, 0, -1, -2, -3], dtype=np.float32), "dtype": "float32"}])
    expected = check.trainer_side(trainer)
    method, (batch,) = trainer.calls[0]
    assert method == "probe_logprobs"
    assert batch["tokens"].tolist() == [11, 12, 13, 14] * 2 and batch["offsets"].tolist() == [0, 4, 8]
    assert batch["prompt_lens"].tolist() == [1, 1]
    assert expected["logprobs"].tolist() == [-1, -2, -3]


def test_a_landed_push_passes_with_its_metrics():
    check = _check()
    expected = {"logprobs": np.array([-1.0, -2.0, -3.0]), "dtype": "float32"}
    rollout = Group([{"logprobs": np.array([-1.0, -2.001, -3.0]), "dtype": "float32"}] * 2)
    metrics = check.rollout_side(rollout, expected, "after episode 1")
    assert rollout.calls == [("probe_logprobs", [[11, 12, 13, 14]])]
    assert metrics["sync/landing_gap_max"] == pytest.approx(0.001)
    assert metrics["perf/weight_push_check_s"] >= 0


@pytest.mark.parametrize("configured", [None, 0.05])
def test_a_push_that_did_not_land_stops_the_run_in_one_paragraph(configured):
    check = _check(configured)
    expected = {"logprobs": np.array([-1.0, -2.0, -3.0]), "dtype": "float32"}
    landed = {"logprobs": np.array([-1.0, -2.0, -3.0]), "dtype": "float32"}
    stale = {"logprobs": np.array([-1.0, -2.25, -3.0]), "dtype": "float32"}
    with pytest.raises(UserError) as err:
        check.rollout_side(Group([landed, stale]), expected, "after episode 3")
    text = err.value.message
    assert "\n" not in text and "Traceback" not in text
    for part in ("the weight push after episode 3 did not land", "replica 1 of 2", "models.policy",
                 "hf rollout of /models/tiny_qwen2", "0.25 nats", "4 fixed probe tokens",
                 "runtime_args.weight_push_check_tolerance", "runtime_args.weight_push_check=false",
                 "OUTPUT_DIR/logs/"):
        assert part in text, (part, text)
    assert f"tolerance {configured if configured else TOLERANCE['float32']:g}" in text
    assert ("float32's default" in text) == (configured is None)


def test_bf16_sides_get_the_looser_tolerance():
    check = _check()
    expected = {"logprobs": np.array([-1.0, -2.0, -3.0]), "dtype": "bfloat16"}
    rollout = Group([{"logprobs": np.array([-1.0, -2.2, -3.0]), "dtype": "bfloat16"}])
    assert check.rollout_side(rollout, expected, "after episode 1")["sync/landing_gap_max"] == pytest.approx(0.2)
    rollout = Group([{"logprobs": np.array([-1.0, -2.2, -3.0]), "dtype": "float32"}])
    with pytest.raises(UserError, match="its only replica"):
        _check().rollout_side(rollout, dict(expected, dtype="float32"), "on resuming from /out/checkpoints/x")


def _pushes(check, steps):
    """Run ``check`` over pushes of (trainer's probe log-probs, rollout's), both bfloat16; the metrics of each."""
    out = []
    for trainer, rollout in steps:
        expected = {"logprobs": np.asarray(trainer, np.float64), "dtype": "bfloat16"}
        out.append(check.rollout_side(Group([{"logprobs": np.asarray(rollout, np.float64), "dtype": "bfloat16"}]),
                                      expected, f"after episode {len(out) + 1}"))
    return out


def test_a_push_that_did_not_land_within_the_bf16_tolerance_is_seen_against_the_previous_push():
    """bfloat16's tolerance (0.5 nats) is wider than an episode moves the probe: a replica that kept its
    weights is within it, and is told by comparing each side with itself at the previous push."""
    rng = np.random.default_rng(0)
    w0 = -rng.uniform(1, 8, 3)
    w1 = w0 + np.array([0.0, 0.3, -0.2])  # the trainer's probe after an episode: under 0.5 from w0
    noise = rng.normal(0, 0.03, (3, 3))  # the engines' own gap
    stale = w0 + noise[0]
    with pytest.raises(UserError) as err:  # the second push did not land: the replica still gives w0's
        _pushes(_check(), [(w0, w0 + noise[0]), (w1, stale)])
    text = err.value.message
    assert "\n" not in text
    for part in ("the weight push after episode 2 did not land", "moved by up to 0.3 nats", "its only replica",
                 "moved by up to 0 nats", "before it", "OUTPUT_DIR/logs/", "runtime_args.weight_push_check=false"):
        assert part in text, (part, text)
    halfway = w0 + 0.2 * (w1 - w0) + noise[1]  # a push that moved it a fifth of the way: refused too
    with pytest.raises(UserError, match="did not land"):
        _pushes(_check(), [(w0, w0 + noise[0]), (w1, halfway)])


def test_landed_pushes_pass_whatever_the_weights_moved():
    """No false alarm: landed pushes with the engines' gap, pushes of weights that barely moved (a tiny learning
    rate: the bf16 rollout's probe may not change at all) or did not move (a skipped step)."""
    rng = np.random.default_rng(1)
    w = [-rng.uniform(1, 8, 3)]
    for step in (0.3, 0.05, 0.001, 0.0, 0.4, 0.02):
        w.append(w[-1] + rng.choice([-1.0, 1.0], 3) * step)
    for trial in range(20):
        noise = rng.normal(0, 0.05, (len(w), 3))
        metrics = _pushes(_check(), [(t, t + n) for t, n in zip(w, noise)])
        assert max(m["sync/landing_gap_max"] for m in metrics) < 0.5
    frozen = w[0] + rng.normal(0, 0.05, 3)  # bf16 rounding keeps the rollout's probe where it was under tiny steps
    _pushes(_check(), [(w[0], frozen), (w[0] + 0.001, frozen), (w[0] + 0.002, frozen)])
