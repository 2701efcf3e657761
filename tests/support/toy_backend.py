"""A backend of nothing but plain methods: what the calls of a run without Ray do to values, errors,
processes (tests/runtime/cluster/test_local_actors.py)."""
from __future__ import annotations

import os
import time

from chatlearn.errors import UserError


class Toy:
    def __init__(self, spec):
        self.spec = spec
        self.kept: dict | None = None

    def echo(self, value):
        return value

    def keep(self, batch: dict) -> dict:
        """Adds a key to the dict it got and keeps it: the caller's dict must not change."""
        batch["added"] = 1
        self.kept = batch
        return batch

    def kept_keys(self) -> list[str]:
        return sorted(self.kept)

    def write(self, array) -> None:
        array[0] = 99  # a handed-over array is read-only, as Ray's object store hands it out

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def fail(self, message: str):
        raise UserError(message)

    def exit(self, code: int):
        os._exit(code)

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def pid(self) -> int:
        return os.getpid()
