"""Reward functions: the keyword contract, weights, logged parts, and every failure as a UserError naming the path.

The expected values are computed here by hand from the inputs, not by the code under test.
"""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from chatlearn.config.load import load_config
from chatlearn.errors import ConfigError, UserError
from chatlearn.models.reward.functions import RewardManager, resolve_entries
from chatlearn.models.reward.math_reward import MathReward
from chatlearn.models.specs import RewardSpec
from conftest import REPO

BATCH = {"prompts": ["user\nWhat is 1 + 2?\nassistant\n", "user\nWhat is 2 + 2?\nassistant\n",
                     "user\nWhat is 5 + 5?\nassistant\n"],
         "responses": ["\\boxed{3}", "it is 5", "\\boxed{10.0}"],
         "ground_truths": ["3", "4", "10"],
         "data_sources": ["arith", "arith", "other"],
         "extra": [{"extra_info": {"index": 0}, "difficulty": 1}, {"extra_info": {"index": 1}, "difficulty": 2},
                   {"extra_info": {"index": 2}, "difficulty": 3}]}

USER_CODE = '''
CALLS = []

def lengths(*, prompts, responses, ground_truths, data_sources, extra, scale=1.0):
    CALLS.append(dict(prompts=prompts, responses=responses, ground_truths=ground_truths,
                      data_sources=data_sources, extra=extra, scale=scale))
    return [scale * len(r) for r in responses]

def with_parts(prompts, responses, ground_truths, data_sources, extra, **kwargs):
    diff = [float(x["difficulty"]) for x in extra]
    src = [1.0 if s == "arith" else 0.0 for s in data_sources]
    return {"score": [d * 10 for d in diff], "difficulty": diff, "is_arith": src}

def boom(**kwargs):
    helper(kwargs["responses"])

def helper(responses):
    raise ValueError("cannot parse " + responses[0])

def short(**kwargs):
    return [1.0]

def texty(**kwargs):
    return [1.0, "high", 0.0]

def nan(**kwargs):
    return [1.0, float("nan"), 0.0]

def scalar(**kwargs):
    return 1.0

def no_score(**kwargs):
    return {"reward": [1.0, 1.0, 1.0]}

def bad_key(**kwargs):
    return {"score": [1.0, 1.0, 1.0], "a/b": [0.0, 0.0, 0.0]}

def numpy_out(**kwargs):
    import numpy as np
    return np.array([0.5, 0.25, 0.125], dtype=np.float32)

def positional_only(responses):
    return [0.0] * len(responses)

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_CODE)
    return str(path)


def manager(functions, correct=1.0, incorrect=0.0, base_dir=None):
    cfg = {"functions": functions, "correct_score": correct, "incorrect_score": incorrect}
    return RewardManager(RewardSpec(functions=tuple(resolve_entries(cfg)), base_dir=base_dir, timeout_s=0.0))


def fn(name, path, weight=1.0, **kwargs):
    return {"name": name, "path": path, "weight": weight, "kwargs": kwargs}


def test_default_is_the_builtin_math_reward():
    out = manager([], correct=2.0, incorrect=-1.0).score(**BATCH)
    # 3 == 3; "5" has no box; 10.0 == 10 under math-verify
    assert out["score"].tolist() == [2.0, -1.0, 2.0]
    assert list(out["metrics"]) == ["math/score"]
    reference = MathReward({"correct_score": 2.0, "incorrect_score": -1.0}).score(BATCH["responses"],
                                                                                BATCH["ground_truths"])
    assert out["score"].tolist() == reference.tolist()


def test_list_return_kwargs_and_contract(user_file):
    rm = manager([fn("len", f"{user_file}:lengths", scale=0.5)])
    out = rm.score(**BATCH)
    assert out["score"].tolist() == [0.5 * len(r) for r in BATCH["responses"]]
    call = rm.entries[0][4].__globals__["CALLS"][-1]
    assert call == {**BATCH, "scale": 0.5}  # every keyword argument, extra columns included


def test_dict_return_and_weighted_sum(user_file):
    rm = manager([fn("math", "builtin:math", 1.0), fn("parts", f"{user_file}:with_parts", -0.1),
                  fn("len", f"{user_file}:lengths", 2.0)])
    out = rm.score(**BATCH)
    math = [1.0, 0.0, 1.0]
    parts = [10.0, 20.0, 30.0]
    lens = [len(r) for r in BATCH["responses"]]
    expected = [m - 0.1 * p + 2.0 * ln for m, p, ln in zip(math, parts, lens)]
    np.testing.assert_allclose(out["score"], expected, rtol=1e-6)
    m = out["metrics"]
    assert sorted(m) == ["len/score", "math/score", "parts/difficulty", "parts/is_arith", "parts/score"]
    assert m["parts/difficulty"].tolist() == [1.0, 2.0, 3.0] and m["parts/is_arith"].tolist() == [1.0, 1.0, 0.0]
    assert m["parts/score"].tolist() == parts  # unweighted


def test_module_path_and_numpy_return(tmp_path, monkeypatch):
    (tmp_path / "pkg_rw").mkdir()
    (tmp_path / "pkg_rw" / "__init__.py").write_text("")
    (tmp_path / "pkg_rw" / "scores.py").write_text(USER_CODE)
    out = manager([fn("np", "pkg_rw.scores:numpy_out")], base_dir=str(tmp_path)).score(**BATCH)
    assert out["score"].tolist() == [0.5, 0.25, 0.125]


@pytest.mark.parametrize("func, words", [
    ("boom", ["raised ValueError: cannot parse \\boxed{3}", "my_rewards.py:", "in helper", "in boom"]),
    ("short", ["returned 1 values", "given 3 samples"]),
    ("texty", ["'high' (str) at index 1", "not a finite number"]),
    ("nan", ["nan (float) at index 1", "not a finite number"]),
    ("scalar", ["as a float, not a sequence of numbers"]),
    ("no_score", ["without the key 'score'", "reward"]),
    ("bad_key", ["'a/b'", "cannot name a metric"]),
])
def test_runtime_failures_name_the_function(user_file, func, words):
    rm = manager([fn("x", f"{user_file}:{func}")])
    with pytest.raises(UserError) as info:
        rm.score(**BATCH)
    msg = str(info.value)
    assert f"{user_file}:{func}" in msg and "\n" not in msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("path, words", [
    ("{dir}/missing.py:f", ["does not exist", "Fix the path"]),
    ("{file}:nope", ["has no function 'nope'", "lengths", "Fix the name after the colon"]),
    ("{file}:NOT_A_FUNCTION", ["is a int, not a function"]),
    ("{file}:positional_only", ["cannot be called with the keyword arguments", "def f(prompts, responses"]),
    ("{dir}/broken.py:f", ["importing", "SyntaxError", "Fix the file so that it imports"]),
    ("no_such_package_xyz.mod:f", ["cannot import module 'no_such_package_xyz.mod'", "ModuleNotFoundError"]),
    ("just_a_name", ["is not of the form package.module:function"]),
])
def test_import_failures_name_the_function(user_file, tmp_path, path, words):
    (tmp_path / "broken.py").write_text("def f(:\n")
    path = path.format(dir=tmp_path, file=user_file)
    with pytest.raises(ConfigError) as info:
        manager([fn("x", path)], base_dir=str(tmp_path))
    msg = str(info.value)
    assert path in msg and "models.reward.functions[0].path" in msg
    for w in words:
        assert w in msg, msg


def test_config_load_checks_the_functions(tiny_model_dir, arith_data, tmp_path, user_file, monkeypatch):
    monkeypatch.chdir(REPO)
    train, evald = arith_data
    base = [f"models.policy_trainer.load={tiny_model_dir}", f"runtime_args.data_path={train}",
            f"runtime_args.eval_data_path={evald}", f"runtime_args.output_dir={tmp_path / 'out'}",
            "runtime_args.rollout_backend=hf"]
    ok = load_config("template/grpo_fsdp.yaml", base + [
        f"models.reward.functions=[{{name: a, path: '{user_file}:lengths', weight: 0.5, kwargs: {{scale: 2}}}}]"])
    assert resolve_entries(ok.models.reward)[0] == {"name": "a", "path": f"{user_file}:lengths", "weight": 0.5,
                                                     "kwargs": {"scale": 2}, "normalize": "none"}
    cases = [("[{name: a, path: 'nowhere/r.py:f'}]", "models.reward.functions[0].path", "does not exist"),
             ("[{name: a, path: builtin:math}, {name: a, path: builtin:math}]", "models.reward.functions[1].name",
              "used twice"),
             ("[{name: 'a/b', path: builtin:math}]", "models.reward.functions[0].name", "may hold only"),
             ("[{name: m, path: builtin:math, kwargs: {correct_score: 2}}]", "models.reward.functions[0].kwargs",
              "correct_score"),
             (f"[{{name: a, path: '{user_file}:lengths', kwargs: {{bogus: 1}}}}]", "models.reward.functions[0].path",
              "cannot be called")]
    for value, key, words in cases:
        with pytest.raises(ConfigError) as info:
            load_config("template/grpo_fsdp.yaml", base + [f"models.reward.functions={value}"])
        assert info.value.key == key and words in str(info.value), str(info.value)


def test_reward_metrics_are_documented():
    from chatlearn.runtime.driver.sampling import Sampling

    from metrics_doc import undocumented

    parts = {"math/score": np.array([1.0, 0.0]), "format/has_boxed": np.array([1.0, 1.0])}
    keys = list(Sampling.reward_metrics(parts, "train")) + list(Sampling.reward_metrics(parts, "eval"))
    assert keys == ["train/reward/math/score", "train/reward/format/has_boxed", "eval/reward/math/score",
                    "eval/reward/format/has_boxed"]
    assert not undocumented(keys)


def test_example_reward_function():
    spec = importlib.util.spec_from_file_location("example_reward", os.path.join(REPO, "examples", "custom_reward",
                                                                                   "reward.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    format_reward = module.format_reward

    responses = ["\\boxed{3}", "x" * 70, "\\boxed{}" + "y" * 60, "a \\boxed{12} " + "z" * 100]
    out = format_reward(prompts=[""] * 4, responses=responses, ground_truths=[None] * 4, data_sources=[""] * 4,
                        extra=[{}] * 4, max_chars=64, length_penalty=0.01)
    # by hand: boxed? [1, 0, 0 (empty box), 1]; characters 9, 70, 68, 113: over 64 by [0, 6, 4, 49]
    assert out["has_boxed"] == [1.0, 0.0, 0.0, 1.0]
    np.testing.assert_allclose(out["length_penalty"], [0.0, 0.06, 0.04, 0.49])
    np.testing.assert_allclose(out["score"], [1.0, -0.06, -0.04, 0.51])


def test_math_verdicts_are_remembered_and_unchanged():
    """math-verify runs once per distinct (answer, ground truth): the same verdicts as a fresh
    parse-and-verify of each sample, the repeats answered from the cache."""
    from math_verify import parse, verify

    from chatlearn.models.reward import math_reward as mr

    mr._equivalent.cache_clear()
    mr._parsed.cache_clear()
    responses = ["so \\boxed{0.5}", "\\boxed{1/2}", "\\boxed{\\frac{1}{2}}", "\\boxed{2}", "\\boxed{1/2}",
                 "no box", "\\boxed{0.50}", "\\boxed{1/2}"]
    truths = ["\\frac{1}{2}"] * len(responses)
    got = MathReward({"correct_score": 1.0, "incorrect_score": 0.0}).score(responses, truths)
    expected = []
    for r in responses:
        answer = mr.last_boxed(r)
        ok = answer is not None and (answer.strip() == truths[0] or bool(
            verify(parse(f"\\boxed{{{truths[0]}}}"), parse(f"\\boxed{{{answer}}}"))))
        expected.append(1.0 if ok else 0.0)
    assert got.tolist() == expected == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    info = mr._equivalent.cache_info()
    assert info.misses == 4 and info.hits == 2  # 0.5, 1/2, 2, 0.50 parsed; 1/2 twice from the cache
    assert mr._parsed.cache_info().misses == 1  # the ground truth parsed once


def test_integers_are_compared_as_math_verify_compares_them():
    """Two integers are judged without math-verify: the same verdicts as math-verify's on every pair of
    a set with signs, leading zeros and powers of ten, and math-verify is not called."""
    import itertools

    from math_verify import parse, verify

    from chatlearn.models.reward import math_reward as mr

    values = ["0", "-0", "1", "10", "100", "50", "5000", "5", "-5", "12", "012", "120", "-120", "99999999"]
    scorer = MathReward({"correct_score": 1.0, "incorrect_score": 0.0})
    mr._equivalent.cache_clear()
    for a, b in itertools.product(values, values):
        expected = bool(verify(parse(f"\\boxed{{{b}}}"), parse(f"\\boxed{{{a}}}")))
        assert scorer.is_correct(f"so \\boxed{{ {a} }}", b) is expected, (a, b)
    assert mr._equivalent.cache_info().currsize == 0
    assert scorer.is_correct("\\boxed{0.5}", "1/2") and not scorer.is_correct("\\boxed{1.5}", "1")
    # str.strip() removes characters int() refuses (a model's control characters around the number)
    assert scorer.is_correct("\\boxed{17\x1f}", "17 ") and not scorer.is_correct("\\boxed{\x1d79\x1f}", "17")
