"""``chatlearn merge`` of a LoRA checkpoint (chatlearn/checkpoint/adapters.py): peft's adapter folder, which
``PeftModel.from_pretrained`` loads onto the base and which computes what the trainer's merged model does;
``--merged``, the merged Hugging Face model, equal to peft's ``merge_and_unload``; what ``chatlearn eval``
merges from an adapter folder or the checkpoint itself (the same tensors as ``--merged``); and the refusals
(a base moved or changed, an adapter folder whose base is gone, flags that do not apply).

One short job of the FSDP trainer with adapters (1 rank, one optimizer step: B no longer 0) writes the
checkpoint and its ``save_hf`` folder (the trainer's merged model) once per module."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from chatlearn.models.specs import LoraSpec
from tests.models.trainer.test_fsdp_trainer import TEMPERATURE, make_batch, make_tiny_model, run_ranks, trainer_spec

# a list of targets (q, v, down) and the final norm trained in full: adapted layers, plain layers and a
# replaced tensor in the same model
LORA = LoraSpec(rank=4, alpha=8.0, dropout=0.05, target_modules=("q_proj", "v_proj", "down_proj"),
                modules_to_save=("model.norm",),
                **({"push": "merged"} if "push" in getattr(LoraSpec, "__dataclass_fields__", {}) else {}))


def job_checkpoint(rank, world, path, batch, out):
    from chatlearn.models.trainer.fsdp import FSDPTrainer

    # (dropout 0.05: what the adapter config must record)
    trainer = FSDPTrainer(trainer_spec(path, lora=LORA, lr=1e-2, kl_coef=0.0))
    trainer.train(batch, TEMPERATURE)
    trainer.train(batch, TEMPERATURE)  # a second step: A moves too (its gradient is 0 while B is 0)
    trainer.save_checkpoint(os.path.join(out, "ckpt"))
    trainer.save_hf(os.path.join(out, "hf"))
    return {"adapter": {n: t.clone() for n, t in trainer.export_adapter()}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoConfig

    base = make_tiny_model(str(tmp_path_factory.mktemp("base") / "tiny"))
    out = tmp_path_factory.mktemp("lora_ckpt")
    batch = make_batch(AutoConfig.from_pretrained(base).vocab_size)
    (res,) = run_ranks(job_checkpoint, 1, out, base, batch, str(out))
    ids = torch.randint(0, AutoConfig.from_pretrained(base).vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    return {"base": base, "ckpt": str(out / "ckpt"), "hf": str(out / "hf"), "ids": ids, **res}


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


def load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def tensors(folder) -> dict:
    from safetensors.torch import load_file

    return {k: v for name in sorted(os.listdir(folder)) if name.endswith(".safetensors")
            for k, v in load_file(os.path.join(folder, name)).items()}


def cli(*args) -> int:
    from chatlearn.cli import main

    return main([*args])


@pytest.fixture(scope="module")
def adapter(setup, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("adapter") / "adapter")
    assert cli("merge", setup["ckpt"], out) == 0
    return out


@pytest.fixture(scope="module")
def merged(setup, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("merged") / "merged")
    assert cli("merge", setup["ckpt"], out, "--merged") == 0
    return out


def test_the_adapter_folder_is_peft_format_and_loads_onto_the_base(setup, adapter):
    from peft import PeftModel

    with open(os.path.join(adapter, "adapter_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["lora_dropout"] == 0.05
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    assert config["modules_to_save"] == ["model.norm"] and config["bias"] == "none"
    assert config["base_model_name_or_path"] == os.path.abspath(setup["base"]) and config["inference_mode"]
    saved = tensors(adapter)
    assert sorted(saved) == sorted(setup["adapter"])  # peft's names, as the trainer's export_adapter gives them
    for name, t in setup["adapter"].items():
        assert torch.equal(saved[name], t), name
    peft_model = PeftModel.from_pretrained(load(setup["base"]), adapter)
    trainer_merged = logits(load(setup["hf"]), setup["ids"])
    torch.testing.assert_close(logits(peft_model, setup["ids"]), trainer_merged, atol=1e-5, rtol=0)
    # the adapters moved the model: the base alone is far from it
    assert (logits(load(setup["base"]), setup["ids"]) - trainer_merged).abs().max() > 1e-3


def test_merged_folder_equals_peft_merge_and_unload(setup, adapter, merged):
    from peft import PeftModel

    reference = PeftModel.from_pretrained(load(setup["base"]), adapter).merge_and_unload()
    torch.testing.assert_close(logits(load(merged), setup["ids"]), logits(reference, setup["ids"]), atol=1e-5, rtol=0)
    ref_sd = reference.state_dict()
    for name, t in tensors(merged).items():
        assert t.dtype == torch.float32  # the base's dtype
        torch.testing.assert_close(t, ref_sd[name], atol=1e-6, rtol=0)
    assert not any("lora" in n or "base_layer" in n for n in tensors(merged))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(merged, name)), name
    assert not os.path.exists(os.path.join(merged, "adapter_config.json"))


def test_dtype_casts_the_merged_model(setup, tmp_path):
    assert cli("merge", setup["ckpt"], str(tmp_path / "bf16"), "--merged", "--dtype", "bfloat16") == 0
    assert {t.dtype for t in tensors(tmp_path / "bf16").values()} == {torch.bfloat16}


def test_eval_merges_the_adapter_folder_and_the_checkpoint_as_merge_does(setup, adapter, merged, tmp_path):
    from chatlearn.runtime.driver.evaluate import merge_for_eval, resolve_model

    expected = tensors(merged)
    for given in (adapter, setup["ckpt"]):
        model = resolve_model(given, str(tmp_path / "eval_merged"))
        assert model.merge_from is not None and model.adapter == (given == adapter)
        merge_for_eval(model, "auto", keep=True)
        got = tensors(model.folder)
        assert sorted(got) == sorted(expected)
        assert all(torch.equal(got[n], expected[n]) for n in expected), given
        shutil.rmtree(model.folder)


def _said(capsys) -> str:
    return " ".join(capsys.readouterr().err.split())


def test_a_moved_base_is_refused_and_found_with_base(setup, tmp_path, capsys):
    base = setup["base"]
    moved = str(tmp_path / "moved_base")
    os.rename(base, moved)
    try:
        assert cli("merge", setup["ckpt"], str(tmp_path / "a")) == 2
        said = _said(capsys)
        assert base in said and "--base DIR" in said and "Traceback" not in said, said
        assert not (tmp_path / "a").exists()
        assert cli("merge", setup["ckpt"], str(tmp_path / "b"), "--base", moved) == 0
        assert (tmp_path / "b" / "adapter_model.safetensors").is_file()
    finally:
        os.rename(moved, base)


def test_a_changed_base_is_refused(setup, tmp_path, capsys):
    other = str(tmp_path / "other")
    shutil.copytree(setup["base"], other)
    with open(os.path.join(other, "config.json"), encoding="utf-8") as f:
        conf = json.load(f)
    conf["rms_norm_eps"] = 1e-5
    with open(os.path.join(other, "config.json"), "w", encoding="utf-8") as f:
        json.dump(conf, f)
    assert cli("merge", setup["ckpt"], str(tmp_path / "out"), "--merged", "--base", other) == 2
    said = _said(capsys)
    assert other in said and "is not that model now" in said and "--base DIR" in said, said
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_an_adapter_folder_without_its_base_is_refused(setup, adapter, tmp_path):
    from chatlearn.checkpoint.adapters import merge_adapter_folder
    from chatlearn.errors import UserError

    lost = str(tmp_path / "lost")
    shutil.copytree(adapter, lost)
    with open(os.path.join(lost, "adapter_config.json"), encoding="utf-8") as f:
        conf = json.load(f)
    conf["base_model_name_or_path"] = str(tmp_path / "gone")
    with open(os.path.join(lost, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(conf, f)
    with pytest.raises(UserError) as err:
        merge_adapter_folder(lost, str(tmp_path / "m1"))
    assert str(tmp_path / "gone") in str(err.value) and "--base DIR" in str(err.value)
    merge_adapter_folder(lost, str(tmp_path / "m2"), base=setup["base"])  # --base finds it
    assert (tmp_path / "m2" / "model.safetensors").is_file()


def test_flags_that_do_not_apply_are_refused(setup, tmp_path, capsys):
    assert cli("merge", setup["ckpt"], str(tmp_path / "x"), "--hf-config", setup["base"]) == 2
    assert "--base DIR" in _said(capsys)
    assert "--merged" in cli_help(capsys) and "--base" in cli_help(capsys)


def test_eval_base_without_adapters_is_refused(setup, paths_overrides, capsys):
    from conftest import REPO

    template = os.path.join(REPO, "template", "grpo_fsdp.yaml")
    assert cli("eval", template, *paths_overrides, "--checkpoint", setup["hf"], "--base", setup["base"]) == 2
    said = _said(capsys)
    assert "--base names the base model of LoRA adapters" in said and "is a whole model" in said, said


def cli_help(capsys) -> str:
    with pytest.raises(SystemExit):
        cli("merge", "--help")
    return capsys.readouterr().out
