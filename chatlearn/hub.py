"""Hugging Face Hub ids where a model or a dataset is named.

A value that is an existing local path is used as it is. Otherwise a value shaped like a Hub id
(``org/name``, or ``org/name@revision`` for a branch, tag or commit) is resolved with
``huggingface_hub.snapshot_download`` into the standard Hugging Face cache, so ``HF_HOME``,
``HF_HUB_CACHE``, ``HF_HUB_OFFLINE=1``, ``HF_ENDPOINT`` and ``HF_TOKEN`` work as with every
Hugging Face library. An id that cannot be resolved is one :class:`~chatlearn.errors.ConfigError`
naming the key, the id and what to do.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from chatlearn.errors import ConfigError

# files a model snapshot never needs (other frameworks' weights, quantized exports)
MODEL_IGNORE = ["*.gguf", "*.onnx", "*.onnx_data", "*.h5", "*.msgpack", "*.ot", "*.tflite", "*.mlmodel",
                "original/*", "onnx/*", "openvino/*", "coreml/*"]


@dataclass(frozen=True)
class Resolved:
    path: str  # the local folder
    repo_id: str | None = None  # None: the value was a local path
    commit: str | None = None  # the commit the revision resolved to

    @property
    def pinned(self) -> str | None:
        """``org/name@commit``: the id that names exactly this snapshot (None for a local path)."""
        return f"{self.repo_id}@{self.commit}" if self.repo_id else None


def split_revision(value: str) -> tuple[str, str | None]:
    """``org/name@rev`` -> (``org/name``, ``rev``); no ``@``: revision None."""
    repo, sep, rev = value.partition("@")
    return repo, (rev if sep else None)


def looks_like_hub_id(value: str) -> bool:
    """``value`` is not a local path and has the shape of a Hub repository id (``name`` or ``org/name``,
    optionally ``@revision``)."""
    if not value or os.path.exists(value) or value.startswith(("/", ".", "~")) or value.endswith("/"):
        return False
    repo, rev = split_revision(value)
    if rev == "" or repo.count("/") > 1:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo)
    except HFValidationError:
        return False
    return True


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def download_command(repo_id: str, revision: str | None, repo_type: str) -> str:
    return ("hf download " + repo_id + (f" --revision {revision}" if revision else "")
            + (" --repo-type dataset" if repo_type == "dataset" else ""))


def snapshot(value: str, *, key: str, repo_type: str = "model", local_hint: str = "a local folder") -> Resolved:
    """The local snapshot folder of the Hub id ``value`` (downloaded into the Hugging Face cache unless
    it is there already); any failure is a ConfigError naming ``key``."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    repo_id, revision = split_revision(value)
    kind = "dataset" if repo_type == "dataset" else "model"
    where = f"the Hugging Face Hub {kind} {repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    get = download_command(repo_id, revision, repo_type)
    cache = _cache_dir()
    try:
        path = snapshot_download(repo_id, repo_type=repo_type, revision=revision,
                                 ignore_patterns=MODEL_IGNORE if repo_type == "model" else None)
    except RevisionNotFoundError:
        raise ConfigError(f"{value!r}: {where} has no such revision. Check the branch, tag or commit after '@', "
                          f"or leave it out for the default branch.", key=key) from None
    except GatedRepoError:
        raise ConfigError(f"{value!r}: {where} is gated: accept its terms on https://huggingface.co/"
                          f"{'datasets/' if kind == 'dataset' else ''}{repo_id} and log in (hf auth login, or set "
                          f"HF_TOKEN), or point {key} at {local_hint}.", key=key) from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{value!r} is not a local path, and {where} does not exist (or is private). Check the "
                          f"name (and log in with hf auth login for a private one), or point {key} at {local_hint}.",
                          key=key) from None
    except LocalEntryNotFoundError as err:  # not cached, and offline or the Hub cannot be reached
        if "incomplete" in str(err):
            raise ConfigError(f"{value!r}: the cached copy of {where} in {cache} is incomplete (an interrupted "
                              f"download). Complete it with `{get}` (with network access), or point {key} at "
                              f"{local_hint}.", key=key) from None
        if _offline():
            raise ConfigError(f"{value!r} is not a local path, and {where} is not in the Hugging Face cache "
                              f"({cache}) while offline mode is on (HF_HUB_OFFLINE=1). Download it first with "
                              f"`{get}` (it goes into that cache; set HF_HOME to use another), set HF_HUB_OFFLINE=0 "
                              f"to let chatlearn download it, or point {key} at {local_hint}.", key=key) from None
        cause = err.__cause__ or err
        raise ConfigError(f"{value!r} is not a local path, and {where} is not in the Hugging Face cache ({cache}) "
                          f"and the Hub cannot be reached ({type(cause).__name__}: {_brief(cause)}). Check the "
                          f"network (and HF_ENDPOINT), download it where there is network with `{get}` into that "
                          f"cache, or point {key} at {local_hint}.", key=key) from None
    except HfHubHTTPError as err:
        raise ConfigError(f"{value!r}: the Hugging Face Hub refused {where} ({_brief(err)}). Check the name and "
                          f"your token (hf auth login), or point {key} at {local_hint}.", key=key) from None
    commit = os.path.basename(os.path.normpath(path))
    return Resolved(path=path, repo_id=repo_id, commit=commit)


def resolve(value: str, *, key: str, repo_type: str = "model", local_hint: str = "a local folder") -> Resolved:
    """A local path as it is; a Hub id resolved with :func:`snapshot`."""
    if looks_like_hub_id(value):
        return snapshot(value, key=key, repo_type=repo_type, local_hint=local_hint)
    return Resolved(path=value)


def _brief(err: BaseException, limit: int = 200) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " (...)"
