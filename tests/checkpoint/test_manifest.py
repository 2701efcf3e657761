"""Checkpoint manifests: every file of a checkpoint with its size, written before the COMPLETE
marker; resume passes over a checkpoint that no longer matches (truncated or missing file) to the
newest one that does, naming the damage; a model folder with a truncated safetensors file is
refused at validation (so at --dry-run)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from chatlearn.checkpoint.manager import MANIFEST, CheckpointManager, manifest_problems
from chatlearn.config.load import check_model_folder, safetensors_problem
from chatlearn.errors import ConfigError, UserError


def _writer(payload: bytes):
    def write(tmp: str) -> None:
        os.makedirs(os.path.join(tmp, "trainer"))
        with open(os.path.join(tmp, "trainer", "__0_0.distcp"), "wb") as f:
            f.write(payload)
        with open(os.path.join(tmp, "trainer", ".metadata"), "wb") as f:
            f.write(b"meta")
    return write


def _manager(tmp_path, episodes=(2, 4, 6)):
    mgr = CheckpointManager(str(tmp_path / "checkpoints"), keep=0)
    for ep in episodes:
        mgr.save(ep, _writer(bytes(100 + ep)), {"sampler": {}})
    return mgr


def test_the_manifest_lists_every_file_with_its_size(tmp_path):
    mgr = _manager(tmp_path, episodes=(2,))
    path = os.path.join(mgr.root, "episode_000002")
    with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
        files = json.load(f)["files"]
    assert files == {"state.json": os.path.getsize(os.path.join(path, "state.json")),
                     "trainer/.metadata": 4, "trainer/__0_0.distcp": 102}
    assert manifest_problems(path) == []
    assert manifest_problems(os.path.join(path, "trainer")) == []


def test_resume_passes_over_damaged_checkpoints_naming_them(tmp_path):
    mgr = _manager(tmp_path)
    warnings = []
    assert mgr.latest_usable(warnings.append)[0] == 6 and warnings == []
    newest = os.path.join(mgr.root, "episode_000006")
    with open(os.path.join(newest, "trainer", "__0_0.distcp"), "r+b") as f:
        f.truncate(50)
    found = mgr.latest_usable(warnings.append)
    assert found == (4, os.path.join(mgr.root, "episode_000004"))
    assert "episode_000006 is damaged: trainer/__0_0.distcp is 50 bytes, 106 when written (truncated)" in warnings[0]
    assert "resuming from" in warnings[1] and "episode 4" in warnings[1]
    os.remove(os.path.join(mgr.root, "episode_000004", "trainer", ".metadata"))
    warnings.clear()
    assert mgr.latest_usable(warnings.append)[0] == 2
    assert "trainer/.metadata is missing" in warnings[1]
    with open(os.path.join(mgr.root, "episode_000002", "state.json"), "a", encoding="utf-8") as f:
        f.write(" ")
    with pytest.raises(UserError, match="every checkpoint in .* is damaged") as err:
        mgr.latest_usable(lambda msg: None)
    assert "--no-resume" in str(err.value)


def test_a_checkpoint_without_a_manifest_is_taken_as_it_is(tmp_path):
    mgr = _manager(tmp_path, episodes=(2,))
    os.remove(os.path.join(mgr.root, "episode_000002", MANIFEST))
    assert mgr.latest_usable(lambda msg: pytest.fail(msg))[0] == 2


def test_damage_outside_the_folder_read_does_not_count(tmp_path):
    mgr = _manager(tmp_path, episodes=(2,))
    path = os.path.join(mgr.root, "episode_000002")
    os.makedirs(os.path.join(path, "hf"))
    with open(os.path.join(path, "state.json"), "a", encoding="utf-8") as f:
        f.write(" ")
    assert manifest_problems(os.path.join(path, "trainer")) == []
    assert manifest_problems(path) and "state.json" in manifest_problems(path)[0]


def test_a_truncated_safetensors_file_is_named(tiny_model_dir, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    assert safetensors_problem(str(weights)) is None
    check_model_folder(str(model), "models.policy_trainer.load")
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 1000)
    assert "truncated" in safetensors_problem(str(weights))
    with pytest.raises(ConfigError) as err:
        check_model_folder(str(model), "models.policy_trainer.load")
    assert err.value.key == "models.policy_trainer.load" and "model.safetensors" in str(err.value)
    assert f"is {size - 1000} bytes, but its header places {size}" in str(err.value)
    with open(weights, "r+b") as f:
        f.truncate(20)  # inside the header
    assert "header alone" in safetensors_problem(str(weights))
    other = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(3)}, str(other))
    assert safetensors_problem(str(other)) is None
    with open(other, "ab") as f:
        f.write(b"junk")
    assert "do not match" in safetensors_problem(str(other))
