"""PNG plots of a run's ``metrics.jsonl``: ``chatlearn plot OUTPUT_DIR`` and the end of every run.

Each plot is written when at least one of its metrics was logged; the others are skipped.
matplotlib is used through its object API on the Agg canvas, so no display is needed and the
process-wide backend is left alone.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from chatlearn.errors import UserError

# stage times of an episode, stacked bottom to top in the order the episode runs them
STAGES = ("generate", "reward", "ref_logprobs", "old_logprobs", "train", "checkpoint", "weight_push", "eval")


@dataclass(frozen=True)
class Panel:
    name: str  # file name without .png
    title: str
    ylabel: str
    keys: tuple[str, ...]  # metrics drawn as lines (a pattern may use <data_source>)


PANELS = (
    Panel("reward", "Reward", "mean reward",
          ("train/reward_mean", "eval/reward_mean", "eval/<data_source>/reward_mean")),
    Panel("response_length", "Response length", "tokens", ("train/response_len_mean", "eval/response_len_mean")),
    Panel("kl", "KL(policy || reference), k3 estimate", "nats per token", ("train/kl",)),
    Panel("entropy", "Policy entropy", "nats per token", ("train/entropy",)),
    Panel("grad_norm", "Gradient norm (before clipping)", "L2 norm", ("train/grad_norm",)),
    Panel("loss", "Loss", "per token", ("train/loss", "train/policy_loss")),
    Panel("throughput", "Throughput", "tokens / s", ("perf/generate_tokens_per_s", "perf/train_tokens_per_s")),
    Panel("memory", "Peak memory per model", "MiB", ("memory/<model>_peak_mb",)),
)


def read_metrics(output_dir: str) -> list[dict]:
    """The rows of ``<output_dir>/metrics.jsonl``, one per episode (for an episode logged more than
    once, as after a restart in the same folder, the last row), in episode order."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        where = ("the folder does not exist" if not os.path.exists(output_dir)
                 else "the folder holds no metrics.jsonl")
        raise UserError(f"no metrics to plot in {output_dir!r}: {where}. Pass a run's output folder "
                        "(runtime_args.output_dir), the one that holds metrics.jsonl.")
    rows: dict[int, dict] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read {path}: {err}. Check that it is the metrics.jsonl a run wrote.")
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            episode = int(row["episode"])
        except (ValueError, KeyError, TypeError) as err:
            if lineno == len(lines):  # a last line cut short by an interrupted run
                continue
            raise UserError(f"{path}:{lineno}: not a metrics row ({err}). Each line must be a JSON object with "
                            "an 'episode'; remove or fix that line.")
        rows[episode] = row
    if not rows:
        raise UserError(f"{path} holds no metrics rows yet: the run has not finished an episode. Plot again "
                        "after the first episode line is printed.")
    return [rows[e] for e in sorted(rows)]


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)):
            xs.append(r["episode"])
            ys.append(float(v))
    return xs, ys


def _expand(pattern: str, keys: set[str]) -> list[str]:
    if "<" not in pattern:
        return [pattern] if pattern in keys else []
    regex = re.compile("^" + re.sub(r"<[^>]+>", "[^/]+", re.escape(pattern)) + "$")
    return sorted(k for k in keys if regex.match(k))


def write_plots(output_dir: str) -> list[str]:
    """Write ``<output_dir>/plots/*.png``; returns the files written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rows = read_metrics(output_dir)
    keys = {k for r in rows for k in r if k != "episode"}
    plot_dir = os.path.join(output_dir, "plots")
    os.makedirs(plot_dir, exist_ok=True)
    written = []

    def save(fig, name: str) -> None:
        path = os.path.join(plot_dir, f"{name}.png")
        FigureCanvasAgg(fig)
        fig.savefig(path, dpi=100)
        written.append(path)

    for panel in PANELS:
        series = [k for pattern in panel.keys for k in _expand(pattern, keys)]
        per_source = _expand("eval/<data_source>/reward_mean", keys)
        if len(per_source) == 1:  # one data source: its curve is eval/reward_mean
            series = [k for k in series if k not in per_source]
        series = [k for k in dict.fromkeys(series) if _series(rows, k)[0]]
        if not series:
            continue
        fig = Figure(figsize=(8, 4.5), layout="constrained")
        ax = fig.add_subplot()
        for key in series:
            xs, ys = _series(rows, key)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=key)
        ax.set(title=panel.title, xlabel="episode", ylabel=panel.ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        save(fig, panel.name)

    stages = [s for s in STAGES if _series(rows, f"time/{s}")[0]]
    if stages:
        episodes = [r["episode"] for r in rows]
        fig = Figure(figsize=(8, 4.5), layout="constrained")
        ax = fig.add_subplot()
        bottom = [0.0] * len(rows)
        for stage in stages:
            heights = [float(r.get(f"time/{stage}") or 0.0) for r in rows]
            ax.bar(episodes, heights, bottom=bottom, width=0.8, label=stage)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set(title="Time per stage (stacked)", xlabel="episode", ylabel="seconds")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize="small", ncols=min(len(stages), 4))
        save(fig, "time_per_stage")
    return written


def plot_after_run(output_dir: str) -> None:
    """The plots of a finished run, reported on one line; a plotting problem does not fail the run."""
    try:
        files = write_plots(output_dir)
    except Exception as err:  # noqa: BLE001 (the training itself has succeeded)
        print(f"[chatlearn] plots not written: {' '.join(str(err).split())} (retry with `chatlearn plot "
              f"{output_dir}`)", flush=True)
        return
    print(f"[chatlearn] plots: {len(files)} PNG files in {os.path.join(output_dir, 'plots')}", flush=True)
