"""template/grpo_moe.yaml: GRPO on the MoE toy with the FSDP trainer and the hf rollout; its MoE keys reach
the trainer's spec (chatlearn/models/specs.py MoeSpec) as written."""
from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATE = os.path.join(REPO, "template", "grpo_moe.yaml")


def test_the_moe_template_loads_and_its_keys_reach_the_trainer_spec():
    from chatlearn.config.load import load_run
    from chatlearn.models.specs import TrainerSpec

    assets = os.path.join(REPO, "assets")
    cfg, plan = load_run(TEMPLATE, [f"runtime_args.data_path={os.path.join(assets, 'arith', 'train.jsonl')}",
                                    f"runtime_args.eval_data_path={os.path.join(assets, 'arith', 'eval.jsonl')}",
                                    f"models.policy_trainer.load={os.path.join(assets, 'tiny_qwen3_moe')}"])
    assert cfg.runtime_args.train_backend == "fsdp" and cfg.runtime_args.rollout_backend == "hf"
    assert os.path.basename(cfg.models.policy.load) == "tiny_qwen3_moe"
    spec = TrainerSpec.from_config(cfg, "policy_trainer", plan)
    assert spec.moe.groupgemm and spec.moe.aux_loss_coeff is None and spec.moe.z_loss_coeff == 0.0
    assert not spec.moe.force_load_balancing and not spec.moe.layer_recompute
    ref = TrainerSpec.from_config(cfg, "ref_policy", plan)
    assert ref.moe.groupgemm  # the reference routes and computes as the policy trainer
