"""``chatlearn plot``: PNG plots from metrics.jsonl; missing metrics skipped, bad input a user error."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from chatlearn.cli import main
from chatlearn.logging.plots import read_metrics, write_plots


def write_metrics(folder, episodes=6, entropy=False):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics.jsonl"), "w", encoding="utf-8") as f:
        f.write(json.dumps({"episode": 0, "eval/reward_mean": 0.2, "eval/a/reward_mean": 0.1,
                            "eval/b/reward_mean": 0.3, "time/eval": 1.0}) + "\n")
        for e in range(1, episodes + 1):
            row = {"episode": e, "train/reward_mean": 0.1 + 0.05 * e, "train/response_len_mean": 10 + e,
                   "train/kl": 0.01 * e, "train/grad_norm": 1.0 / e, "train/loss": None,
                   "time/generate": 1.0, "time/reward": 0.2, "time/ref_logprobs": 0.3, "time/old_logprobs": 0.3,
                   "time/train": 2.0, "time/weight_push": 0.1, "memory/policy_peak_mb": 500.0 + e}
            if entropy:
                row["train/entropy"] = 2.0 - 0.1 * e
            f.write(json.dumps(row) + "\n")
    return folder


def image_stats(path):
    """(bytes, number of distinct colours) of a PNG."""
    from matplotlib.image import imread

    pixels = imread(path)
    colours = np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)
    return os.path.getsize(path), len(colours)


def test_plots_written_and_missing_metrics_skipped(tmp_path):
    out = write_metrics(str(tmp_path))
    files = write_plots(out)
    names = sorted(os.path.basename(f) for f in files)
    # no entropy, loss (all null), or throughput in the metrics: those plots are skipped
    assert names == ["grad_norm.png", "kl.png", "memory.png", "response_length.png", "reward.png",
                     "time_per_stage.png"]
    for f in files:
        size, colours = image_stats(f)
        assert size > 5000 and colours > 10, (f, size, colours)
    assert write_plots(write_metrics(str(tmp_path / "b"), entropy=True))[3].endswith("entropy.png")


def test_mismatch_correction_and_dynamic_sampling_plots(tmp_path):
    folder = str(tmp_path)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics.jsonl"), "w", encoding="utf-8") as f:
        for e in range(1, 5):
            f.write(json.dumps({"episode": e, "train/mismatch_kl": 1e-3 * e, "train/is_mismatch_kl": 2e-3 * e,
                                "train/logprob_diff_rollout_vs_trainer_mean": 0.01 * e,
                                "train/is_weight_mean": 1.0 - 0.01 * e, "train/is_weight_max": 2.0,
                                "train/is_clip_frac": 0.01 * e, "train/dynamic_sampling_prompts_drawn": 32.0 * e,
                                "train/dynamic_sampling_filled_groups": 0.0}) + "\n")
    names = sorted(os.path.basename(f) for f in write_plots(folder))
    assert names == ["dynamic_sampling.png", "mismatch.png", "rollout_correction.png"]


def test_critic_and_reward_model_plots(tmp_path):
    folder = str(tmp_path)
    with open(os.path.join(folder, "metrics.jsonl"), "w", encoding="utf-8") as f:
        for e in range(1, 5):
            f.write(json.dumps({"episode": e, "train/critic/value_loss": 0.1 / e, "train/critic/value_error": 0.2 / e,
                                "train/critic/explained_variance": 0.1 * e, "train/critic/value_clip_frac": 0.01,
                                "train/reward_model/score_mean": -3.0 + e}) + "\n")
    names = sorted(os.path.basename(f) for f in write_plots(folder))
    assert names == ["critic_fit.png", "critic_loss.png", "reward_model.png"]


def test_cli_plot_prints_files(tmp_path, capsys):
    write_metrics(str(tmp_path))
    assert main(["plot", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed and all(p.endswith(".png") and os.path.isfile(p) for p in printed)


def test_last_row_per_episode_and_cut_last_line(tmp_path):
    write_metrics(str(tmp_path), episodes=2)
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"episode": 2, "train/kl": 9.0}) + "\n")  # the same episode again (a restart)
        f.write('{"episode": 3, "train/k')  # interrupted while writing
    rows = read_metrics(str(tmp_path))
    assert [r["episode"] for r in rows] == [0, 1, 2] and rows[2] == {"episode": 2, "train/kl": 9.0}


@pytest.mark.parametrize("setup, words", [
    ("missing_folder", ["no metrics to plot", "does not exist", "runtime_args.output_dir"]),
    ("no_file", ["no metrics to plot", "holds no metrics.jsonl"]),
    ("empty_file", ["holds no metrics rows", "first episode"]),
    ("bad_line", ["metrics.jsonl:1", "not a metrics row", "remove or fix that line"]),
])
def test_cli_plot_errors(tmp_path, capsys, setup, words):
    folder = tmp_path / "run"
    if setup != "missing_folder":
        folder.mkdir()
    if setup == "empty_file":
        (folder / "metrics.jsonl").write_text("\n")
    if setup == "bad_line":
        (folder / "metrics.jsonl").write_text('{"no_episode": 1}\n{"episode": 1}\n')
    assert main(["plot", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and "\n\n" not in err.strip()
    flat = " ".join(err.split())
    for w in words:
        assert w in flat, err
    assert not (folder / "plots").exists()


# ------------------------------------------------------------------ overlays and the panels' content

def run_folder(folder, *, kl_estimator="k3", clip=(0.2, 0.28), loss_offset=0.0, eval_seconds=100.0):
    """A run's metrics.jsonl and config.yaml: policy_loss differs from loss by ``loss_offset``."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "metrics.jsonl"), "w", encoding="utf-8") as f:
        for e in range(1, 6):
            row = {"episode": e, "train/loss": 0.1 * e, "train/policy_loss": 0.1 * e + loss_offset,
                   "train/kl": 0.01 * e, "train/ratio_mean": 1.0 + 0.01 * e, "train/clip_frac": 0.02 * e,
                   "time/generate": 1.0, "time/train": 2.0, "time/weight_push": 0.5}
            if e in (1, 5):
                row["time/eval"] = eval_seconds
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(folder, "config.yaml"), "w", encoding="utf-8") as f:
        f.write(f"models:\n  policy_trainer:\n    kl_estimator: {kl_estimator}\n"
                f"    neg_clip_ratio: {clip[0]}\n    pos_clip_ratio: {clip[1]}\n")
    return str(folder)


@pytest.fixture
def figures(monkeypatch):
    """name -> the matplotlib Figure saved under that name."""
    from matplotlib.figure import Figure

    saved = {}
    real = Figure.savefig

    def savefig(self, path, *args, **kwargs):
        saved[os.path.basename(path)[:-4]] = self
        return real(self, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def labels(fig):
    return [line.get_label() for line in fig.axes[0].get_lines() if not line.get_label().startswith("_")]


def test_one_loss_line_when_policy_loss_is_the_loss(tmp_path, figures):
    write_plots(run_folder(tmp_path / "same"))
    assert labels(figures["loss"]) == ["train/loss"]
    write_plots(run_folder(tmp_path / "kl_term", loss_offset=-0.05))
    assert labels(figures["loss"]) == ["train/loss", "train/policy_loss"]


def test_kl_title_and_clip_range_follow_the_config(tmp_path, figures):
    write_plots(run_folder(tmp_path / "a", kl_estimator="low_var_kl", clip=(0.2, 0.28)))
    assert figures["kl"].axes[0].get_title() == "KL(policy || reference), low_var_kl estimate"
    ratio = figures["ratio"].axes[0]
    assert "clip range [0.8, 1.28]" in labels(figures["ratio"])
    assert sorted(line.get_ydata()[0] for line in ratio.get_lines() if line.get_label() != "train/ratio_mean") == [
        pytest.approx(0.8), pytest.approx(1.28)]
    assert labels(figures["clip_frac"]) == ["train/clip_frac"]
    os.remove(tmp_path / "a" / "config.yaml")  # without a config: no estimator named, no range drawn
    write_plots(str(tmp_path / "a"))
    assert figures["kl"].axes[0].get_title() == "KL(policy || reference)"
    assert labels(figures["ratio"]) == ["train/ratio_mean"]


def test_eval_time_does_not_set_the_stage_charts_scale(tmp_path, figures):
    write_plots(run_folder(tmp_path / "a", eval_seconds=100.0))
    fig = figures["time_per_stage"]
    stacked, right = fig.axes
    assert stacked.get_ylim()[1] < 10  # the stages sum to 3.5 s; eval's 100 s is on the right-hand scale
    assert right.get_ylim()[1] >= 100 and list(right.get_lines()[0].get_xdata()) == [1, 5]
    legend = [t.get_text() for t in stacked.get_legend().get_texts()]
    assert legend == ["generate", "train", "weight_push", "eval (right-hand scale)"]


def test_runs_overlay_with_a_legend_naming_each(tmp_path, figures, capsys):
    a = run_folder(tmp_path / "x" / "run", kl_estimator="k3", clip=(0.2, 0.2))
    b = run_folder(tmp_path / "y" / "run", kl_estimator="k1", clip=(0.2, 0.28), loss_offset=-0.05)
    assert main(["plot", a, b, "--out", str(tmp_path / "cmp")]) == 0
    printed = capsys.readouterr().out.split()
    assert printed and all(p.startswith(str(tmp_path / "cmp")) for p in printed)
    assert not (tmp_path / "x" / "run" / "plots").exists()
    loss_fig = figures["loss"]
    assert labels(loss_fig) == ["x/run: train/loss", "y/run: train/loss", "y/run: train/policy_loss"]
    colours = {line.get_label(): line.get_color() for line in loss_fig.axes[0].get_lines()}
    assert colours["x/run: train/loss"] != colours["y/run: train/loss"] == colours["y/run: train/policy_loss"]
    assert figures["kl"].axes[0].get_title() == "KL(policy || reference), k3 / k1 estimate"
    assert [l for l in labels(figures["ratio"]) if l.startswith("clip")] == [
        "clip range [0.8, 1.2] (x/run)", "clip range [0.8, 1.28] (y/run)"]
    assert labels(figures["time_per_stage"]) == ["x/run", "y/run"]
    # several runs need --out: their own plots/ folders are kept for their own plots
    assert main(["plot", a, b]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "2 runs to compare, but no --out" in err and "Traceback" not in err


def test_run_labels_are_the_shortest_distinguishing_suffix():
    from chatlearn.logging.plots import run_labels

    assert run_labels(["/r/a/run1", "/r/b/run2"]) == ["run1", "run2"]
    assert run_labels(["/r/a/x/run", "/r/b/y/run"]) == ["x/run", "y/run"]
    assert run_labels(["/r/a/x/run", "/r/b/x/run"]) == ["a/x/run", "b/x/run"]
    assert run_labels(["/r/only"]) == ["only"]
