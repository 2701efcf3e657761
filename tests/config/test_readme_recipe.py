"""Every command of README's "From the toy to a real model" validates (``--dry-run``) against a Hugging
Face cache holding the ids it names (built offline from the tiny test model and GSM8K-shaped rows),
and without that cache stops with the paragraph that names the download command the README shows."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex

import pytest

from chatlearn.cli import main
from conftest import REPO
from hub_cache import add_dataset, add_model, gsm_rows

SECTION = "## From the toy to a real model"


def commands() -> list[list[str]]:
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text[start:end], flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(shlex.split(line))
    return out


@pytest.fixture
def hub(tmp_path, monkeypatch):
    import datasets
    from huggingface_hub import constants

    home = tmp_path / "hf"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.chdir(REPO)
    return str(home / "hub")


def fill(hub: str, tiny_model_dir: str) -> None:
    """What the README's hf download lines fetch, and the 7B model, as tiny stand-ins."""
    for repo in ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct"):
        snap = add_model(hub, repo, tiny_model_dir)
        with open(os.path.join(snap, "config.json")) as f:
            conf = json.load(f)
        conf["max_position_embeddings"] = 32768  # as the real ones: prompt + response lengths fit
        with open(os.path.join(snap, "config.json"), "w") as f:
            json.dump(conf, f)
    add_dataset(hub, "openai/gsm8k", {"main": {"train": gsm_rows(64), "test": gsm_rows(16, 100)},
                                      "socratic": {"train": gsm_rows(4)}})


def test_the_section_has_the_recipes():
    cmds = commands()
    runs = [c for c in cmds if c[:2] == ["chatlearn", "run"]]
    assert len(runs) == 3
    flat = [" ".join(c) for c in runs]
    assert any("Qwen2.5-7B-Instruct" in c and "train_backend=megatron" in c for c in flat)
    assert any("Qwen2.5-7B-Instruct" in c and "train_backend" not in c for c in flat)
    downloads = {c[2] for c in cmds if c[:2] == ["hf", "download"]}
    assert downloads == {"Qwen/Qwen2.5-0.5B-Instruct", "openai/gsm8k"}
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    assert text.index("## Quick start") < text.index(SECTION)  # the toy comes first


@pytest.mark.parametrize("index", range(3))
def test_each_command_validates(hub, tiny_model_dir, tmp_path, capsys, index):
    fill(hub, tiny_model_dir)
    cmd = [c for c in commands() if c[:2] == ["chatlearn", "run"]][index]
    if "runtime_args.train_backend=megatron" in cmd and importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    rc = main([*cmd[1:], f"runtime_args.output_dir={tmp_path / 'out'}", "--dry-run"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    assert "# plan" in captured.out and os.path.join(hub, "models--Qwen--") in captured.out


def test_without_the_cache_the_error_names_the_download(hub, tmp_path, capsys):
    cmd = [c for c in commands() if c[:2] == ["chatlearn", "run"]][0]
    assert main([*cmd[1:], f"runtime_args.output_dir={tmp_path / 'out'}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    flat = " ".join(err.split())
    assert "Traceback" not in err and "HF_HUB_OFFLINE=1" in flat
    assert "hf download openai/gsm8k --repo-type dataset" in flat
