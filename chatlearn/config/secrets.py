"""What no copy of the config a run writes or prints may show: its secrets.

Every copy (``config.yaml``, a checkpoint's ``config.yaml``, ``configs/``, the resume diff, the
``--dry-run`` output, TensorBoard's text and W&B's config, the command line ``run.lock`` records)
goes through :func:`redact`, which applies three rules:

* by key: the value of a key named as a secret (:func:`is_secret`: ``api_key``, ``hf_token``,
  ``password``, an ``Authorization`` or ``Cookie`` header...) is ``***``;
* from the environment: a key whose value held ``${oc.env:VAR}`` (the config file's or the
  command line's) is written as that text, unresolved, whatever its name;
* by value (:func:`redact_text`): in any string, every value the config read from the environment
  (of at least :data:`MIN_ENV_VALUE` characters; also where another key's interpolation copied it),
  a URL's password (``https://user:***@host``) and an HTTP credential (``Bearer ***``, ``Basic ***``).

The environment's part is recorded when the config is loaded, before its interpolations are
resolved (:func:`remember_env_sources`, called by ``chatlearn.config.load``), and kept for that
config object. The code that uses a value (a reward function's kwargs) still receives it whole.
"""
from __future__ import annotations

import os
import re
import weakref
from dataclasses import dataclass, field

REDACTED = "***"
# A value read from the environment is replaced wherever it appears once it has this many characters:
# shorter ones ("1", "true", "bf16") are no credentials and would mask unrelated text.
MIN_ENV_VALUE = 4
# A key is secret when its last word is "key", "token" or "auth" (api_key, hf_token, accessToken,
# basic_auth), or when its name contains one of the words below anywhere. Looking at the last word
# only keeps settings such as max_prompt_tokens_length, max_token_in_packing or tokenizer_model visible.
SECRET_LAST_WORDS = {"key", "token", "auth"}
SECRET_PARTS = ("secret", "password", "passwd", "apikey", "credential", "authorization", "cookie")
ENV_REFERENCE = re.compile(r"\$\{oc\.env:\s*([^,}\s]+)")
# scheme://user:password@host: the password goes, the user and host stay
URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*):[^@/\s]+@")
HTTP_CREDENTIAL = re.compile(r"\b(Bearer|Basic)\s+[A-Za-z0-9._~+/=-]+", re.IGNORECASE)


@dataclass(frozen=True)
class EnvSources:
    """What a loaded config took from the environment: ``raw``, each dotted key whose value held
    ``${oc.env:...}`` with that text; ``values``, the environment's values those interpolations read."""

    raw: dict = field(default_factory=dict)
    values: tuple = ()


_SOURCES: dict[int, EnvSources] = {}


def env_references(raw: dict) -> EnvSources:
    """The :class:`EnvSources` of ``raw`` (dotted key -> its unresolved text), with the values the
    environment holds now for the variables it names."""
    values = set()
    for text in raw.values():
        for var in ENV_REFERENCE.findall(text):
            value = os.environ.get(var)
            if value and len(value) >= MIN_ENV_VALUE:
                values.add(value)
    return EnvSources({k: v for k, v in raw.items() if ENV_REFERENCE.search(v)},
                      tuple(sorted(values, key=len, reverse=True)))


def remember_env_sources(cfg, raw: dict) -> None:
    """Record, for the config object ``cfg`` (before its interpolations are resolved), the keys of
    ``raw`` (dotted key -> unresolved text) that read the environment; :func:`env_sources` returns it."""
    _SOURCES[id(cfg)] = env_references(raw)
    weakref.finalize(cfg, _SOURCES.pop, id(cfg), None)


def env_sources(cfg) -> EnvSources | None:
    """What :func:`remember_env_sources` recorded for ``cfg`` (None: a config not loaded from a file)."""
    return _SOURCES.get(id(cfg))


def is_secret(name: str) -> bool:
    lowered = name.lower()
    if any(part in lowered for part in SECRET_PARTS):
        return True
    words = [w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()) if w]
    return bool(words) and words[-1] in SECRET_LAST_WORDS


def redact_text(text: str, sources: EnvSources | None = None) -> str:
    """``text`` without the environment's values of ``sources``, URL passwords and HTTP credentials."""
    for value in sources.values if sources is not None else ():
        text = text.replace(value, REDACTED)
    text = URL_PASSWORD.sub(r"\1:" + REDACTED + "@", text)
    return HTTP_CREDENTIAL.sub(r"\1 " + REDACTED, text)


def redact(value, sources: EnvSources | None = None, path: str = ""):
    """A copy of a nested dict/list (the config as plain containers, ``path`` its dotted key) by the
    rules of the module docstring: ``sources`` is what the config took from the environment."""
    if sources is not None and path in sources.raw:
        return redact_text(sources.raw[path], sources)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            key = f"{path}.{k}" if path else str(k)
            secret = is_secret(str(k)) and v is not None and not (sources is not None and key in sources.raw)
            out[k] = REDACTED if secret else redact(v, sources, key)
        return out
    if isinstance(value, (list, tuple)):
        return [redact(v, sources, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, str):
        return redact_text(value, sources)
    return value


def redact_argument(arg: str) -> str:
    """A command-line argument as a record may show it: ``key=***`` for a secret key's override."""
    key, sep, _ = arg.partition("=")
    last = re.sub(r"\[[^\]]*\]", "", key).rsplit(".", 1)[-1]
    if sep and last and " " not in key and is_secret(last):
        return f"{key}={REDACTED}"
    return redact_text(arg)
