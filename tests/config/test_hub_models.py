"""Hub model ids where a model is named (``load``, ``chatlearn eval --checkpoint``, ``chatlearn merge
--hf-config``), resolved from a Hugging Face cache built offline from the tiny test model."""
from __future__ import annotations

import os
import shutil

import pytest

from chatlearn.cli import main
from chatlearn.errors import UserError
from conftest import REPO
from hub_cache import add_model, commit_of

TEMPLATE = "template/grpo_fsdp.yaml"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache in use (as HF_HOME=<tmp>/hf would give), offline."""
    from huggingface_hub import constants

    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(REPO)
    return str(home / "hub")


@pytest.fixture
def base(arith_data, tmp_path) -> list[str]:
    train, evald = arith_data
    return [f"runtime_args.data_path={train}", f"runtime_args.eval_data_path={evald}",
            f"runtime_args.output_dir={tmp_path / 'out'}", "runtime_args.rollout_backend=hf"]


def test_hub_id_resolves_to_the_cached_snapshot_for_every_model(hub, base, tiny_model_dir):
    from chatlearn.config.load import load_config

    snap = add_model(hub, "acme/tiny-chat", tiny_model_dir)
    cfg = load_config(TEMPLATE, [*base, "models.policy_trainer.load=acme/tiny-chat"])
    for name in ("policy_trainer", "ref_policy", "policy"):
        assert cfg.models[name].load == snap, name
        assert cfg.models[name].hub_id == f"acme/tiny-chat@{commit_of('acme/tiny-chat')}"


def test_revision_after_at(hub, base, tiny_model_dir):
    from chatlearn.config.load import load_config

    add_model(hub, "acme/tiny-chat", tiny_model_dir)
    v1 = add_model(hub, "acme/tiny-chat", tiny_model_dir, revision="v1")
    cfg = load_config(TEMPLATE, [*base, "models.policy_trainer.load=acme/tiny-chat@v1"])
    assert cfg.models.policy.load == v1 and cfg.models.policy.hub_id.endswith(commit_of("acme/tiny-chat", "v1"))


def test_a_local_folder_wins_over_the_id(hub, base, tiny_model_dir, tmp_path, monkeypatch):
    from chatlearn.config.load import load_config

    add_model(hub, "acme/tiny-chat", tiny_model_dir)
    shutil.copytree(tiny_model_dir, tmp_path / "acme" / "tiny-chat")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(os.path.join(REPO, TEMPLATE), [*base, "models.policy_trainer.load=acme/tiny-chat"])
    assert cfg.models.policy.load == "acme/tiny-chat" and cfg.models.policy.hub_id is None


def test_dry_run_shows_the_snapshot_and_the_pinned_id(hub, base, tiny_model_dir, capsys):
    snap = add_model(hub, "acme/tiny-chat", tiny_model_dir)
    assert main(["run", TEMPLATE, *base, "models.policy_trainer.load=acme/tiny-chat", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert snap in out and f"acme/tiny-chat@{commit_of('acme/tiny-chat')}" in out


@pytest.mark.parametrize("value, words", [
    ("acme/not-cached", ["models.policy_trainer.load", "'acme/not-cached' is not a local path",
                         "not in the Hugging Face cache", "HF_HUB_OFFLINE=1", "hf download acme/not-cached",
                         "HF_HUB_OFFLINE=0", "point models.policy_trainer.load at a local model folder"]),
    ("acme/not-cached@v2", ["at revision 'v2'", "hf download acme/not-cached --revision v2"]),
])
def test_uncached_id_offline_is_one_paragraph_at_dry_run(hub, base, value, words, capsys):
    assert main(["run", TEMPLATE, *base, f"models.policy_trainer.load={value}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "\n\n" not in err.strip()
    flat = " ".join(err.split())
    for w in words:
        assert w in flat, (w, flat)


def test_unreachable_hub_is_named(hub, base, monkeypatch, capsys):
    """Online but the Hub cannot be reached (and the id is not cached): the error says so."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def unreachable(*args, **kwargs):
        try:
            raise httpx2.ConnectError("Name or service not known")
        except httpx2.ConnectError as err:
            raise LocalEntryNotFoundError("An error happened while trying to locate the files") from err

    monkeypatch.setattr("huggingface_hub.snapshot_download", unreachable)
    assert main(["run", TEMPLATE, *base, "models.policy_trainer.load=acme/tiny-chat", "--dry-run"]) == 2
    flat = " ".join(capsys.readouterr().err.split())
    for w in ("models.policy_trainer.load", "the Hub cannot be reached (ConnectError: Name or service not known)",
              "hf download acme/tiny-chat", "local model folder"):
        assert w in flat, (w, flat)


def test_a_path_that_is_not_an_id_says_the_folder_does_not_exist(hub, base, capsys):
    assert main(["run", TEMPLATE, *base, "models.policy_trainer.load=./models/nothing", "--dry-run"]) == 2
    flat = " ".join(capsys.readouterr().err.split())
    assert "model folder './models/nothing' does not exist" in flat and "HF_HUB_OFFLINE" not in flat


def test_eval_checkpoint_and_merge_base_take_hub_ids(hub, tiny_model_dir):
    from chatlearn.checkpoint.merge import _source_folder
    from chatlearn.runtime.driver.evaluate import resolve_model

    snap = add_model(hub, "acme/tiny-chat", tiny_model_dir)
    assert resolve_model("acme/tiny-chat").folder == snap
    assert _source_folder("ckpt", {}, "acme/tiny-chat") == snap
    with pytest.raises(UserError, match="--checkpoint: 'acme/gone' is not a local path"):
        resolve_model("acme/gone")
    with pytest.raises(UserError, match="--hf-config: 'acme/gone' is not a local path"):
        _source_folder("ckpt", {}, "acme/gone")
