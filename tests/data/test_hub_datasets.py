"""Hub dataset ids in data_path (config name, split, column mapping) from a Hugging Face cache built
offline, and the tokenized-prompt cache (datasets' fingerprinting)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from chatlearn.cli import main
from chatlearn.data.dataset import TOKENIZED_CACHE, load_prompts
from chatlearn.errors import UserError
from conftest import REPO
from hub_cache import add_dataset, commit_of, gsm_rows

TEMPLATE = "template/grpo_fsdp.yaml"
GSM = dict(prompt_key="question", ground_truth_key="answer", ground_truth_pattern=r"####\s*(-?[0-9.,]+)")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline Hugging Face cache (HF_HOME=<tmp>/hf) holding acme/gsm-tiny (configs main and other)."""
    import datasets
    from huggingface_hub import constants

    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", Path(home / "datasets"))
    monkeypatch.chdir(REPO)
    add_dataset(str(home / "hub"), "acme/gsm-tiny",
                {"main": {"train": gsm_rows(12), "test": gsm_rows(4, start=50)},
                 "other": {"train": [{"question": "Q?", "answer": "#### 1"}]}})
    return home


@pytest.fixture
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_hub_dataset_with_subset_split_and_column_mapping(hub, tokenizer):
    ps = load_prompts(["acme/gsm-tiny"], tokenizer, max_prompt_tokens=256, enable_thinking=False, name="main",
                      split="train", prompt_instruction="Answer in \\boxed{}.", **GSM)
    assert len(ps) == 12 and ps.dropped_too_long == 0
    assert ps.ground_truths[:3] == ["0", "8", "6"]  # the number after ####, not the whole answer
    assert ps.data_sources[0] == "acme/gsm-tiny" and ps.extras[0] == {}
    text = tokenizer.decode(ps.prompt_ids[1])
    assert "What is 1 + 7? Answer in \\boxed{}." in text and "<|im_start|>assistant" in text
    test = load_prompts(["acme/gsm-tiny"], tokenizer, max_prompt_tokens=256, enable_thinking=False, name="main",
                        split="test", **GSM)
    assert len(test) == 4


def test_config_pins_the_dataset_to_its_commit(hub, tiny_model_dir, tmp_path):
    from chatlearn.config.load import load_config

    cfg = load_config(TEMPLATE, [f"models.policy_trainer.load={tiny_model_dir}",
                                 "runtime_args.data_path=acme/gsm-tiny", "runtime_args.eval_data_path=acme/gsm-tiny",
                                 "runtime_args.data_subset=main", f"runtime_args.output_dir={tmp_path / 'out'}"])
    pinned = f"acme/gsm-tiny@{commit_of('acme/gsm-tiny')}"
    assert cfg.runtime_args.data_path == pinned and cfg.runtime_args.eval_data_path == pinned
    assert cfg.runtime_args.eval_data_subset == "main" and cfg.runtime_args.eval_data_split == "test"


@pytest.mark.parametrize("overrides, words", [
    (["runtime_args.data_path=acme/gsm-tiny"],
     ["runtime_args.data_subset", "has several subsets (configs): main, other"]),
    (["runtime_args.data_path=data/missing.jsonl"], ["path 'data/missing.jsonl' does not exist"]),
    (["runtime_args.data_path=acme/gsm-tiny", "runtime_args.data_subset=nope"],
     ["runtime_args.data_subset", "has no subset 'nope'; its subsets (configs) are main, other"]),
    (["runtime_args.data_path=acme/gsm-tiny", "runtime_args.data_subset=main", "runtime_args.data_split=validation"],
     ["runtime_args.data_split", "no split 'validation'", "train, test"]),
    (["runtime_args.data_path=acme/missing"],
     ["runtime_args.data_path", "'acme/missing' is not a local path", "Hugging Face Hub dataset 'acme/missing'",
      "HF_HUB_OFFLINE=1", "hf download acme/missing --repo-type dataset"]),
    (["runtime_args.ground_truth_pattern='####(('"], ["runtime_args.ground_truth_pattern", "not a valid regular"]),
])
def test_dataset_errors_are_one_paragraph_at_dry_run(hub, tiny_model_dir, tmp_path, overrides, words, capsys):
    argv = ["run", TEMPLATE, f"models.policy_trainer.load={tiny_model_dir}",
            f"runtime_args.output_dir={tmp_path / 'o'}",
            "runtime_args.eval_episode_interval=0", "runtime_args.enable_eval_before_training=false", *overrides,
            "--dry-run"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "\n\n" not in err.strip()
    flat = " ".join(err.split())
    for w in words:
        assert w in flat, (w, flat)


def test_a_ground_truth_the_pattern_misses_names_the_row(hub, tokenizer):
    with pytest.raises(UserError, match=r"acme/gsm-tiny \(other, split train\) row 1: .*does not match"):
        load_prompts(["acme/gsm-tiny"], tokenizer, max_prompt_tokens=256, enable_thinking=False, name="other",
                     split="train", prompt_key="question", ground_truth_key="answer",
                     ground_truth_pattern=r"answer: (\d+)")


def test_tokenized_prompts_are_cached_by_fingerprint(hub, tokenizer, tmp_path, monkeypatch):
    """A second load of the same prompts with the same tokenizer reads the cache file; a changed chat
    template or other prompts are tokenized again."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "reward_model": {"ground_truth": str(i + 1)}})
                            + "\n" for i in range(20)))
    calls = []
    real = tokenizer.apply_chat_template
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: calls.append(1) or real(*a, **k))
    keys = dict(max_prompt_tokens=256, enable_thinking=False, prompt_key="prompt",
                ground_truth_key="reward_model.ground_truth")
    first = load_prompts([str(path)], tokenizer, **keys)
    assert len(calls) == 20
    cache = hub / "datasets" / TOKENIZED_CACHE
    assert len([f for f in os.listdir(cache) if f.endswith(".npz")]) == 1
    second = load_prompts([str(path)], tokenizer, **keys)
    assert len(calls) == 20  # nothing tokenized again
    assert second.prompt_ids == first.prompt_ids and second.ground_truths == first.ground_truths
    # the same prompts through a Hub dataset are another cache entry only if their text differs
    tokenizer.chat_template = tokenizer.chat_template + " "
    third = load_prompts([str(path)], tokenizer, **keys)
    assert len(calls) == 40 and len(os.listdir(cache)) >= 2
    assert third.prompt_ids[0][:-1] == first.prompt_ids[0]
    load_prompts([str(path)], tokenizer, **{**keys, "enable_thinking": True})
    assert len(calls) == 60


def test_an_empty_data_folder_is_refused_at_dry_run(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no data here\n")
    assert main(["run", TEMPLATE, f"models.policy_trainer.load={tiny_model_dir}",
                 f"runtime_args.data_path={tmp_path / 'empty'}", f"runtime_args.output_dir={tmp_path / 'o'}",
                 "runtime_args.eval_episode_interval=0", "runtime_args.enable_eval_before_training=false",
                 "--dry-run"]) == 2
    flat = " ".join(capsys.readouterr().err.split())
    assert "runtime_args.data_path: data folder" in flat and "holds no .jsonl, .json or .parquet file" in flat
