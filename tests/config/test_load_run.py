"""The plan is computed once per start: validation computes it and load_run hands it over."""
from __future__ import annotations

import pytest

from chatlearn.cli import main
from chatlearn.config import load as config_load
from chatlearn.config import plan as config_plan
from chatlearn.config.load import load_config, load_run
from chatlearn.config.plan import Plan, make_plan

TEMPLATE = "template/grpo_fsdp.yaml"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    from conftest import REPO

    monkeypatch.chdir(REPO)


@pytest.fixture
def plan_calls(monkeypatch):
    """Counts make_plan calls, wherever they come from."""
    calls = []

    def counting(cfg):
        calls.append(cfg)
        return make_plan(cfg)

    monkeypatch.setattr(config_load, "make_plan", counting)
    monkeypatch.setattr(config_plan, "make_plan", counting)
    return calls


def test_load_run_returns_the_plan_validation_computed(paths_overrides, plan_calls):
    cfg, plan = load_run(TEMPLATE, paths_overrides + ["models.policy_trainer.kl_coef=0.01"])
    assert len(plan_calls) == 1  # in validate, and nowhere else
    assert isinstance(plan, Plan) and plan == make_plan(cfg)
    assert plan.uses_ref and plan.total_steps == cfg.runtime_args.num_episode * plan.steps_per_episode
    assert load_config(TEMPLATE, paths_overrides + ["models.policy_trainer.kl_coef=0.01"]) == cfg


def test_validate_returns_the_plan(paths_overrides):
    from omegaconf import OmegaConf

    cfg = load_config(TEMPLATE, paths_overrides)
    mutable = OmegaConf.create(OmegaConf.to_container(cfg))
    assert config_load.validate(mutable) == make_plan(cfg)


def test_cli_dry_run_makes_the_plan_once(paths_overrides, plan_calls, capsys):
    assert main(["run", "--dry-run", TEMPLATE, *paths_overrides]) == 0
    assert len(plan_calls) == 1
    assert "# plan" in capsys.readouterr().out
