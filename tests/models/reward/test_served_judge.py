"""The served judge (a judge with an ``endpoint``) against a small OpenAI-compatible server on 127.0.0.1 that
serves the tiny judge with transformers (tests/support/openai_server.py): the same verdicts as the local judge on
the same prompts, the concurrency limit, a server restart within ``down_timeout_s``, the stop when it stays down,
and the refusals (no log-probs, an unknown model)."""
from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time

import numpy as np
import pytest

from chatlearn.errors import UserError
from chatlearn.models.reward.judge import JudgeModel
from chatlearn.models.reward.served_judge import EndpointDown, ServedJudge, ServedJudgeSettings
from chatlearn.models.specs import JudgeSpec
from conftest import REPO
from openai_server import OpenAIServer  # tests/support/ is on sys.path (tests/conftest.py)

JUDGE = os.path.join(REPO, "assets", "tiny_judge")
CASES = [(70, 85, 155), (70, 85, 154), (12, 3, 15), (12, 3, 51), (40, 2, 42), (9, 9, 18), (35, 32, 77), (1, 2, 3)]
# the demo's prompt (template/grpo_judge.yaml): a ChatML conversation of the question and the answer
DEMO = [[{"role": "user", "content": f"<|im_start|>user\nWhat is {a} + {b}? Put the final answer in \\boxed{{}}."
                                    f"<|im_end|>\n<|im_start|>assistant\n\\boxed{{{c}}}<|im_end|>\n"}]
        for a, b, c in CASES]
CHAT = [[{"role": "user", "content": f"Question: What is {a} + {b}?\nAnswer: {c}\nIs the answer right?"}]
        for a, b, c in CASES]


def settings(url: str, **kw) -> ServedJudgeSettings:
    base = dict(name="judge", endpoint=url, served_model=None, api_key_env=None, chat=False, want_probs=True,
                temperature=0.0, max_verdict_tokens=4, seed=0, yes_word="yes", no_word="no", yes_token=None,
                no_token=None, top_logprobs=20, max_concurrency=4, request_timeout_s=30.0, retry_backoff_s=0.05,
                retry_backoff_max_s=0.4, down_timeout_s=20.0)
    base.update(kw)
    return ServedJudgeSettings(**base)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    srv = OpenAIServer(JUDGE).start()
    yield srv
    srv.stop()


def test_the_served_judge_gives_the_local_judges_verdicts(server):
    """The completions API (apply_chat_template false) with yes_prob, and the chat API (true) with the verdict's
    text: the probabilities and the texts of the local judge (backend hf) on the same prompts."""
    local = JudgeModel(dataclasses.replace(JudgeSpec.for_folder(JUDGE, parser="yes_prob", max_verdict_tokens=4),
                                           apply_chat_template=False))
    want = local.judge(DEMO, probs=True)
    got = ServedJudge(settings(server.url)).judge(DEMO, probs=True)
    assert got["texts"] == want["texts"]
    np.testing.assert_allclose(got["yes_probs"], want["yes_probs"], atol=1e-5)
    assert (want["yes_probs"] > 0.5).any() and (want["yes_probs"] < 0.5).any()  # both verdicts among them
    assert got["generated_tokens"] == want["generated_tokens"]

    chat_local = JudgeModel(JudgeSpec.for_folder(JUDGE, parser="yes_no", max_verdict_tokens=4))
    want = chat_local.judge(CHAT, probs=True)
    got = ServedJudge(settings(server.url, chat=True, want_probs=False)).judge(CHAT, probs=True)
    assert got["texts"] == want["texts"]
    np.testing.assert_allclose(got["yes_probs"], want["yes_probs"], atol=1e-5)


def test_the_judges_own_tokens_name_yes_and_no(server):
    """With the judge's folder at hand (load), its first tokens of yes_word / no_word are looked up; without it,
    the longest listed token that begins each word: the same here."""
    from chatlearn.models.reward.served_judge import first_tokens

    yes, no = first_tokens(JUDGE, False, "yes", "no")
    assert (yes, no) == ("y", "n")
    a = ServedJudge(settings(server.url, yes_token=yes, no_token=no)).judge(DEMO[:3])
    b = ServedJudge(settings(server.url)).judge(DEMO[:3])
    np.testing.assert_array_equal(a["yes_probs"], b["yes_probs"])
    assert ServedJudge.find({"y": -1.0, "ye": -2.0, "n": -3.0}, None, "yes") == -2.0
    assert ServedJudge.find({"x": -1.0}, None, "yes") is None


def test_at_most_max_concurrency_requests_in_flight():
    srv = OpenAIServer(JUDGE, delay=0.1).start()
    try:
        ServedJudge(settings(srv.url, max_concurrency=3)).judge(DEMO * 2)
        stats = srv.stats()
        assert stats["requests"] == 2 * len(DEMO)
        assert stats["max_in_flight"] == 3  # reached, never passed
    finally:
        srv.stop()


def test_a_server_restart_within_down_timeout_is_survived(server):
    """The server goes away mid-call and comes back on the same port after a second: the requests are retried
    with backoff and the verdicts are those it gives when it is up."""
    want = ServedJudge(settings(server.url)).judge(DEMO)
    srv = OpenAIServer(JUDGE, port=free_port()).start()
    client = ServedJudge(settings(srv.url, down_timeout_s=30.0))
    client.judge(DEMO[:1])  # up: the model's name is read
    srv.stop()
    threading.Timer(1.0, srv.start).start()
    try:
        got = client.judge(DEMO)
    finally:
        time.sleep(0.1)
        srv.stop()
    assert client.retries > 0
    np.testing.assert_allclose(got["yes_probs"], want["yes_probs"], atol=1e-6)


def test_the_run_stops_when_the_endpoint_stays_down():
    """Nothing listens: each retry waits retry_backoff_s x 2^k (at most retry_backoff_max_s, never past the
    deadline) on the client's clock, and once the endpoint has failed for down_timeout_s the call raises
    EndpointDown, one paragraph naming the key."""
    now, waits = [0.0], []

    def sleep(s):
        waits.append(round(s, 6))
        now[0] += s

    client = ServedJudge(settings(f"http://127.0.0.1:{free_port()}/v1", served_model="m", max_concurrency=1,
                                  down_timeout_s=2.0), clock=lambda: now[0], sleep=sleep)
    with pytest.raises(EndpointDown) as err:
        client.judge(DEMO[:1])
    assert waits == [0.05, 0.1, 0.2, 0.4, 0.4, 0.4, 0.4, 0.05]  # doubled, capped, the last up to the deadline
    assert client.retries == len(waits) + 1
    msg = str(err.value)
    assert msg.startswith("models.judge.endpoint: ") and "down_timeout_s 2" in msg and "ConnectError" in msg
    assert "enable_resume_training" in msg and "\n" not in msg


def test_http_503_is_retried_until_down_timeout(server):
    server.fail = True
    try:
        client = ServedJudge(settings(server.url, served_model="tiny-judge", down_timeout_s=0.5))
        with pytest.raises(EndpointDown, match="HTTP 503"):
            client.judge(DEMO[:2])
        assert client.retries >= 2
    finally:
        server.fail = False


def test_refusals_stop_at_once():
    """No log-probs for yes_prob, and an unknown model (HTTP 404): a UserError, no retries."""
    srv = OpenAIServer(JUDGE, logprobs=False).start()
    try:
        with pytest.raises(UserError, match="returned none.*--max-logprobs"):
            ServedJudge(settings(srv.url)).judge(DEMO[:1])
        client = ServedJudge(settings(srv.url, served_model="other", want_probs=False))
        with pytest.raises(UserError, match="HTTP 404.*'other' does not exist"):
            client.judge(DEMO[:1])
        assert client.retries == 0
        # the probe before the first episode names the models the server lists
        with pytest.raises(UserError, match="is 'other', which the server .* does not serve .*lists tiny-judge"):
            ServedJudge(settings(srv.url, served_model="other")).probe()
        probed = ServedJudge(settings(srv.url))
        probed.probe()
        assert probed.model == "tiny-judge"
    finally:
        srv.stop()


def test_the_api_key_is_sent_and_not_kept(server, monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "s3cret-value")
    client = ServedJudge(settings(server.url, api_key_env="JUDGE_TEST_KEY"))
    client.judge(DEMO[:1])
    assert server.seen_auth[-1] == "Bearer s3cret-value"
    assert "s3cret" not in repr(client.s) and "s3cret" not in repr(vars(client.s))


def test_device_keys_of_a_served_judge_are_named_as_not_applying():
    """The keys only a judge of the run's own uses, set on a served judge, are the ones the run warns about."""
    from omegaconf import OmegaConf

    from chatlearn.config.judge_keys import SERVED_INERT_KEYS, served_inert_keys
    from chatlearn.config.schema import Judge

    j = OmegaConf.structured(Judge(endpoint="http://127.0.0.1:8000/v1"))
    assert served_inert_keys(j) == []
    j.backend, j.dtype, j.generation_batch_size = "vllm", "bfloat16", 8
    assert served_inert_keys(j) == ["backend", "dtype", "generation_batch_size"]
    assert set(SERVED_INERT_KEYS) <= {f for f in Judge.__dataclass_fields__}
