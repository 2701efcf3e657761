"""examples/gsm8k/preprocess.py and examples/math/preprocess.py on tiny files in the public layouts.

The expected rows are written out by hand; the outputs must also load with chatlearn's data
loader and the example configs must load with them.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from chatlearn.data.dataset import load_prompts
from conftest import REPO

GSM8K = [{"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
          "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
         {"question": "A farm sells 1,200 eggs a day for 2 days. How many eggs?",
          "answer": "1,200 * 2 = <<1200*2=2400>>2,400\n#### 2,400"}]
GSM8K_TEST = [{"question": "What is 10 minus 12?", "answer": "10 - 12 = -2\n#### -2"}]
INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."

MATH_TRAIN = [{"problem": "Compute $\\frac{1}{2} + \\frac{1}{2}$.", "level": "Level 1", "type": "Prealgebra",
               "solution": "The sum is $\\boxed{1}$."},
              {"problem": "Simplify $\\sqrt{8}$.", "level": "Level 2", "type": "Algebra",
               "solution": "$\\sqrt{8} = \\boxed{2\\sqrt{2}}$."},
              {"problem": "A problem without a boxed answer.", "level": "Level 5", "type": "Algebra",
               "solution": "The answer is 3."}]
MATH_TEST = [{"problem": "Find $x$ if $2x = 1$.", "level": "Level 1", "type": "Algebra",
              "solution": "So $x = \\boxed{\\frac{1}{2}}$."}]


def run(script, *args):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", script, "preprocess.py"), *args],
                          capture_output=True, text=True, timeout=120)
    return proc


def read(path):
    if str(path).endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.mark.parametrize("layout", ["parquet", "jsonl"])
def test_gsm8k(tmp_path, layout):
    src = tmp_path / "gsm8k"
    if layout == "parquet":  # openai/gsm8k on the Hub: main/{train,test}-00000-of-00001.parquet
        write_parquet(str(src / "main" / "train-00000-of-00001.parquet"), GSM8K)
        write_parquet(str(src / "main" / "test-00000-of-00001.parquet"), GSM8K_TEST)
    else:  # the grade-school-math repository: data/{train,test}.jsonl
        write_jsonl(str(src / "data" / "train.jsonl"), GSM8K)
        write_jsonl(str(src / "data" / "test.jsonl"), GSM8K_TEST)
    out = tmp_path / "out"
    proc = run("gsm8k", "--input", str(src), "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    train, test = read(out / "train.jsonl"), read(out / "test.jsonl")
    assert [r["reward_model"]["ground_truth"] for r in train] == ["7", "2400"]
    assert [r["reward_model"]["ground_truth"] for r in test] == ["-2"]
    assert train[0] == {"data_source": "openai/gsm8k", "ability": "math",
                        "prompt": [{"role": "user", "content": GSM8K[0]["question"] + " " + INSTRUCTION}],
                        "reward_model": {"style": "rule", "ground_truth": "7"},
                        "extra_info": {"split": "train", "index": 0, "question": GSM8K[0]["question"],
                                       "answer": GSM8K[0]["answer"]}}
    assert train[1]["extra_info"]["index"] == 1 and test[0]["extra_info"]["split"] == "test"


def test_gsm8k_answer_without_final_line_is_an_error(tmp_path):
    write_jsonl(str(tmp_path / "in" / "train.jsonl"), [GSM8K[0], {"question": "q", "answer": "no marker"}])
    proc = run("gsm8k", "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"))
    assert proc.returncode == 2 and "train.jsonl:2" in proc.stderr and "####" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("layout", ["per-problem json", "jsonl", "parquet"])
def test_math(tmp_path, layout):
    src = tmp_path / "MATH"
    if layout == "per-problem json":  # hendrycks MATH: MATH/{train,test}/<type>/<n>.json
        for split, rows in (("train", MATH_TRAIN), ("test", MATH_TEST)):
            for i, row in enumerate(rows):
                folder = src / split / row["type"].lower()
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"{i}.json").write_text(json.dumps(row))
    elif layout == "jsonl":
        write_jsonl(str(src / "train.jsonl"), MATH_TRAIN)
        write_jsonl(str(src / "test.jsonl"), MATH_TEST)
    else:  # competition_math: data/{train,test}-00000-of-00001.parquet
        write_parquet(str(src / "data" / "train-00000-of-00001.parquet"), MATH_TRAIN)
        write_parquet(str(src / "data" / "test-00000-of-00001.parquet"), MATH_TEST)
    out = tmp_path / "out"
    proc = run("math", "--input", str(src), "--output", str(out), "--format", "parquet")
    assert proc.returncode == 0, proc.stderr
    assert "skipped 1 problems" in proc.stdout
    train, test = read(out / "train.parquet"), read(out / "test.parquet")
    assert sorted(r["reward_model"]["ground_truth"] for r in train) == ["1", "2\\sqrt{2}"]
    assert [r["reward_model"]["ground_truth"] for r in test] == ["\\frac{1}{2}"]
    row = next(r for r in train if r["reward_model"]["ground_truth"] == "1")
    assert row["prompt"] == [{"role": "user", "content": MATH_TRAIN[0]["problem"] + " " + INSTRUCTION}]
    assert row["data_source"] == "hendrycks/MATH"
    assert {k: row["extra_info"][k] for k in ("split", "level", "type")} == {
        "split": "train", "level": "Level 1", "type": "Prealgebra"}


def test_outputs_load_and_example_configs_accept_them(tmp_path, tiny_model_dir, monkeypatch):
    """Both outputs load with chatlearn's loader and the math reward scores the gold answers as correct."""
    from transformers import AutoTokenizer

    from chatlearn.config.load import load_config
    from chatlearn.models.reward.functions import RewardManager, resolve_entries
    from chatlearn.models.specs import RewardSpec

    write_jsonl(str(tmp_path / "g" / "train.jsonl"), GSM8K)
    write_jsonl(str(tmp_path / "m" / "test.jsonl"), MATH_TEST)
    assert run("gsm8k", "--input", str(tmp_path / "g"), "--output", str(tmp_path / "gout")).returncode == 0
    assert run("math", "--input", str(tmp_path / "m"), "--output", str(tmp_path / "mout")).returncode == 0
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    keys = {"prompt_key": "prompt", "ground_truth_key": "reward_model.ground_truth"}
    ps = load_prompts([str(tmp_path / "gout" / "train.jsonl"), str(tmp_path / "mout")], tok,
                      max_prompt_tokens=512, enable_thinking=False, **keys)
    assert ps.ground_truths == ["7", "2400", "\\frac{1}{2}"]
    assert ps.extras[0]["ability"] == "math" and ps.extras[0]["extra_info"]["index"] == 0
    rm = RewardManager(RewardSpec(functions=tuple(resolve_entries({"functions": [], "correct_score": 1.0,
                                                                   "incorrect_score": 0.0})),
                                  base_dir=None, timeout_s=0.0))
    gold = ["so \\boxed{7}", "\\boxed{2,400}", "\\boxed{0.5}"]
    assert rm.score([""] * 3, gold, ps.ground_truths, ps.data_sources, ps.extras)["score"].tolist() == [1, 1, 1]

    monkeypatch.chdir(REPO)
    # the examples' lengths (up to 1024 + 4096 tokens) on a copy of the tiny model with a Qwen2.5-sized context
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    conf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**conf, "max_position_embeddings": 32768}))
    tiny_model_dir = str(model)
    for name in ("gsm8k", "math"):
        out = tmp_path / "gout" if name == "gsm8k" else tmp_path / "mout"
        cfg = load_config(f"examples/{name}/grpo_{name}.yaml", [
            f"models.policy_trainer.load={tiny_model_dir}", f"runtime_args.data_path={out}",
            f"runtime_args.eval_data_path={out}", f"runtime_args.output_dir={tmp_path / 'run'}",
            "runtime_args.rollout_backend=hf"])
        assert cfg.models.policy_trainer.load == tiny_model_dir
    with open(os.path.join(REPO, "examples", "gsm8k", "grpo_gsm8k.yaml"), encoding="utf-8") as f:
        text = f.read()
    # the model and the data are Hub ids; the header says how to use the preprocessed files instead
    assert "load: Qwen/Qwen2.5-0.5B-Instruct" in text and "data_path: openai/gsm8k" in text
    assert "examples/gsm8k/preprocess.py" in text and "runtime_args.prompt_key=prompt" in text
