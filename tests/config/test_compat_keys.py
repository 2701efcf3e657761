"""Keys accepted for ChatLearn compatibility only: the warning, and a grep that keeps
``COMPAT_ONLY_KEYS`` true (no key in it is read, every other key is read somewhere)."""
from __future__ import annotations

import dataclasses
import os
import re

import pytest
from omegaconf import OmegaConf

from chatlearn.cli import main
from chatlearn.config.schema import COMPAT_ONLY_KEYS, Config, compat_warning
from conftest import REPO

TEMPLATE = "template/grpo_fsdp.yaml"
PACKAGE = os.path.join(REPO, "chatlearn")
SCHEMA = os.path.join(PACKAGE, "config", "schema.py")


def _leaf_keys(cls, prefix=""):
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from _leaf_keys(type(default), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def _sources() -> str:
    texts = []
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".py") and path != SCHEMA:
                texts.append(open(path, encoding="utf-8").read())
    return "\n".join(texts)


def _read(name: str, code: str) -> bool:
    """Whether ``code`` reads a setting called ``name``: attribute access (not a method call of
    the same name), ``["name"]``, or an ``eval_`` key built as ``pre + "name"``."""
    pattern = rf"(?<!\bsys)\.{name}\b(?!\s*\()|\[\s*[\"']{name}[\"']\s*\]|[\"']{name}[\"']\s*:"
    if re.search(pattern, code):
        return True
    return name.startswith("eval_") and re.search(rf"pre \+ [\"']{name[5:]}[\"']", code) is not None


def test_a_changed_compat_key_is_named_in_one_warning():
    cfg = OmegaConf.structured(Config)
    cfg.runtime_args.output_dir = "/tmp/run"
    assert compat_warning(cfg) is None  # defaults: no warning
    cfg.models.policy_trainer.groupgemm = True
    cfg.runtime_args.param_sync_comm_type = "p2p"
    msg = compat_warning(cfg)
    assert "models.policy_trainer.groupgemm=true" in msg
    assert 'runtime_args.param_sync_comm_type="p2p"' in msg
    assert "no effect" in msg and "models.ref_policy.groupgemm" not in msg


def test_cli_warns_for_compat_keys_only_when_set(paths_overrides, capsys):
    assert main(["run", "--dry-run", TEMPLATE, *paths_overrides]) == 0
    assert "accepted for compatibility" not in capsys.readouterr().err
    assert main(["run", "--dry-run", TEMPLATE, *paths_overrides, "models.policy_trainer.groupgemm=true"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1
    assert "models.policy_trainer.groupgemm=true" in err and "no effect" in err


def test_compat_keys_are_schema_keys_read_nowhere():
    keys = set(_leaf_keys(Config))
    assert set(COMPAT_ONLY_KEYS) <= keys, set(COMPAT_ONLY_KEYS) - keys
    code = _sources()
    # A key name shared by several models is exempt only when it is compat-only for all of them.
    read = sorted(k for k in COMPAT_ONLY_KEYS if _read(k.rsplit(".", 1)[1], code)
                  and all(other in COMPAT_ONLY_KEYS for other in keys
                          if other.rsplit(".", 1)[1] == k.rsplit(".", 1)[1]))
    assert not read, f"read in chatlearn/, remove from COMPAT_ONLY_KEYS: {read}"


def test_every_other_schema_key_is_read_somewhere():
    code = _sources()
    schema = open(SCHEMA, encoding="utf-8").read()
    interpolated = set(re.findall(r"\$\{([\w.]+)\}", schema))
    unread = sorted(k for k in _leaf_keys(Config) if k not in COMPAT_ONLY_KEYS
                    and k not in interpolated and not _read(k.rsplit(".", 1)[1], code))
    assert not unread, f"read nowhere: act on them or add them to COMPAT_ONLY_KEYS: {unread}"


@pytest.mark.parametrize("key", ["models.policy_trainer.groupgemm", "runtime_env.pip"])
def test_compat_keys_are_marked_in_the_docs(key):
    text = open(os.path.join(REPO, "docs", "config.md"), encoding="utf-8").read()
    marked = [line for line in text.splitlines() if f"`{key.rsplit('.', 1)[1]}`" in line]
    assert marked and all("compat" in line for line in marked), marked
