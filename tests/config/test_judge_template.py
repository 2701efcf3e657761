"""template/grpo_judge.yaml: the judge's prompt is the one tools/build_judge_assets.py trained assets/tiny_judge on,
and the template validates with the judge it names."""
from __future__ import annotations

import os
import sys

from chatlearn.config.kinds import JUDGE, models_of
from chatlearn.config.load import load_run
from conftest import REPO


def test_the_demo_prompt_is_the_builders(monkeypatch):
    monkeypatch.chdir(REPO)
    sys.path.insert(0, os.path.join(REPO, "tools"))
    try:
        import build_judge_assets
    finally:
        sys.path.remove(os.path.join(REPO, "tools"))
    cfg, plan = load_run("template/grpo_judge.yaml", ["runtime_args.output_dir=/tmp/chatlearn-judge-template"])
    assert models_of(cfg, JUDGE) == ["judge"]
    j = cfg.models.judge
    assert j.prompt_template == build_judge_assets.JUDGE_TEMPLATE
    assert not j.apply_chat_template and j.parser == "yes_prob"
    assert cfg.models.reward.functions[0].weight == 0.0  # rewarded by the judge alone
    assert "judge" in plan.device_groups[0]  # colocated: it takes turns


def test_a_served_judge_takes_no_devices_and_no_turns(monkeypatch):
    """The template's judge with an endpoint: of kind judge to the config, a SERVED_JUDGE to the plan (no parts,
    no placement, no device group), listed in the plan's kinds; the run then fits in one process, and chatlearn
    eval's plan places no judge either."""
    from chatlearn.config.kinds import SERVED_JUDGE
    from chatlearn.config.plan import make_eval_plan

    monkeypatch.chdir(REPO)
    cfg, plan = load_run("template/grpo_judge.yaml", ["runtime_args.output_dir=/tmp/chatlearn-judge-template",
                                                      "models.judge.endpoint=http://127.0.0.1:9/v1/",
                                                      "runtime_args.colocation=[policy,policy_trainer,ref_policy]"])
    assert models_of(cfg, JUDGE) == ["judge"] and plan.of_kind(JUDGE) == ["judge"]
    assert plan.kind("judge") is SERVED_JUDGE and SERVED_JUDGE.parts == () and not SERVED_JUDGE.on_devices
    assert "judge" not in plan.placements and all("judge" not in g for g in plan.device_groups)
    assert plan.single_process
    assert any("served over HTTP" in line for line in plan.describe())
    ev = make_eval_plan(cfg, 4, 1)
    assert "judge" not in ev.placements and ev.of_kind(JUDGE) == ["judge"] and len(ev.device_groups) == 1
