"""The LLM judge (a model of kind judge): its parsers, its backend against plain transformers, and how the driver
turns its verdicts into scores (unparsed ones counted and scored the default) joined to the reward."""
from __future__ import annotations

import math
import os
import types

import jinja2
import numpy as np
import pytest
import torch

from chatlearn.config.judge_keys import environment
from chatlearn.models.reward.judge import JudgeModel
from chatlearn.models.specs import JudgeSpec
from chatlearn.runtime.driver.judges import JudgeSettings, Judges, parse_verdict, question_of
from chatlearn.runtime.driver.reward_models import RewardModels
from chatlearn.runtime.driver.sampling import Scored
from conftest import REPO

MODEL = os.path.join(REPO, "assets", "tiny_qwen2")
OPTS = {"score_range": (0.0, 10.0), "yes_word": "yes", "no_word": "no"}


@pytest.mark.parametrize("parser, text, want", [
    ("last_number", "I give it 3, no, 7", 7.0),
    ("last_number", "score: 11", None),  # out of the range
    ("last_number", "no idea", None),
    ("last_number", "-2.5 or 4.25", 4.25),
    ("boxed", "\\boxed{2} then \\boxed{8}", 8.0),
    ("boxed", "\\boxed{eight}", None),
    ("boxed", "8", None),
    ("yes_no", "Yes, it is right.", 1.0),
    ("yes_no", "no", 0.0),
    ("yes_no", "  NO!", 0.0),
    ("yes_no", "maybe yes", None),  # the first word decides
    ("yes_no", "", None),
])
def test_builtin_parsers(parser, text, want):
    assert parse_verdict(parser, text, OPTS) == want


def test_user_parser_and_nonfinite():
    assert parse_verdict(lambda t: len(t), "abc", OPTS) == 3.0
    assert parse_verdict(lambda t: None, "abc", OPTS) is None
    assert parse_verdict(lambda t: math.nan, "abc", OPTS) is None


def test_question_is_the_last_user_message():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    assert question_of(msgs, "text") == "q2"
    assert question_of(None, "text") == "text"


@pytest.fixture(scope="module")
def judge():
    torch.manual_seed(0)
    return JudgeModel(JudgeSpec.for_folder(MODEL, parser="yes_prob", max_verdict_tokens=4, batch_size=3))


PROMPTS = [[{"role": "user", "content": f"Question: What is {a} + {b}?\nAnswer: \\boxed{{{a + b}}}\nRight?"}]
           for a, b in ((1, 2), (35, 32), (70, 85), (9, 9), (12, 3))]


def test_yes_prob_is_the_plain_forward(judge):
    """P(yes) / (P(yes) + P(no)) of the next token, batched with left padding, equals an unpadded forward of
    each prompt alone through transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    ref = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    yes, no = tok("yes", add_special_tokens=False)["input_ids"][0], tok("no", add_special_tokens=False)["input_ids"][0]
    want = []
    for p in PROMPTS:
        ids = tok(tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True), add_special_tokens=False,
                  return_tensors="pt")["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(ref(input_ids=ids).logits[0, -1].float(), -1)
        want.append(float(torch.sigmoid(lp[yes] - lp[no])))
    got = judge.judge(PROMPTS)["yes_probs"]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_greedy_verdict_is_transformers_greedy(judge):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    ref = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    out = judge.judge(PROMPTS, probs=True)
    for p, text in zip(PROMPTS, out["texts"]):
        ids = tok(tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True), add_special_tokens=False,
                  return_tensors="pt")["input_ids"]
        gen = ref.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
        assert text == tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    assert out["generated_tokens"] > 0


def test_offload_and_onload_keep_the_verdicts(judge):
    before = judge.judge(PROMPTS)["yes_probs"]
    moved = judge.offload(["weights", "kv_cache"])
    assert moved["bytes"] > 0
    with pytest.raises(RuntimeError):
        judge.judge(PROMPTS, probs=True)  # generating with its weights off the device
    assert judge.onload(["weights", "kv_cache"])["bytes"] == moved["bytes"]
    np.testing.assert_array_equal(judge.judge(PROMPTS)["yes_probs"], before)


class _Group:
    """A judge's worker group: each actor returns ``texts`` for its share."""

    def __init__(self, texts, actors=2):
        self.texts, self.actors, self.calls = texts, [object()] * actors, []

    def call_each(self, method, per_actor):
        outs, start = [], 0
        for (prompts,) in per_actor:  # put() is the identity here
            self.calls.append(prompts)
            n = len(prompts)
            outs.append({"texts": self.texts[start:start + n], "yes_probs": np.full(n, np.nan),
                         "generated_tokens": n})
            start += n
        return outs, 0.0


def _judges(parser="yes_no", template="{{ question }}|{{ response }}|{{ reference }}", **over):
    j = {"prompt_template": template, "parser": parser, "score_range": [0.0, 10.0], "yes_word": "yes",
         "no_word": "no", "default_score": 0.25, "max_unparsed_episodes": 2, "weight": 2.0, "normalize": "none",
         **over}
    cfg = types.SimpleNamespace(models={"jd": types.SimpleNamespace(**j)})
    sampling = types.SimpleNamespace(prompts_text=lambda b: ["p1", "p2", "p3"],
                                      responses_text=lambda b: ["r1", "r2", "r3"])
    sched = types.SimpleNamespace(take_turn=lambda name: None)
    group = _Group(["yes", "no", "I cannot say"])
    out = Judges.__new__(Judges)
    Judges.__init__(out, cfg, [], {}, sampling, sched)
    out.settings = {"jd": JudgeSettings.of(cfg, "jd")}
    out.templates = {"jd": environment(undefined=jinja2.StrictUndefined).from_string(template)}
    out.groups = {"jd": group}
    return out, group


def test_verdicts_become_scores_unparsed_counted(monkeypatch):
    monkeypatch.setattr("chatlearn.runtime.driver.judges.put", lambda x: x)
    judges, group = _judges()
    prompts = types.SimpleNamespace(messages=[[{"role": "user", "content": f"q{i}"}] for i in (1, 2, 3)],
                                    truths=["1", "2", "3"])
    scores, metrics = judges.score_all({}, prompts)
    np.testing.assert_array_equal(scores["jd"], [1.0, 0.0, 0.25])
    assert metrics["judge/jd/unparsed"] == 1.0
    rendered = [m[0]["content"] for share in group.calls for m in share]
    assert rendered == ["q1|r1|1", "q2|r2|2", "q3|r3|3"]  # each replica got its contiguous share
    assert [len(c) for c in group.calls] == [2, 1]


def test_judge_scores_join_the_reward_weighted_and_normalised():
    """weight x score (normalize none) or weight x the whitened score (batch), added to the functions' reward;
    metrics under train/judge/<name>/ and train/reward/<name>/."""
    judges, _ = _judges()
    rms = RewardModels.__new__(RewardModels)
    rms.settings, rms.others = {}, {}
    scored = Scored(np.array([1.0, 0.0, 0.0], np.float32), {}, np.array([1.0, 0.0, 0.0]))
    raw = np.array([1.0, 0.0, 0.5])
    out, metrics = rms.add(scored, {"jd": raw}, others=judges.settings)
    np.testing.assert_allclose(out.rewards, [3.0, 0.0, 1.0])
    assert metrics["train/judge/jd/score_mean"] == pytest.approx(0.5)
    assert metrics["train/reward/jd/score"] == pytest.approx(0.5)
    assert metrics["train/reward/jd/reward"] == pytest.approx(1.0)
    judges2, _ = _judges(normalize="batch")
    out, _ = rms.add(scored, {"jd": raw}, others=judges2.settings)
    white = (raw - raw.mean()) / (raw.std() + 1e-6)
    np.testing.assert_allclose(out.rewards, np.array([1.0, 0.0, 0.0]) + 2.0 * white, rtol=1e-6)
    out, _ = rms.add(scored, {"jd": raw}, prefix="eval", normalize=False, others=judges2.settings)
    np.testing.assert_allclose(out.rewards, [3.0, 0.0, 1.0])  # an evaluation does not whiten


def test_a_prompt_past_the_limit_is_a_user_error():
    from chatlearn.errors import UserError

    short = JudgeModel(JudgeSpec.for_folder(MODEL, parser="yes_prob").replace(max_prompt_tokens_length=20))
    with pytest.raises(UserError, match="max_prompt_tokens_length"):
        short.judge(PROMPTS)


VLLM_RUN = r'''
import json, sys
from chatlearn.models.reward.judge import JudgeModel
from chatlearn.models.specs import JudgeSpec
if __name__ == "__main__":
    prompts = json.loads(sys.argv[2])
    spec = JudgeSpec.for_folder(sys.argv[1], parser="yes_prob", max_verdict_tokens=4, batch_size=8)
    out = JudgeModel(spec.replace(backend="vllm", dtype="float32", max_prompt_tokens_length=200)).judge(prompts, True)
    print("RESULT" + json.dumps({"texts": out["texts"], "yes_probs": [float(p) for p in out["yes_probs"]]}))
'''


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_vllm_judge_gives_the_transformers_verdicts(judge, tmp_path):
    """The same judge on the installed vLLM (CPU build, in-process engine): the same P(yes) (its probe_logprobs of
    either token) and the same greedy verdicts as on transformers."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "ERROR",
           "PYTHONPATH": os.pathsep.join([REPO, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                  if p and "fake_vllm" not in p]])}
    proc = subprocess.run([sys.executable, "-c", VLLM_RUN, MODEL, json.dumps(PROMPTS)], capture_output=True,
                          text=True, env=env, cwd=str(tmp_path), timeout=360)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    found = json.loads(lines[-1][len("RESULT"):])
    want = judge.judge(PROMPTS, probs=True)
    np.testing.assert_allclose(found["yes_probs"], want["yes_probs"], atol=1e-3)
    assert found["texts"] == want["texts"]


def test_a_judge_never_read_stops_the_run_after_n_episodes(monkeypatch):
    from chatlearn.errors import UserError

    monkeypatch.setattr("chatlearn.runtime.driver.judges.put", lambda x: x)
    judges, group = _judges()
    prompts = types.SimpleNamespace(messages=None, truths=["1", "2", "3"])
    judges.score_all({}, prompts, training=True)  # one verdict of three unparsed: counts nothing
    group.texts = ["?", "?", "?"]
    judges.score_all({}, prompts)  # an evaluation: not counted
    judges.score_all({}, prompts, training=True)
    with pytest.raises(UserError, match="models.jd.max_unparsed_episodes"):
        judges.score_all({}, prompts, training=True)
