"""The judges' keys (models of kind judge, ``models.<name>: {kind: judge, ...}``): every problem is a ConfigError
naming the key, raised before anything starts. :func:`check_judge_keys` reads the config alone (the template's
fields, the parser, the numbers); :func:`check_judge_folder` reads the judge's folder once its ``load`` is a local
folder (its context against the longest prompt it may be given)."""
from __future__ import annotations

import dataclasses
import os
from urllib.parse import urlsplit

import jinja2
from jinja2 import meta

from chatlearn.config.checks import choice, positive
from chatlearn.config.kinds import JUDGE, models_of
from chatlearn.config.model_shapes import model_context_length
from chatlearn.config.registry import ROLLOUT_BACKENDS
from chatlearn.config.reward_entries import load_object
from chatlearn.config.schema import Judge
from chatlearn.errors import ConfigError

BUILTIN_PARSERS = ("last_number", "boxed", "yes_no", "yes_prob")
FIELDS = ("question", "response", "reference")
NORMALIZATIONS = ("none", "batch")


def environment(**kwargs) -> jinja2.Environment:
    """The Jinja environment judge templates are rendered in: the text as written, a trailing newline kept."""
    return jinja2.Environment(keep_trailing_newline=True, **kwargs)
DTYPES = ("auto", "float32", "bfloat16", "float16")


def template_fields(source: str, key: str) -> set[str]:
    """The variables the Jinja template ``source`` reads; a ConfigError at ``key`` when it does not parse."""
    try:
        return set(meta.find_undeclared_variables(environment().parse(source)))
    except jinja2.TemplateSyntaxError as err:
        raise ConfigError(f"is not a valid Jinja template: {err.message} (line {err.lineno}). Fix it; the fields "
                          f"are {', '.join(FIELDS)}, e.g. 'Question: {{{{ question }}}} Answer: {{{{ response }}}}'.",
                          key=key) from None


def check_judge_keys(cfg) -> None:
    """Each judge's keys, without reading its folder."""
    rt = cfg.runtime_args
    functions = {str(f.name) for f in cfg.models.reward.functions} or {"math"}
    names = models_of(cfg, JUDGE)
    for name in names:
        j, key = cfg.models[name], f"models.{name}"
        choice(j.backend, ROLLOUT_BACKENDS.names, f"{key}.backend")
        choice(j.normalize, NORMALIZATIONS, f"{key}.normalize")
        choice(j.dtype, DTYPES, f"{key}.dtype")
        for k in ("max_prompt_tokens_length", "generation_batch_size", "num_gpu"):
            positive(j[k], f"{key}.{k}")
        if j.gpu_per_process not in (None, 1):
            raise ConfigError("must be 1: each Ray actor of the judge drives one device.", key=f"{key}.gpu_per_process")
        if j.max_unparsed_episodes < 0:
            raise ConfigError(f"must be >= 0 (0: never stop), got {j.max_unparsed_episodes}.",
                              key=f"{key}.max_unparsed_episodes")
        if j.temperature < 0:
            raise ConfigError(f"must be >= 0 (0: greedy), got {j.temperature}.", key=f"{key}.temperature")
        if j.parser != "yes_prob":
            positive(j.max_verdict_tokens, f"{key}.max_verdict_tokens")
        if len(j.score_range) != 2 or not j.score_range[0] < j.score_range[1]:
            raise ConfigError(f"must be two numbers [low, high] with low < high, got {list(j.score_range)}.",
                              key=f"{key}.score_range")
        if name in functions:
            raise ConfigError(f"is also the name of a reward function (models.reward.functions): their metrics "
                              f"(train/reward/{name}/*) would clash. Rename the judge or the function.", key=key)
        check_parser(j.parser, f"{key}.parser")
        if j.endpoint is not None:
            check_served(cfg, name)
        elif j.load is None:
            raise ConfigError("required key has no value: a judge is a causal LM folder or Hub model id of the run's "
                              f"({key}.load=...), or a served judge ({key}.endpoint=http://host:port/v1).",
                              key=f"{key}.load")
        used = template_fields(j.prompt_template, f"{key}.prompt_template")
        unknown = sorted(used - set(FIELDS))
        if unknown:
            raise ConfigError(f"names {', '.join(unknown)}, which the data does not give a judge: the fields are "
                              f"{', '.join(FIELDS)} (the prompt's last user message, the response, the row's ground "
                              "truth). Use those names.", key=f"{key}.prompt_template")
        if "reference" in used and rt.ground_truth_key is None:
            raise ConfigError("names the field reference, but the data has none: runtime_args.ground_truth_key is "
                              "null. Set ground_truth_key to the rows' reference answer (a dotted path, e.g. "
                              "reward_model.ground_truth), or take reference out of the template.",
                              key=f"{key}.prompt_template")
    if names and (rt.dynamic_sampling or rt.max_staleness > 0):
        key = "runtime_args.dynamic_sampling" if rt.dynamic_sampling else "runtime_args.max_staleness"
        raise ConfigError(f"cannot be combined with a judge ({', '.join(names)}) in this build: a judge gives its "
                          "verdicts as a stage of the episode, not on the rollout thread or between sampling rounds. "
                          "Turn it off, or score with reward functions only.", key=key)


def endpoint_problem(url: str) -> str | None:
    """What is wrong with ``url`` as an endpoint's base URL (http or https, a host, a port in range, no query,
    no space), or None."""
    text = str(url).strip()
    try:
        parts = urlsplit(text)
        if parts.port is not None and parts.port == 0:
            return "its port is 0"
    except ValueError as err:  # a port out of range or not a number
        return str(err)
    if parts.scheme not in ("http", "https"):
        return f"its scheme is {parts.scheme or 'missing'!r}, not http or https"
    if not parts.hostname:
        return "it names no host"
    if parts.query or parts.fragment:
        return "it has a query or a fragment"
    if any(c.isspace() for c in text):
        return "it holds a space"
    return None


def check_endpoint(url: str, key: str) -> None:
    """``url`` is an endpoint's base URL (:func:`endpoint_problem`): a ConfigError at ``key`` otherwise."""
    why = endpoint_problem(url)
    if why is not None:
        raise ConfigError(f"{url!r} is not an endpoint URL: {why}. Give the OpenAI-compatible API's base URL, e.g. "
                          "http://127.0.0.1:8000/v1 (the server's address and port, then the API's path).", key=key)


def check_served(cfg, name: str) -> None:
    """A served judge's keys (``endpoint`` set): the URL, the client's numbers, its API key's variable, and that
    no colocation names it (it has no devices)."""
    j, key = cfg.models[name], f"models.{name}"
    check_endpoint(j.endpoint, f"{key}.endpoint")
    for k in ("max_concurrency", "top_logprobs"):
        positive(j[k], f"{key}.{k}")
    for k in ("request_timeout_s", "retry_backoff_s", "retry_backoff_max_s", "down_timeout_s"):
        if not j[k] > 0:
            raise ConfigError(f"must be > 0 seconds, got {j[k]}.", key=f"{key}.{k}")
    if j.api_key_env is not None and not os.environ.get(str(j.api_key_env)):
        raise ConfigError(f"names the environment variable {j.api_key_env!r}, which is not set (or empty). Export "
                          f"it with the endpoint's API key before running (export {j.api_key_env}=...), or set "
                          "api_key_env to null for a server without a key.", key=f"{key}.api_key_env")
    if name in list(cfg.runtime_args.colocation):
        raise ConfigError(f"names {name!r}, a served judge ({key}.endpoint): it has no devices and takes no turns. "
                          "Take it out of the list.", key="runtime_args.colocation")


# a served judge's keys that only a judge of the run's own uses (their schema defaults are literal values)
SERVED_INERT_KEYS = ("backend", "gpu_per_process", "dtype", "gpu_memory_utilization", "generation_batch_size")


def served_inert_keys(j) -> list[str]:
    """The keys of ``SERVED_INERT_KEYS`` that a served judge's section ``j`` sets to other than the schema's
    default: they do not apply to an endpoint (the run warns about each)."""
    defaults = {f.name: f.default for f in dataclasses.fields(Judge)}
    return [k for k in SERVED_INERT_KEYS if j[k] != defaults[k]]


def check_parser(parser: str, key: str) -> None:
    """A built-in parser's name, or a ``module:function`` (or ``path/to/file.py:function``) that imports."""
    if parser in BUILTIN_PARSERS:
        return
    if ":" not in str(parser):
        raise ConfigError(f"{parser!r} is no judge parser: one of {', '.join(BUILTIN_PARSERS)}, or your function "
                          "as module:function (it takes the verdict's text and returns a float, or None when it "
                          "cannot read it).", key=key)
    fn = load_object(parser, key=key, base_dir=os.getcwd(), what="judge parser", runs_in="the driver")
    if not callable(fn):
        raise ConfigError(f"{parser!r} is not a function. Point it at a function of the verdict's text.", key=key)


def check_judge_folder(cfg, name: str) -> None:
    """Judge ``name``'s context holds its longest prompt and verdict, and its ``max_prompt_tokens_length`` holds
    the template with the policy's longest prompt and response (counted in the policy's tokens)."""
    j, key = cfg.models[name], f"models.{name}"
    if j.load is None:  # a served judge without a copy of its folder: its server checks the prompts' length
        return
    context = model_context_length(j.load)
    verdict = 1 if j.parser == "yes_prob" else int(j.max_verdict_tokens)
    if context is not None and j.max_prompt_tokens_length + verdict > context:
        raise ConfigError(f"is {j.max_prompt_tokens_length}, but the judge's context ({j.load}: {context} tokens) is "
                          f"shorter than that prompt and its verdict ({verdict} tokens). Lower it to at most "
                          f"{context - verdict}, or use a judge with a longer context.",
                          key=f"{key}.max_prompt_tokens_length")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(j.load, trust_remote_code=bool(j.trust_remote_code))
    text = environment().from_string(j.prompt_template).render(question="", response="", reference="")
    if j.apply_chat_template and tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    own = len(tok(text, add_special_tokens=False)["input_ids"])
    p = cfg.models.policy
    longest = own + int(p.max_prompt_tokens_length) + int(p.max_response_tokens_length)
    if longest > j.max_prompt_tokens_length:
        raise ConfigError(f"is {j.max_prompt_tokens_length}, shorter than the longest prompt the judge may be "
                          f"given: its template ({own} tokens) with the policy's longest prompt and response "
                          f"(models.policy.max_prompt_tokens_length {p.max_prompt_tokens_length} + "
                          f"max_response_tokens_length {p.max_response_tokens_length}) is {longest} tokens. Raise it "
                          f"(the judge's context allows {context if context is not None else 'any length'}), or "
                          "shorten the template or the policy's limits.", key=f"{key}.max_prompt_tokens_length")
