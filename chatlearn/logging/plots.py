"""PNG plots of a run's ``metrics.jsonl``: ``chatlearn plot OUTPUT_DIR`` and the end of every run;
``chatlearn plot RUN RUN ... --out DIR`` overlays several runs (one colour per run, the legend
naming each) for comparison.

Each plot is written when at least one of its metrics was logged; the others are skipped. What
depends on the run's settings (the KL estimator in the KL plot's title, the clip range drawn
around the importance ratio) is read from the run's ``config.yaml``.
matplotlib is used through its object API on the Agg canvas, so no display is needed and the
process-wide backend is left alone.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass

from chatlearn.config.names import Stage
from chatlearn.errors import UserError, disk_error, write_refusal
from chatlearn.logging.console import info

# stage times of an episode, stacked bottom to top in the order the episode runs them
STAGES = tuple(s.value for s in Stage)


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
    Panel("kl", "KL(policy || reference)", "nats per token", ("train/kl",)),
    Panel("entropy", "Policy entropy", "nats per token", ("train/entropy",)),
    Panel("grad_norm", "Gradient norm (before clipping)", "L2 norm", ("train/grad_norm",)),
    Panel("loss", "Loss", "per token", ("train/loss", "train/policy_loss")),
    Panel("ratio", "Importance ratio and the clip range", "ratio", ("train/ratio_mean",)),
    Panel("clip_frac", "Clipped tokens", "fraction of response tokens", ("train/clip_frac", "train/clip_frac_lower")),
    Panel("mismatch", "Rollout engine vs trainer (before the update)", "nats per token",
          ("train/mismatch_kl", "train/is_mismatch_kl", "train/logprob_diff_rollout_vs_trainer_mean")),
    Panel("rollout_correction", "Rollout correction weights (rollout_correction)", "weight / fraction of tokens",
          ("train/is_weight_mean", "train/is_weight_max", "train/is_clip_frac", "train/is_masked_frac")),
    Panel("dynamic_sampling", "Dynamic sampling", "prompts / groups",
          ("train/dynamic_sampling_prompts_drawn", "train/dynamic_sampling_filled_groups")),
    Panel("environment", "Multi-turn rollouts (models.policy.multi_turn)", "per trajectory",
          ("train/env/turns_mean", "eval/env/turns_mean", "train/env/done_frac", "train/env/info/<key>")),
    Panel("critic_loss", "Critic: value loss (PPO)", "squared reward",
          ("train/critic/value_loss", "train/critic/value_error")),
    Panel("critic_fit", "Critic: explained variance of the returns, clipped values", "fraction",
          ("train/critic/explained_variance", "train/critic/value_clip_frac")),
    Panel("reward_model", "Reward model scores (each model of kind reward_model)", "score",
          ("train/reward_model/score_mean", "eval/reward_model/score_mean", "train/reward_model/<model>/score_mean",
           "eval/reward_model/<model>/score_mean")),
    Panel("throughput", "Throughput", "tokens / s", ("perf/generate_tokens_per_s", "perf/train_tokens_per_s")),
    Panel("memory", "Peak memory per model", "MiB", ("memory/<model>_peak_mb",)),
)


@dataclass
class Run:
    label: str  # the legend's name of the run
    rows: list[dict]
    trainer: dict  # models.policy_trainer of the run's config.yaml ({} without one)


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


def run_labels(folders: list[str]) -> list[str]:
    """Legend names: each folder's basename, or, where basenames collide, the shortest trailing
    part of the path that tells them apart."""
    parts = [os.path.normpath(os.path.abspath(f)).split(os.sep) for f in folders]
    labels = []
    for i, p in enumerate(parts):
        for n in range(1, len(p) + 1):
            tail = p[-n:]
            if all(q[-n:] != tail for j, q in enumerate(parts) if j != i):
                break
        labels.append("/".join(tail))
    return labels


def read_trainer_config(output_dir: str) -> dict:
    """``models.policy_trainer`` of the run's ``config.yaml`` (written by every run); {} when the
    file is missing or unreadable (the plots then leave out what depends on it)."""
    import yaml

    try:
        with open(os.path.join(output_dir, "config.yaml"), encoding="utf-8") as f:
            cfg = yaml.safe_load(f)
        trainer = cfg["models"]["policy_trainer"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return {}
    return trainer if isinstance(trainer, dict) else {}


def load_runs(folders: list[str]) -> list[Run]:
    return [Run(label, read_metrics(folder), read_trainer_config(folder))
            for label, folder in zip(run_labels(folders), folders)]


def _same_series(rows: list[dict], a: str, b: str) -> bool:
    """Whether metrics ``a`` and ``b`` hold the same values at every episode (``policy_loss`` is
    ``loss`` when there is neither a KL nor an entropy term: one line, not two)."""
    xa, ya = _series(rows, a)
    xb, yb = _series(rows, b)
    return xa == xb and all(abs(u - v) <= 1e-9 * max(1.0, abs(u)) for u, v in zip(ya, yb))


def _clip_range(trainer: dict) -> tuple[float, float] | None:
    try:
        return 1.0 - float(trainer["neg_clip_ratio"]), 1.0 + float(trainer["pos_clip_ratio"])
    except (KeyError, TypeError, ValueError):
        return None


def _kl_title(runs: list[Run]) -> str:
    """The KL plot's title names the estimator the runs' configs chose (k1, k2, k3, ...)."""
    estimators = list(dict.fromkeys(str(r.trainer["kl_estimator"]) for r in runs if r.trainer.get("kl_estimator")))
    return "KL(policy || reference)" + (f", {' / '.join(estimators)} estimate" if estimators else "")


# the axes' place in an 8 x 4.5 inch figure: room for a title, tick labels of up to 8 characters and
# an axis label
MARGINS = {"left": 0.12, "right": 0.97, "bottom": 0.11, "top": 0.93}


def write_plots(output_dir: str) -> list[str]:
    """Write ``<output_dir>/plots/*.png`` from the run's metrics; returns the files written."""
    return plot_runs([output_dir], os.path.join(output_dir, "plots"))


def plot_runs(folders: list[str], plot_dir: str) -> list[str]:
    """The plots of one run, or of several overlaid (one colour per run, the legend naming each),
    written into ``plot_dir``; returns the files written. A plot is skipped when no run logged
    any of its metrics."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    runs = load_runs(folders)
    several = len(runs) > 1
    os.makedirs(plot_dir, exist_ok=True)
    written = []

    def save(fig, name: str) -> None:
        path = os.path.join(plot_dir, f"{name}.png")
        FigureCanvasAgg(fig)
        save_figure(fig, path)
        written.append(path)

    def axes(title: str, ylabel: str):
        # fixed margins: a constrained layout measures every text once more and took 40% of the drawing
        fig = Figure(figsize=(8, 4.5))
        fig.subplots_adjust(**MARGINS)
        ax = fig.add_subplot()
        ax.set(title=title, xlabel="episode", ylabel=ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        return fig, ax

    colours = [f"C{i % 10}" for i in range(len(runs))]
    styles = ("-", "--", ":", "-.")
    for panel in PANELS:
        drawn = []  # (run index, key)
        for i, run in enumerate(runs):
            keys = {k for r in run.rows for k in r if k != "episode"}
            series = [k for pattern in panel.keys for k in _expand(pattern, keys)]
            per_source = _expand("eval/<data_source>/reward_mean", keys)
            if len(per_source) == 1:  # one data source: its curve is eval/reward_mean
                series = [k for k in series if k not in per_source]
            if "train/loss" in series and "train/policy_loss" in series and _same_series(
                    run.rows, "train/loss", "train/policy_loss"):
                series.remove("train/policy_loss")
            drawn += [(i, k) for k in dict.fromkeys(series) if _series(run.rows, k)[0]]
        if not drawn:
            continue
        title = _kl_title(runs) if panel.name == "kl" else panel.title
        fig, ax = axes(title, panel.ylabel)
        for i, key in drawn:
            xs, ys = _series(runs[i].rows, key)
            style = {}
            if several:
                nth = [k for j, k in drawn if j == i].index(key)
                style = {"color": colours[i], "linestyle": styles[nth % len(styles)]}
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3,
                    label=f"{runs[i].label}: {key}" if several else key, **style)
        if panel.name == "ratio":
            ranges = {}
            for i in dict.fromkeys(i for i, _ in drawn):
                bounds = _clip_range(runs[i].trainer)
                if bounds is not None:
                    ranges.setdefault(bounds, []).append(i)
            for n, (bounds, owners) in enumerate(ranges.items()):
                colour = colours[owners[0]] if several and len(ranges) > 1 else "0.35"
                name = f"clip range [{bounds[0]:g}, {bounds[1]:g}]"
                if several and len(ranges) > 1:
                    name += " (" + ", ".join(runs[i].label for i in owners) + ")"
                for b, y in enumerate(bounds):
                    ax.axhline(y, color=colour, linestyle="--", linewidth=1, label=name if b == 0 else None)
        ax.legend(fontsize="small")
        save(fig, panel.name)

    _stage_times(runs, axes, save, colours)
    return written


def _stage_times(runs: list[Run], axes, save, colours) -> None:
    """Seconds per episode by stage. One run: the stages stacked per episode; evaluation, which
    runs only some episodes and can dwarf the rest, on its own right-hand scale as markers. Several
    runs: each run's episode time (the stages summed, evaluation left out) as a line."""
    stages = [s for s in STAGES if s != Stage.EVAL and any(_series(r.rows, f"time/{s}")[0] for r in runs)]
    evals = [r for r in runs if _series(r.rows, "time/eval")[0]]
    if not stages and (len(runs) > 1 or not evals):
        return
    if len(runs) == 1:
        rows = runs[0].rows
        fig, ax = axes("Time per stage (stacked; evaluation on the right-hand scale)", "seconds")
        episodes = [r["episode"] for r in rows]
        bottom = [0.0] * len(rows)
        for stage in stages:
            heights = [float(r.get(f"time/{stage}") or 0.0) for r in rows]
            ax.bar(episodes, heights, bottom=bottom, width=0.8, label=stage)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.grid(alpha=0.3, axis="y")
        handles, labels = ax.get_legend_handles_labels()
        if evals:
            right = ax.twinx()
            xs, ys = _series(rows, "time/eval")
            right.plot(xs, ys, linestyle="none", marker="D", color="black", markersize=4)
            right.set_ylabel("eval seconds")
            right.set_ylim(bottom=0)
            fig.subplots_adjust(right=MARGINS["right"] - 0.05)  # room for the right-hand scale
            handles += right.lines
            labels += ["eval (right-hand scale)"]
        ax.legend(handles, labels, fontsize="small", ncols=min(len(labels), 4))
    else:
        fig, ax = axes("Time per episode (stages summed, evaluation left out)", "seconds")
        for i, run in enumerate(runs):
            xs = [r["episode"] for r in run.rows if any(f"time/{s}" in r for s in stages)]
            ys = [sum(float(r.get(f"time/{s}") or 0.0) for s in stages) for r in run.rows
                  if any(f"time/{s}" in r for s in stages)]
            ax.plot(xs, ys, color=colours[i], marker="o" if len(xs) < 30 else None, markersize=3,
                    label=run.label)
        ax.legend(fontsize="small")
    save(fig, "time_per_stage")


def save_figure(fig, path: str) -> None:
    """``fig`` as a PNG at ``path``, whole or not at all (a temporary file renamed over it); a write the
    disk refused is one paragraph naming the file."""
    folder = os.path.join(os.path.dirname(path), f".tmp-{os.getpid()}")  # the same name, in a folder beside it
    tmp = os.path.join(folder, os.path.basename(path))
    try:
        os.makedirs(folder, exist_ok=True)
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
        os.rmdir(folder)
    except BaseException as err:
        shutil.rmtree(folder, ignore_errors=True)
        refused = disk_error(err)
        if refused is not None:
            raise write_refusal(f"the plot {path}", refused,
                                then="then draw the plots again with `chatlearn plot OUTPUT_DIR`") from err
        raise


def plot_after_run(output_dir: str) -> None:
    """The plots of a finished run, reported on one line; a plotting problem does not fail the run."""
    try:
        files = write_plots(output_dir)
    except Exception as err:  # noqa: BLE001 (the training itself has succeeded)
        info(f"plots not written: {' '.join(str(err).split())} (retry with `chatlearn plot {output_dir}`)")
        return
    info(f"plots: {len(files)} PNG files in {os.path.join(output_dir, 'plots')}")
