"""template/distill.yaml: distillation (algorithm: gkd) of the toy (assets/tiny_qwen2) from its teacher
(assets/tiny_qwen2_teacher: the student's tokenizer files, so the refusals of another vocabulary or chat template
pass), colocated and taking turns, on the FSDP trainer and the hf rollout."""
from __future__ import annotations

import os

import pytest

from conftest import REPO

TEMPLATE = os.path.join(REPO, "template", "distill.yaml")


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)


def test_the_distill_template_loads_with_its_teacher(tmp_path):
    from chatlearn.config.kinds import TEACHER
    from chatlearn.config.load import load_run

    cfg, plan = load_run(TEMPLATE, [f"runtime_args.output_dir={tmp_path / 'out'}"])
    assert plan.algorithm == "gkd" and plan.of_kind(TEACHER) == ["teacher"]
    assert plan.device_groups == [["policy", "policy_trainer", "teacher"]]
    assert cfg.runtime_args.train_backend == "fsdp" and cfg.runtime_args.rollout_backend == "hf"
    assert os.path.basename(cfg.models.policy.load) == "tiny_qwen2"
    assert os.path.basename(cfg.models.teacher.load) == "tiny_qwen2_teacher"
    assert "ref_policy" not in plan.placements  # no KL term: the teacher is the only other model
