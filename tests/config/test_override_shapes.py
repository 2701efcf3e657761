"""Command-line overrides that index a list, and values of the wrong shape: set, or refused naming the key; and
the help saying that a config is code."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from chatlearn.cli import main
from chatlearn.config.load import MAX_TIMEOUT_S, load_config
from chatlearn.errors import ConfigError, UserError

TEMPLATE = "template/grpo_fsdp.yaml"
TWO = "models.reward.functions=[{name: a, path: 'builtin:math'}, {name: b, path: 'builtin:math'}]"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)


def test_an_override_of_one_list_entry_sets_that_entry(paths_overrides, tmp_path):
    data = OmegaConf.load(TEMPLATE)  # the list in the YAML file, one entry of it on the command line
    data.models.reward.functions = [{"name": "a", "path": "builtin:math"}, {"name": "b", "path": "builtin:math"}]
    OmegaConf.save(data, tmp_path / "two.yaml")
    cfg = load_config(str(tmp_path / "two.yaml"), [*paths_overrides, "models.reward.functions[1].weight=2",
                                                   "models.reward.functions[0].name=c"])
    functions = cfg.models.reward.functions
    assert [f.name for f in functions] == ["c", "b"]
    assert functions[0].weight == 1.0 and functions[1].weight == 2.0


@pytest.mark.parametrize("override, key, words", [
    ("models.reward.functions[2].weight=2", "models.reward.functions", "has entries [0] to [1]"),
    ("models.reward.functions[0].wieght=2", "models.reward.functions[0].wieght",
     "Did you mean 'models.reward.functions[0].weight'"),
    ("models.reward.functions[1].weight=abc", "models.reward.functions[1].weight", "could not be converted"),
    ("runtime_args.num_episode[0]=1", "runtime_args.num_episode", "is not a list"),
    ("models.reward.functions={a: 1}", "models.reward.functions", "values of different shapes"),
    ("runtime_args=3", "runtime_args", "is a section of keys"),
    ("models.policy_trainer.optimizer=adam", "models.policy_trainer.optimizer", "single value ('adam')"),
    ("runtime_args.ray_connect_timeout_s=1e12", "runtime_args.ray_connect_timeout_s", f"at most {MAX_TIMEOUT_S}."),
])
def test_a_wrong_override_names_its_key(paths_overrides, override, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(TEMPLATE, [*paths_overrides, TWO, override])
    assert err.value.key == key and words in str(err.value), str(err.value)


def test_a_malformed_index_is_refused():
    with pytest.raises(UserError, match="not of the form key.path=value"):
        load_config(TEMPLATE, ["models.reward.functions[x].weight=2"])


def test_the_largest_timeout_is_accepted(paths_overrides):
    cfg = load_config(TEMPLATE, [*paths_overrides, f"runtime_args.stage_timeout_s={MAX_TIMEOUT_S}"])
    assert cfg.runtime_args.stage_timeout_s == MAX_TIMEOUT_S


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["eval", "--help"]])
def test_help_says_a_config_is_code(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    text = " ".join(capsys.readouterr().out.split())
    assert done.value.code == 0
    assert "A config is code" in text and "--dry-run" in text and "runs their top-level code" in text, text
    assert "Run only configs you trust" in text
