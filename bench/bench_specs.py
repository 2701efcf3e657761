"""The specs the benchmarks build backends from, without a run: the template's validated config
(every default from the schema, ``chatlearn/config/schema.py``) with the benchmark's model folder
and settings as overrides, each spec made by its ``from_config`` as a run makes it and resolved for
the CPU as a worker resolves it."""
from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = os.path.join(REPO, "template", "grpo_fsdp.yaml")


def backend_specs(model: str, *overrides: str):
    """``(TrainerSpec of policy_trainer, RolloutSpec of policy)`` for the model folder ``model`` (the
    config is validated with the embedded model, whose folder has the tokenizer a benchmark's random
    model lacks; the specs then load ``model``)."""
    from chatlearn.config.load import load_run
    from chatlearn.models.specs import RolloutSpec, TrainerSpec, resolve_for_device

    assets = os.path.join(REPO, "assets")
    cfg, plan = load_run(TEMPLATE, [f"models.policy_trainer.load={os.path.join(assets, 'tiny_qwen2')}",
                                    f"runtime_args.data_path={os.path.join(assets, 'arith', 'train.jsonl')}",
                                    f"runtime_args.eval_data_path={os.path.join(assets, 'arith', 'eval.jsonl')}",
                                    *overrides])
    return (resolve_for_device(TrainerSpec.from_config(cfg, "policy_trainer", plan).replace(load=model), "cpu"),
            resolve_for_device(RolloutSpec.from_config(cfg).replace(load=model), "cpu"))
