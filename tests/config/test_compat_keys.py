"""Keys accepted for ChatLearn compatibility only: the warning, and a grep that keeps
``COMPAT_ONLY_KEYS`` true (no key in it is read, every other key is read somewhere)."""
from __future__ import annotations

import ast
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
    cfg.models.policy_trainer.virtual_pipeline_model_parallel_size = 2
    cfg.runtime_args.param_sync_comm_type = "p2p"
    msg = compat_warning(cfg)
    assert "models.policy_trainer.virtual_pipeline_model_parallel_size=2" in msg
    assert 'runtime_args.param_sync_comm_type="p2p"' in msg
    assert "no effect" in msg and "models.ref_policy.virtual_pipeline_model_parallel_size" not in msg


def test_cli_warns_for_compat_keys_only_when_set(paths_overrides, capsys):
    assert main(["run", "--dry-run", TEMPLATE, *paths_overrides]) == 0
    assert "accepted for compatibility" not in capsys.readouterr().err
    assert main(["run", "--dry-run", TEMPLATE, *paths_overrides,
                 "models.policy_trainer.virtual_pipeline_model_parallel_size=2"]) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1
    assert "models.policy_trainer.virtual_pipeline_model_parallel_size=2" in err and "no effect" in err


def test_compat_keys_are_schema_keys_read_nowhere():
    keys = set(_leaf_keys(Config))
    assert set(COMPAT_ONLY_KEYS) <= keys, set(COMPAT_ONLY_KEYS) - keys
    code = _sources()
    # A key name shared by several models is exempt only when it is compat-only for all of them.
    read = sorted(k for k in COMPAT_ONLY_KEYS if _read(k.rsplit(".", 1)[1], code)
                  and all(other in COMPAT_ONLY_KEYS for other in keys
                          if other.rsplit(".", 1)[1] == k.rsplit(".", 1)[1]))
    assert not read, f"read in chatlearn/, remove from COMPAT_ONLY_KEYS: {read}"


# Config validation (chatlearn/config/, but for the plan, which lays the run out) checks values; a key read
# only there is accepted and then ignored, unless validation leaves it one value the run already uses.
VALIDATION = os.path.join(PACKAGE, "config")
# (kinds.py: what the driver and the reward models' workers read of a reward model, whichever section spells it)
ACTING_IN_CONFIG = {os.path.join(VALIDATION, "plan.py"), os.path.join(VALIDATION, "kinds.py")}
# keys read only in config validation, each with why that is the whole of its effect
VALIDATION_ONLY = {
    "gpu_per_process": "validation refuses any value but null or 1, one device per process, which is what "
                       "the cluster places",
    "fsdp_size": "validation refuses any value but num_gpu or -1: the FSDP trainer shards over all of its ranks",
    "ulysses_sequence_parallel_size": "validation refuses any value but 1: no sequence parallelism over Ulysses",
    "max_new_tokens": "an alias: loading copies it into models.policy.max_response_tokens_length, which the "
                      "rollout reads",
}


def _reads(path: str) -> tuple[set, set]:
    """The setting names the Python file ``path`` reads, from its syntax tree (comments, docstrings and
    other strings do not count): attribute loads that are not method calls (``cfg.lr``), subscripts by a
    constant (``cfg["lr"]``); and the names read as ``prefix + "name"`` (``p[pre + "top_p"]``, the
    ``eval_`` sampling keys), apart."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    names, suffixes = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and id(node) not in called:
            names.add(node.attr)
        elif isinstance(node, ast.Subscript):
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                names.add(key.value)
            elif (isinstance(key, ast.BinOp) and isinstance(key.op, ast.Add) and isinstance(key.right, ast.Constant)
                  and isinstance(key.right.value, str)):
                suffixes.add(key.right.value)
    return names, suffixes


def _package_reads() -> tuple[set, set, set]:
    """(names read by the code that acts on settings, their ``prefix + "name"`` reads, names read in
    config validation)."""
    acting, suffixes, validation = set(), set(), set()
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(root, name)
            if not name.endswith(".py") or path == SCHEMA:
                continue
            names, added = _reads(path)
            if path.startswith(VALIDATION + os.sep) and path not in ACTING_IN_CONFIG:
                validation |= names
            else:
                acting |= names
                suffixes |= added
    return acting, suffixes, validation


def _acted_on(name: str, acting: set, suffixes: set) -> bool:
    return name in acting or (name.startswith("eval_") and name[len("eval_"):] in suffixes)


def test_every_other_schema_key_reaches_the_code_that_acts_on_it():
    """Each schema key's value is read (an attribute or subscript, not a word in a comment or string)
    outside config validation, or is in VALIDATION_ONLY with the reason that suffices."""
    acting, suffixes, validation = _package_reads()
    schema = open(SCHEMA, encoding="utf-8").read()
    interpolated = set(re.findall(r"\$\{([\w.]+)\}", schema))
    ignored = sorted(k for k in _leaf_keys(Config) if k not in COMPAT_ONLY_KEYS and k not in interpolated
                     and k.rsplit(".", 1)[1] not in VALIDATION_ONLY
                     and not _acted_on(k.rsplit(".", 1)[1], acting, suffixes))
    assert not ignored, ("accepted, maybe validated, then read by nothing that acts on them: make them act, "
                         f"refuse other values, or add them to COMPAT_ONLY_KEYS: {ignored}")
    stale = sorted(n for n in VALIDATION_ONLY if _acted_on(n, acting, suffixes) or n not in validation)
    assert not stale, f"VALIDATION_ONLY names that are acted on, or not validated: remove them: {stale}"


def test_the_guard_reads_syntax_not_words(tmp_path):
    """A key's name in a comment, a docstring, a string or a method call is not a read of its value."""
    path = tmp_path / "code.py"
    path.write_text('"""Uses recompute_granularity."""\n'
                    "# cfg.recompute_granularity is validated\n"
                    "x = 'recompute_granularity'\n"
                    "cfg.recompute_granularity()\n"
                    "y = cfg.lr + cfg['seed'] + p[pre + 'top_p']\n")
    names, suffixes = _reads(str(path))
    assert "recompute_granularity" not in names
    assert {"lr", "seed"} <= names and suffixes == {"top_p"}


@pytest.mark.parametrize("key", ["models.policy_trainer.virtual_pipeline_model_parallel_size", "runtime_env.pip"])
def test_compat_keys_are_marked_in_the_docs(key):
    text = open(os.path.join(REPO, "docs", "config.md"), encoding="utf-8").read()
    marked = [line for line in text.splitlines() if f"`{key.rsplit('.', 1)[1]}`" in line]
    assert marked and all("compat" in line for line in marked), marked
