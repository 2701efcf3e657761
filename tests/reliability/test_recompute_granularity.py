"""``models.*.recompute_granularity`` acts: Megatron's activation recomputation is full or selective as
it says (``gradient_checkpointing`` gives full recompute where it is null), gradients unchanged; under the
FSDP trainer, which has no such setting, a value is refused rather than ignored. The trainer runs on
the CPU under the Megatron test shim (tests/support/megatron_shim.py), in one spawned rank."""
from __future__ import annotations

import numpy as np
import pytest
from test_fsdp_trainer import add_logprobs, hf_logprobs, make_batch, make_tiny_model, run_ranks, trainer_spec

from chatlearn.config import load as config_load
from chatlearn.config.load import load_run
from chatlearn.errors import ConfigError

needs_megatron = pytest.mark.skipif(not config_load._importable("megatron.core"), reason="megatron-core is not installed")
MEGATRON = "template/grpo_megatron.yaml"


def spec(path: str, **over):
    return trainer_spec(path, lr=1e-4, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                        sequence_parallel=False, use_distributed_optimizer=False, **over)


def job_recompute(rank, world, setup, out):
    """Gradients and the recomputed calls of megatron-core, for each recompute setting."""
    from megatron.core.transformer.attention import Attention
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron_shim import cpu_device_shim

    counts = {"full": 0, "selective": 0}
    full, sel = TransformerBlock._checkpointed_forward, Attention._checkpointed_attention_forward

    def counted_full(self, *args, **kwargs):
        counts["full"] += 1
        return full(self, *args, **kwargs)

    def counted_sel(self, *args, **kwargs):
        counts["selective"] += 1
        return sel(self, *args, **kwargs)

    TransformerBlock._checkpointed_forward, Attention._checkpointed_attention_forward = counted_full, counted_sel
    res = {}
    with cpu_device_shim():
        from chatlearn.models.trainer.megatron import MegatronTrainer

        # gradient_checkpointing alone (full recompute) is test_megatron_trainer's PP=2 job
        for name, over in (("none", {}), ("selective", {"recompute_granularity": "selective"}),
                           ("full", {"recompute_granularity": "full"})):
            counts.update(full=0, selective=0)
            trainer = MegatronTrainer(spec(setup["path"], **over))
            trainer.compute_grads(setup["batch"])
            res[name] = {"granularity": trainer.config.recompute_granularity, "calls": dict(counts),
                         "grads": trainer.full_grads()}
    return res


@needs_megatron
@pytest.mark.slow
def test_megatron_recomputes_as_recompute_granularity_says(tmp_path):
    from transformers import AutoConfig

    path = make_tiny_model(str(tmp_path / "tiny"))
    batch = make_batch(AutoConfig.from_pretrained(path).vocab_size)
    batch = add_logprobs(batch, hf_logprobs(path, batch)[0])
    (tmp_path / "out").mkdir()
    res = run_ranks(job_recompute, 1, tmp_path / "out", {"path": path, "batch": batch}, str(tmp_path / "out"),
                    timeout=180)[0]
    assert res["none"]["granularity"] is None and res["none"]["calls"] == {"full": 0, "selective": 0}
    assert res["selective"]["granularity"] == "selective"
    assert res["selective"]["calls"]["selective"] > 0 and res["selective"]["calls"]["full"] == 0
    assert res["full"]["granularity"] == "full" and res["full"]["calls"]["full"] > 0, res["full"]
    for name in ("selective", "full"):  # recomputation changes memory, not the gradients
        for key, grad in res["none"]["grads"].items():
            np.testing.assert_allclose(res[name]["grads"][key], grad, rtol=1e-5, atol=1e-7, err_msg=f"{name}: {key}")


def test_recompute_of_a_trainer():
    from chatlearn.models.trainer.megatron.trainer import recompute_of

    assert recompute_of(spec("", recompute_granularity="selective")) == "selective"
    assert recompute_of(spec("", recompute_granularity="selective", gradient_checkpointing=True)) == "selective"
    assert recompute_of(spec("", gradient_checkpointing=True)) == "full"
    assert recompute_of(spec("", recompute_granularity="full", trainable=False)) is None
    assert recompute_of(spec("")) is None


@needs_megatron
@pytest.mark.parametrize("value, expected", [("sel", "selective"), ("selective", "selective"), ("full", "full"),
                                             (None, None)])
def test_the_trainer_spec_carries_recompute_granularity(paths_overrides, value, expected):
    from chatlearn.models.specs import TrainerSpec

    v = "null" if value is None else value
    cfg, plan = load_run(MEGATRON, paths_overrides + [f"models.policy_trainer.recompute_granularity={v}"])
    assert TrainerSpec.from_config(cfg, "policy_trainer", plan).recompute_granularity == expected


def test_recompute_granularity_is_refused_under_fsdp(paths_overrides):
    with pytest.raises(ConfigError) as err:
        load_run("template/grpo_fsdp.yaml", paths_overrides + ["models.policy_trainer.recompute_granularity=full"])
    message = " ".join(err.value.message.split())
    assert "models.policy_trainer.recompute_granularity" in str(err.value) and "Megatron" in message
    assert "gradient_checkpointing: true" in message
