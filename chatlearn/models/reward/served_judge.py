"""A served judge: the judge kind (``models.<name>: {kind: judge, endpoint: http://host:port/v1, ...}``) pointed
at an OpenAI-compatible HTTP endpoint (vLLM's or SGLang's server, or any other) instead of a model of the run's.

The driver renders each sample's prompt from the judge's ``prompt_template`` as for a local judge
(``chatlearn.runtime.driver.judges``) and :class:`ServedJudge` sends one request per prompt:

    apply_chat_template true    POST {endpoint}/chat/completions  {"messages": [the rendered user message]}
                                (the server applies the judge's chat template)
    apply_chat_template false   POST {endpoint}/completions       {"prompt": the rendered text}

with ``model`` (``served_model``), ``temperature``, ``max_tokens`` (``max_verdict_tokens``) and ``seed``. For the
``yes_prob`` parser it asks for the log-probs of the reply's first token instead (``max_tokens`` 1, the
``top_logprobs`` most likely) and reads ``p = P(yes) / (P(yes) + P(no))`` from them, ``yes`` and ``no`` being
the first tokens of ``yes_word`` and ``no_word`` (a reply whose top tokens hold neither is unparsed); a server
that returns no log-probs is refused with a UserError.

At most ``max_concurrency`` requests are in flight. A request that fails for a reason that may pass (no
connection, a timeout of ``request_timeout_s``, HTTP 408, 429 or 5xx) is retried after ``retry_backoff_s``,
doubled at each retry up to ``retry_backoff_max_s``; once the endpoint has failed every request for
``down_timeout_s`` seconds in a row (no success since its first failure) the run stops with a UserError. Any
other HTTP error (4xx: a bad request, an unknown model, a prompt longer than the server's context) stops it at
once, with the server's message. The API key (``api_key_env``: the name of an environment variable) is read
from the environment when the client is made and sent as a bearer token; it is never logged nor written.
"""
from __future__ import annotations

import math
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np

from chatlearn.errors import UserError
from chatlearn.logging.console import warn

# failures that may pass: the request is retried (with backoff) until the endpoint has been down for
# down_timeout_s
RETRY_STATUS = (408, 409, 425, 429)


@dataclass(frozen=True)
class ServedJudgeSettings:
    """What the client reads of a served judge (``models.<name>``)."""

    name: str
    endpoint: str  # the API's base URL, e.g. http://127.0.0.1:8000/v1 (no trailing slash)
    served_model: str | None  # the model name the server serves it under (None: the only one it lists)
    api_key_env: str | None
    chat: bool  # apply_chat_template: the chat-completions API (else the completions API)
    want_probs: bool  # parser yes_prob
    temperature: float
    max_verdict_tokens: int
    seed: int
    yes_word: str
    no_word: str
    yes_token: str | None  # the first token of yes_word in the judge's tokenizer, as text (None: not known)
    no_token: str | None
    top_logprobs: int
    max_concurrency: int
    request_timeout_s: float
    retry_backoff_s: float
    retry_backoff_max_s: float
    down_timeout_s: float

    @classmethod
    def of(cls, cfg, name: str) -> "ServedJudgeSettings":
        j = cfg.models[name]
        yes_token = no_token = None
        if j.load is not None:  # the judge's tokenizer is at hand: its first tokens exactly
            yes_token, no_token = first_tokens(j.load, bool(j.trust_remote_code), j.yes_word, j.no_word)
        return cls(name=name, endpoint=str(j.endpoint).rstrip("/"), served_model=j.served_model,
                   api_key_env=j.api_key_env, chat=bool(j.apply_chat_template), want_probs=j.parser == "yes_prob",
                   temperature=float(j.temperature), max_verdict_tokens=int(j.max_verdict_tokens), seed=int(j.seed),
                   yes_word=j.yes_word, no_word=j.no_word, yes_token=yes_token, no_token=no_token,
                   top_logprobs=int(j.top_logprobs), max_concurrency=int(j.max_concurrency),
                   request_timeout_s=float(j.request_timeout_s), retry_backoff_s=float(j.retry_backoff_s),
                   retry_backoff_max_s=float(j.retry_backoff_max_s), down_timeout_s=float(j.down_timeout_s))


def first_tokens(load: str, trust_remote_code: bool, *words: str) -> list[str]:
    """The first token of each word in the tokenizer of ``load``, as the text it decodes to."""
    from transformers import AutoTokenizer  # deferred: heavy, and only with a local copy of the judge's folder

    tok = AutoTokenizer.from_pretrained(load, trust_remote_code=trust_remote_code)
    return [tok.decode([tok(w, add_special_tokens=False)["input_ids"][0]]) for w in words]


def token_text(token: str) -> str:
    """A token as a server spells it, as text (byte-level BPE's Ġ and SentencePiece's ▁ are spaces)."""
    return token.replace("\u0120", " ").replace("\u2581", " ")


def release(pool: ThreadPoolExecutor, client: httpx.Client) -> None:
    """A client's threads and connections closed."""
    pool.shutdown(wait=False, cancel_futures=True)  # (may run on one of its threads: it cannot wait for itself)
    client.close()


class EndpointDown(UserError):
    """The endpoint failed every request for longer than ``down_timeout_s``."""


class ServedJudge:
    """The HTTP client of one served judge; :meth:`judge` has a local judge's contract
    (:meth:`chatlearn.models.base.JudgingModel.judge`)."""

    def __init__(self, settings: ServedJudgeSettings, clock=time.monotonic, sleep=time.sleep):
        self.s = settings
        self.clock, self.sleep = clock, sleep
        key = os.environ.get(settings.api_key_env) if settings.api_key_env else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        n = settings.max_concurrency
        self.client = httpx.Client(headers=headers, timeout=settings.request_timeout_s,
                                   limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))
        self.pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix=f"judge-{settings.name}")
        self._lock = threading.Lock()
        self.down_since: float | None = None  # the first failure with no success after it
        self.last_error = ""
        self.stop = threading.Event()
        self.model = settings.served_model
        self.requests = 0  # sent, retries included
        self.retries = 0
        # its threads and connections go when it does (or at close())
        self._finalizer = weakref.finalize(self, release, self.pool, self.client)

    def close(self) -> None:
        self.stop.set()
        self._finalizer()

    # ------------------------------------------------------------------ requests
    def request(self, method: str, path: str, body: dict | None = None, missing_ok: bool = False) -> dict | None:
        """The JSON answer of one request, retried with backoff while the endpoint may come back (see the module
        docstring); ``missing_ok``: None when the server has no such path (HTTP 404)."""
        url, attempt = f"{self.s.endpoint}{path}", 0
        while True:
            with self._lock:
                self.requests += 1
            try:
                r = self.client.request(method, url, json=body)
            except httpx.TransportError as err:  # no connection, a timeout, a dropped connection
                failure = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
            else:
                if r.status_code < 300:
                    with self._lock:
                        self.down_since = None
                    return r.json()
                if missing_ok and r.status_code == 404:
                    return None
                if r.status_code not in RETRY_STATUS and r.status_code < 500:
                    raise self.refused(path, r)
                failure = f"HTTP {r.status_code}: {r.text[:300]}"
            self.wait_to_retry(failure, attempt)
            attempt += 1

    def wait_to_retry(self, failure: str, attempt: int) -> None:
        """Sleep before retry ``attempt + 1`` (``retry_backoff_s`` x 2^attempt, at most ``retry_backoff_max_s``), or
        raise :class:`EndpointDown` once the endpoint has failed for ``down_timeout_s``."""
        now = self.clock()
        with self._lock:
            first = self.down_since is None
            self.down_since = now if first else self.down_since
            self.last_error, down_for = failure, now - self.down_since
            self.retries += 1
        if first:
            warn(f"the served judge {self.s.name!r}: a request to {self.s.endpoint} failed ({failure}); retrying for "
                 f"up to {self.s.down_timeout_s:g} s (models.{self.s.name}.down_timeout_s)")
        left = self.s.down_timeout_s - down_for
        if left <= 0 or self.stop.is_set():
            self.stop.set()  # the other requests in flight give up too
            raise self.down(down_for)
        self.sleep(min(self.s.retry_backoff_s * 2 ** min(attempt, 30), self.s.retry_backoff_max_s, left))

    def down(self, down_for: float) -> EndpointDown:
        s = self.s
        return EndpointDown(
            f"the served judge {s.name!r} cannot reach its endpoint {s.endpoint}: every request has failed for "
            f"{down_for:.0f} s (down_timeout_s {s.down_timeout_s:g}), the last with {self.last_error}. The run stops "
            "here; the last checkpoint is kept. Start the judge's server (or fix the address), then run again "
            "with runtime_args.enable_resume_training=true to continue from the checkpoint; or raise "
            f"models.{s.name}.down_timeout_s to wait longer for it.", key=f"models.{s.name}.endpoint")

    def refused(self, path: str, r: httpx.Response) -> UserError:
        s = self.s
        return UserError(f"the served judge {s.name!r}: its endpoint refused a request ({s.endpoint}{path}, model "
                         f"{self.model!r}) with HTTP {r.status_code}: {r.text[:500]}. Check models.{s.name}.endpoint "
                         "and served_model against the server, and that the rendered prompt fits the server's "
                         "context (max_prompt_tokens_length).", key=f"models.{s.name}.endpoint")

    def resolve_model(self) -> str:
        """``served_model``, or the only model the server lists (``GET /models``)."""
        if self.model is not None and self.model != "":
            return self.model
        self.probe()
        return self.model

    def probe(self) -> None:
        """Before the first episode: the endpoint answers (``GET /models``, retried as any request, so a server
        still starting has ``down_timeout_s``) and serves ``served_model``; with none set, the one model it lists
        becomes the judge's. A server without the list (HTTP 404) is asked at the first verdict instead."""
        answer = self.request("GET", "/models", missing_ok=True)
        if answer is None:
            if not self.model:
                raise UserError(f"is not set, and the server at {self.s.endpoint} does not list its models (GET "
                                "/models: HTTP 404): name the judge's model.", key=f"models.{self.s.name}.served_model")
            return
        listed = [str(m["id"]) for m in answer["data"]]
        if self.model:
            if self.model not in listed:
                raise UserError(f"is {self.model!r}, which the server at {self.s.endpoint} does not serve (it lists "
                                f"{', '.join(listed) or 'none'}). Set it to the judge's model as the server names it.",
                                key=f"models.{self.s.name}.served_model")
            return
        if len(listed) != 1:
            raise UserError(f"is not set, and the server at {self.s.endpoint} serves {len(listed)} models "
                            f"({', '.join(listed) or 'none'}): name the judge's.", key=f"models.{self.s.name}.served_model")
        self.model = listed[0]

    # ------------------------------------------------------------------ verdicts
    def body(self, messages: list[dict], probs: bool) -> tuple[str, dict]:
        s = self.s
        body = {"model": self.model, "temperature": s.temperature, "seed": s.seed,
                "max_tokens": 1 if probs else s.max_verdict_tokens}
        if s.chat:
            body["messages"] = messages
            if probs:
                body.update(logprobs=True, top_logprobs=s.top_logprobs)
            return "/chat/completions", body
        body["prompt"] = "\n".join(m["content"] for m in messages)
        if probs:
            body["logprobs"] = s.top_logprobs
        return "/completions", body

    def one(self, messages: list[dict], probs: bool) -> tuple[str, float, int]:
        """(the verdict's text, P(yes) or NaN, generated tokens) of one rendered prompt."""
        path, body = self.body(messages, probs)
        out = self.request("POST", path, body)
        choice = out["choices"][0]
        text = (choice["message"]["content"] or "") if self.s.chat else choice["text"]
        usage = out.get("usage") or {}
        tokens = int(usage.get("completion_tokens") or 0)
        return ("" if probs else text), (self.yes_prob(choice) if probs else math.nan), tokens

    def top_of(self, choice: dict) -> dict[str, float]:
        """The first reply token's most likely tokens and their log-probs; a UserError when the server gave none."""
        lp = choice.get("logprobs")
        try:
            if self.s.chat:
                return {e["token"]: float(e["logprob"]) for e in lp["content"][0]["top_logprobs"]}
            return {t: float(v) for t, v in lp["top_logprobs"][0].items()}
        except (TypeError, KeyError, IndexError):
            raise UserError(f"the served judge {self.s.name!r}: its parser yes_prob reads the log-probs of the reply's "
                            f"first token, but the server at {self.s.endpoint} returned none ({str(lp)[:200]}). Serve "
                            "the judge with log-probs allowed (vLLM: --max-logprobs at least top_logprobs), or use "
                            "a parser that reads the reply's text (yes_no).", key=f"models.{self.s.name}.parser") from None

    def yes_prob(self, choice: dict) -> float:
        """``P(yes) / (P(yes) + P(no))`` from the top log-probs; 1 or 0 when only one of them is among them, NaN
        (unparsed) when neither is."""
        top = {token_text(t): v for t, v in self.top_of(choice).items()}
        y, n = self.find(top, self.s.yes_token, self.s.yes_word), self.find(top, self.s.no_token, self.s.no_word)
        if y is None and n is None:
            return math.nan
        if y is None or n is None:
            return 1.0 if n is None else 0.0
        return 1.0 / (1.0 + math.exp(n - y))

    @staticmethod
    def find(top: dict[str, float], token: str | None, word: str) -> float | None:
        """The log-prob of ``token`` (the word's first token) among ``top``; without it, of the longest listed
        token that begins ``word``."""
        if token is not None:
            return top.get(token)
        found = [t for t in top if t and word.startswith(t)]
        return top[max(found, key=len)] if found else None

    def judge(self, prompts: list[list[dict]], probs: bool | None = None) -> dict:
        """``{"texts", "yes_probs", "generated_tokens"}`` of each prompt, as a local judge gives them (``probs``:
        None, the judge's setting; True, both)."""
        want = self.s.want_probs if probs is None else probs
        n = len(prompts)
        out = {"texts": [""] * n, "yes_probs": np.full(n, np.nan, np.float32), "generated_tokens": 0}
        if not n:
            return out
        self.stop.clear()
        self.resolve_model()
        kinds = ([True] if want else []) + ([False] if not want or probs else [])
        for kind in kinds:
            found = list(self.pool.map(lambda m, k=kind: self.one(m, k), prompts))
            if kind:
                out["yes_probs"] = np.asarray([p for _, p, _ in found], np.float32)
            else:
                out["texts"] = [t for t, _, _ in found]
                out["generated_tokens"] += sum(k for _, _, k in found)
        return out
