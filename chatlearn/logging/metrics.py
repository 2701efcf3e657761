"""Metric sinks: ``<output_dir>/metrics.jsonl`` always (one JSON object per line, with its episode).

Crash safety (see :mod:`chatlearn.logging.jsonl`): a row torn by a crash is dropped before the
first new row is appended, every row is flushed and fsynced, and on resume the rows past the
checkpoint's episode are dropped by an atomic rewrite.
"""
from __future__ import annotations

import json
import math
import os

from chatlearn.logging import jsonl


class MetricsWriter:
    def __init__(self, output_dir: str):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file = jsonl.open_append(self.path)

    def write(self, episode: int, metrics: dict) -> None:
        row = {"episode": episode}
        for k, v in sorted(metrics.items()):
            v = float(v)
            row[k] = v if math.isfinite(v) else None
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def truncate_after(self, episode: int) -> None:
        """Drop rows past ``episode`` (written by a run that crashed after its last checkpoint)."""
        self._file.close()
        jsonl.truncate_after(self.path, episode)
        self._file = jsonl.open_append(self.path)

    def close(self) -> None:
        self._file.close()


def summary_line(episode: int, total: int, m: dict) -> str:
    """One line per episode: the numbers a user watches."""
    parts = [f"episode {episode:>{len(str(total))}}/{total}"]
    if "train/reward_mean" in m:
        parts.append(f"reward {m['train/reward_mean']:.3f}")
    if "eval/reward_mean" in m:
        parts.append(f"eval {m['eval/reward_mean']:.3f}")
    for key, label, fmt in (("train/kl", "kl", ".4f"), ("train/loss", "loss", "+.4f"),
                            ("train/response_len_mean", "len", ".1f")):
        if key in m:
            parts.append(f"{label} {m[key]:{fmt}}")
    if "time/episode" in m:
        detail = " ".join(f"{k} {m['time/' + k]:.1f}" for k in ("generate", "train", "weight_push")
                          if "time/" + k in m)
        parts.append(f"{m['time/episode']:.1f}s ({detail})")
    return " | ".join(parts)
