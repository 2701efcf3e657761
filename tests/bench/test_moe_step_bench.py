"""bench/moe_step.py's dense counterpart of the MoE toy: the same active parameter count."""
from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench"))

import moe_step  # noqa: E402


def test_the_dense_model_has_the_moe_toys_active_parameter_count(tmp_path):
    dense = moe_step.active_params(moe_step.make_dense(str(tmp_path / "dense")))
    moe = moe_step.active_params(moe_step.MOE)
    assert moe["total"] > 2 * moe["active"]  # top-2 of 8 experts: most parameters are inactive per token
    assert dense["total"] == dense["active"]
    assert abs(dense["active"] - moe["active"]) / moe["active"] < 0.015  # the routers' weights apart


def test_a_grpo_batch_is_well_formed():
    batch = moe_step.grpo_batch(6)
    assert len(batch["offsets"]) == 7 and batch["offsets"][-1] == len(batch["tokens"])
    assert (batch["prompt_lens"] < (batch["offsets"][1:] - batch["offsets"][:-1])).all()
