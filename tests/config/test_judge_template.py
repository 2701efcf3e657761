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
