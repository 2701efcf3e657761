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
