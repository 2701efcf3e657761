"""The metric names documented in docs/metrics.md, as patterns (``<name>`` matches one path segment)."""
from __future__ import annotations

import os
import re

from conftest import REPO

PREFIXES = ("train", "eval", "time", "sched", "sync", "perf", "memory", "sft")


def documented_patterns() -> dict[str, re.Pattern]:
    """{documented name: regex}, from the first column of the tables of docs/metrics.md."""
    with open(os.path.join(REPO, "docs", "metrics.md"), encoding="utf-8") as f:
        text = f.read()
    names = re.findall(r"^\| `((?:%s)/[^`]+)` \|" % "|".join(PREFIXES), text, flags=re.M)
    return {n: re.compile("^" + re.sub(r"<[^>]+>", "[^/]+", re.escape(n)) + "$") for n in names}


def undocumented(keys) -> list[str]:
    patterns = documented_patterns().values()
    return sorted(k for k in keys if k != "episode" and not any(p.match(k) for p in patterns))
