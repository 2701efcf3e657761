"""Metric sinks: ``<output_dir>/metrics.jsonl`` always (one JSON object per line, with its episode
and ``time/wall``, the wall-clock time the row was written, in Unix seconds), the per-episode
console line (:func:`summary_line`) and the end-of-run summary (:func:`run_summary`).

Crash safety (see :mod:`chatlearn.logging.jsonl`): a row torn by a crash is dropped before the
first new row is appended, every row is flushed and fsynced, and on resume the rows past the
checkpoint's episode are dropped by an atomic rewrite.
"""
from __future__ import annotations

import json
import math
import os
import time

from chatlearn.config.names import Stage
from chatlearn.logging import jsonl
from chatlearn.logging.progress import format_seconds


WALL = "time/wall"  # when the row was written: Unix seconds (metrics.jsonl only)


class MetricsWriter:
    def __init__(self, output_dir: str):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._file = jsonl.RowFile(self.path)

    def write(self, episode: int, metrics: dict) -> None:
        """One row, appended whole or not at all (see jsonl.RowFile)."""
        row = {"episode": episode, WALL: round(time.time(), 3)}
        for k, v in sorted(metrics.items()):
            v = float(v)
            row[k] = v if math.isfinite(v) else None
        self._file.write(json.dumps(row) + "\n")

    def truncate_after(self, episode: int) -> None:
        """Drop rows past ``episode`` (written by a run that crashed after its last checkpoint)."""
        self._file.close()
        jsonl.truncate_after(self.path, episode)
        self._file = jsonl.RowFile(self.path)

    def close(self) -> None:
        self._file.close()


class SamplesWriter:
    """``<output_dir>/samples.jsonl``: rows of sampled prompts and responses, each with its episode;
    crash-safe like ``metrics.jsonl`` (a torn row dropped, rows past a resumed checkpoint dropped)."""

    def __init__(self, output_dir: str):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "samples.jsonl")
        self._file = None  # opened on the first rows: a run that logs none leaves no file

    def write(self, episode: int, rows: list[dict]) -> None:
        if self._file is None:
            self._file = jsonl.RowFile(self.path)
        wall = round(time.time(), 3)
        # the episode's rows in one write: all of them or none (see jsonl.RowFile)
        self._file.write("".join(json.dumps({"episode": episode, WALL: wall, **row}) + "\n" for row in rows))

    def truncate_after(self, episode: int) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        jsonl.truncate_after(self.path, episode)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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
        detail = " ".join(f"{k} {m['time/' + k]:.1f}" for k in (Stage.GENERATE, Stage.TRAIN, Stage.WEIGHT_PUSH)
                          if "time/" + k in m)
        parts.append(f"{m['time/episode']:.1f}s ({detail})")
    return " | ".join(parts)


# the stages of an episode, in the order they run (time/<stage> keys), and their names on the console
SUMMARY_STAGES = tuple((s.value, s.label) for s in Stage)


def run_summary(rows: list[dict], wall_seconds: float, since: float, outputs: dict[str, str]) -> list[str]:
    """The lines that end a run.

    ``rows``: the run's metrics rows (``metrics.jsonl``, earlier runs it resumed included); the eval
    results span them all. ``wall_seconds``: how long this process ran; the time split covers the rows
    it wrote (``time/wall`` >= ``since``, a Unix time): per stage, with its share of ``wall_seconds``
    (the reward stage overlaps the log-prob passes), and the rest (start-up: Ray, loading the models;
    plots) as ``start-up and other``. ``outputs``: label -> path, listed in that order.
    """
    mine = [r for r in rows if (r.get(WALL) or 0) >= since]
    trained = [r["episode"] for r in mine if r.get("episode", 0) > 0]
    what = f"episodes {trained[0]}..{trained[-1]}" if len(trained) > 1 else \
        f"episode {trained[0]}" if trained else "no training episode"
    lines = [f"[chatlearn] done: {what} in {format_seconds(wall_seconds)}"]
    evals = [(r["episode"], r["eval/reward_mean"]) for r in rows if r.get("eval/reward_mean") is not None]
    if evals:
        best = max(evals, key=lambda e: e[1])  # the first of equal bests
        first, last = evals[0], evals[-1]
        lines.append(f"[chatlearn] eval reward: first {first[1]:.3f} (episode {first[0]}), last {last[1]:.3f} "
                     f"(episode {last[0]}), best {best[1]:.3f} (episode {best[0]})")
    def share(label: str, seconds: float) -> str:
        return f"{label} {format_seconds(seconds, tenths=True)} ({100 * seconds / max(wall_seconds, 1e-9):.0f}%)"

    parts = []
    for key, label in SUMMARY_STAGES:
        seconds = sum(float(r.get(f"time/{key}") or 0.0) for r in mine)
        if seconds > 0:
            parts.append(share(label, seconds))
    counted = sum(float(r.get("time/episode") or 0.0) + float(r.get("time/eval") or 0.0) for r in mine)
    parts.append(share("start-up and other", max(0.0, wall_seconds - counted)))
    lines.append("[chatlearn] time: " + " | ".join(parts))
    lines.append("[chatlearn] outputs: " + " | ".join(f"{label} {path}" for label, path in outputs.items()))
    return lines
