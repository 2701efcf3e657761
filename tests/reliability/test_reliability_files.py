"""The files of a run under crashes: torn and extra rows in the JSON-lines logs, checkpoint
retention that only ever sees the current run's checkpoints, config.yaml without secrets."""
from __future__ import annotations

import json
import os

import pytest
from omegaconf import OmegaConf

from chatlearn.checkpoint.manager import CheckpointManager
from chatlearn.logging import jsonl
from chatlearn.logging.metrics import MetricsWriter

TORN = '{"episode": 3, "train/rew'


def rows(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def write(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


@pytest.mark.parametrize("text, keep_through, episodes", [
    ("", 2, []),
    ('{"episode": 0}\n{"episode": 1}\n{"episode": 2}\n{"episode": 3}\n', 2, [0, 1, 2]),
    ('{"episode": 0}\n{"episode": 1}\n{"episode": 2}\n' + TORN, 2, [0, 1, 2]),  # torn last line
    ('{"episode": 0}\n{"episode": 3}\n' + TORN, 1, [0]),
    ('{"episode": 0}\n{"episode": 1}\n', -1, []),  # no checkpoint: the run starts over
    ('{"episode": 0}\n\n[1, 2]\n{"episode": 1}\n', 5, [0, 1]),  # blank and non-row lines
])
def test_truncate_after(tmp_path, text, keep_through, episodes):
    path = tmp_path / "metrics.jsonl"
    write(path, text)
    jsonl.truncate_after(str(path), keep_through)
    assert [r["episode"] for r in rows(path)] == episodes
    assert not [p for p in os.listdir(tmp_path) if p != "metrics.jsonl"]  # no temporary file left


def test_truncate_after_is_atomic(tmp_path, monkeypatch):
    """A crash before the rename leaves the original file whole."""
    path = tmp_path / "metrics.jsonl"
    text = '{"episode": 0}\n{"episode": 1}\n'
    write(path, text)

    def crash(src, dst):
        raise OSError("power loss")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        jsonl.truncate_after(str(path), 0)
    assert path.read_text() == text and os.listdir(tmp_path) == ["metrics.jsonl"]


def test_metrics_writer_never_glues_a_row_to_a_torn_one(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    write(path, '{"episode": 0, "eval/reward_mean": 0.5}\n' + TORN)
    writer = MetricsWriter(str(tmp_path))
    writer.write(1, {"train/reward_mean": 0.25})
    writer.close()
    got = rows(path)
    assert isinstance(got[1].pop("time/wall"), float)  # every new row carries its wall-clock time
    assert got == [{"episode": 0, "eval/reward_mean": 0.5}, {"episode": 1, "train/reward_mean": 0.25}]
    assert "cut short by an earlier crash" in capsys.readouterr().err


def test_metrics_writer_resume_drops_later_and_torn_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write(path, '{"episode": 0}\n{"episode": 1}\n{"episode": 2}\n' + TORN)
    writer = MetricsWriter(str(tmp_path))
    writer.truncate_after(1)
    writer.write(2, {"x": 1.0})
    writer.close()
    assert [r["episode"] for r in rows(path)] == [0, 1, 2]


# ---------------------------------------------------------------- checkpoint retention


def save(mgr, episode):
    return mgr.save(episode, lambda tmp: None, {"sampler": {}})


def test_retention_only_considers_this_runs_checkpoints(tmp_path):
    """An older, longer run's checkpoints in the folder: the new run's keep-last-N never deletes
    its own newest checkpoint, never touches the other run's, and ``latest`` names one that exists."""
    root = str(tmp_path / "checkpoints")
    old = CheckpointManager(root, keep=0)
    for e in (10, 20, 30):
        save(old, e)
    new = CheckpointManager(root, keep=1)
    save(new, 1)
    save(new, 2)
    names = sorted(os.listdir(root))
    assert names == ["episode_000002", "episode_000010", "episode_000020", "episode_000030", "latest"]
    pointer = open(os.path.join(root, "latest")).read().strip()
    assert pointer == "episode_000002" and os.path.isfile(os.path.join(root, pointer, "COMPLETE"))


def test_a_resumed_run_goes_on_counting_its_checkpoints(tmp_path):
    root = str(tmp_path / "checkpoints")
    first = CheckpointManager(root, keep=2)
    for e in (1, 2):
        save(first, e)
    resumed = CheckpointManager(root, keep=2)  # a new process: a new id until it adopts the checkpoint's
    resumed.adopt(CheckpointManager.read_state(resumed.latest()[1]))
    save(resumed, 3)
    assert sorted(n for n in os.listdir(root) if n.startswith("episode_")) == ["episode_000002", "episode_000003"]


def test_resuming_a_checkpoint_without_run_id_keeps_pruning_it(tmp_path):
    """Checkpoints written before they recorded their run: a run resumed from one treats them as its own."""
    root = str(tmp_path / "checkpoints")
    legacy = CheckpointManager(root, keep=0)
    for e in (1, 2):
        path = save(legacy, e)
        state = json.load(open(os.path.join(path, "state.json")))
        del state["run_id"]
        json.dump(state, open(os.path.join(path, "state.json"), "w"))
    resumed = CheckpointManager(root, keep=2)
    resumed.adopt(CheckpointManager.read_state(resumed.latest()[1]))
    save(resumed, 3)
    assert sorted(n for n in os.listdir(root) if n.startswith("episode_")) == ["episode_000002", "episode_000003"]


# ---------------------------------------------------------------- config.yaml


def test_config_yaml_has_no_secrets(tmp_path):
    from chatlearn.logging.sinks import write_config_yaml

    cfg = OmegaConf.create({"runtime_args": {"output_dir": str(tmp_path), "max_prompt_tokens_length": 8},
                            "models": {"reward": {"functions": [
                                {"name": "judge", "path": "x.py:f", "kwargs": {"api_key": "sk-1", "hf_token": "t",
                                                                              "url": "https://x"}}]}}})
    path = tmp_path / "config.yaml"
    write_config_yaml(cfg, str(path))
    text = path.read_text()
    assert "sk-1" not in text and "hf_token: '***'" in text and "url: https://x" in text
    assert "max_prompt_tokens_length: 8" in text
    assert os.listdir(tmp_path) == ["config.yaml"]
