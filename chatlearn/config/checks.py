"""The small checks every part of validation uses; each raises a ConfigError naming the key."""
from __future__ import annotations

import difflib

from chatlearn.errors import ConfigError


def choice(value, choices, key: str) -> None:
    """``value`` is one of ``choices`` (the nearest one suggested otherwise)."""
    if value not in choices:
        guess = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" Did you mean {guess[0]!r}?" if guess else ""
        raise ConfigError(f"{value!r} is not one of {', '.join(choices)}.{hint}", key=key)


def positive(value, key: str) -> None:
    """``value`` is a positive integer."""
    if value is None or value < 1:
        raise ConfigError(f"must be a positive integer, got {value!r}.", key=key)
