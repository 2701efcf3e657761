"""Every key of the schema is documented in docs/config.md."""
import dataclasses
import os

from chatlearn.config.schema import Config
from conftest import REPO


def _keys(cls, prefix=""):
    for f in dataclasses.fields(cls):
        t = f.type if not isinstance(f.type, str) else None
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            yield from _keys(type(default), f"{prefix}{f.name}.")
        else:
            yield f.name, prefix + f.name
        del t


def test_every_schema_key_is_documented():
    text = open(os.path.join(REPO, "docs", "config.md"), encoding="utf-8").read()
    def documented(full):
        parts = full.split(".")
        return any(f"`{'.'.join(parts[i:])}`" in text for i in range(len(parts)))

    missing = [full for _, full in _keys(Config) if not documented(full)]
    assert not missing, missing
