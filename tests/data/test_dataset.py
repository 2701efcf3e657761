"""Data loading: ChatLearn rows, chat template, long prompts dropped, errors name file and line."""
from __future__ import annotations

import json

import pytest

from chatlearn.data.dataset import PromptSampler, load_prompts
from chatlearn.errors import UserError


KEYS = {"prompt_key": "prompt", "ground_truth_key": "reward_model.ground_truth"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_rows_are_templated_and_long_prompts_dropped(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    rows = [{"data_source": "a", "prompt": [{"role": "user", "content": "What is 1 + 2?"}],
             "reward_model": {"ground_truth": "3"}},
            {"data_source": "b", "prompt": "plain string prompt", "reward_model": {"ground_truth": "x"}},
            {"prompt": [{"role": "user", "content": "9 " * 200}], "reward_model": {"ground_truth": "0"}}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    ps = load_prompts([str(path)], tokenizer, max_prompt_tokens=64, enable_thinking=False, **KEYS)
    assert len(ps) == 2 and ps.dropped_too_long == 1
    assert ps.ground_truths == ["3", "x"] and ps.data_sources == ["a", "b"]
    expected = tokenizer.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(ps.prompt_ids[0]) == expected


def test_parquet_and_folder(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "folder"
    d.mkdir()
    table = pa.Table.from_pylist([{"data_source": "p", "prompt": [{"role": "user", "content": "hi"}],
                                   "reward_model": {"ground_truth": "1"}}] * 3)
    pq.write_table(table, d / "part.parquet")
    ps = load_prompts([str(d)], tokenizer, max_prompt_tokens=64, enable_thinking=False, **KEYS)
    assert len(ps) == 3 and ps.data_sources == ["p"] * 3


@pytest.mark.parametrize("content, words", [
    ('{"prompt": "ok", "reward_model": {"ground_truth": "1"}}\n{"prompt": oops}\n', [":2:", "malformed JSON"]),
    ('{"question": "no prompt"}\n', [":1:", "no 'prompt' field"]),
    ('', ["bad.jsonl' is empty (no rows)"]),
    ('{"prompt": "' + "9 " * 300 + '", "reward_model": {"ground_truth": "1"}}\n', ["no usable prompts", "longer than"]),
    ('{"prompt": "ok", "reward_model": {"style": "rule"}}\n', [":1:", "no 'reward_model.ground_truth' field",
                                                                "style", "runtime_args.ground_truth_key"]),
    ('{"prompt": "ok", "reward_model": "3"}\n', [":1:", "'reward_model' must be an object", "not a str"]),
])
def test_data_errors_name_file_and_line(tmp_path, tokenizer, content, words):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UserError) as info:
        load_prompts([str(path)], tokenizer, max_prompt_tokens=64, enable_thinking=False, **KEYS)
    for w in words:
        assert w in str(info.value)


def test_sampler_is_seeded_epochwise_and_resumable():
    a = PromptSampler(10, shuffle=True, seed=3)
    first = a.next(7)
    state = a.state_dict()
    rest = a.next(9)
    assert sorted(first + rest[:3]) == list(range(10))  # one full epoch before repeating
    b = PromptSampler(10, shuffle=True, seed=3)
    b.load_state_dict(state)
    assert b.next(9) == rest
    assert PromptSampler(5, shuffle=False, seed=0).next(7) == [0, 1, 2, 3, 4, 0, 1]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_and_parquet_mixed_with_keys_and_extra_columns(tmp_path, tokenizer):
    """Comma-separated files of both kinds, a custom prompt column (text or chat messages), a custom
    ground-truth column, and the other columns carried as ``extras``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    j = write_jsonl(tmp_path / "a.jsonl", [
        {"question": "What is 1 + 2?", "answer": "3", "data_source": "j", "level": 1, "meta": {"id": "a0"}},
        {"question": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
         "answer": "4", "level": 2, "meta": {"id": "a1"}}])
    pq.write_table(pa.Table.from_pylist([{"question": "5 + 5?", "answer": "10", "data_source": "p", "level": 3,
                                          "meta": {"id": "p0"}}]), tmp_path / "b.parquet")
    ps = load_prompts([j, str(tmp_path / "b.parquet")], tokenizer, max_prompt_tokens=64, enable_thinking=False,
                      prompt_key="question", ground_truth_key="answer")
    assert len(ps) == 3 and ps.ground_truths == ["3", "4", "10"]
    assert ps.data_sources == ["j", "a.jsonl", "p"]  # a row without data_source is named after its file
    assert ps.extras == [{"level": 1, "meta": {"id": "a0"}}, {"level": 2, "meta": {"id": "a1"}},
                         {"level": 3, "meta": {"id": "p0"}}]
    # the reference: the tokenizer's own template on the same messages
    messages = [[{"role": "user", "content": "What is 1 + 2?"}],
                [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
                [{"role": "user", "content": "5 + 5?"}]]
    for ids, m in zip(ps.prompt_ids, messages):
        assert ids == list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False))


def test_no_ground_truth_key_and_dropped_count(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "short"}, {"prompt": "9 " * 100}, {"prompt": "9 " * 200},
                                              {"prompt": "also short", "reward_model": {"ground_truth": "1"}}])
    ps = load_prompts([path], tokenizer, max_prompt_tokens=64, enable_thinking=False, prompt_key="prompt",
                      ground_truth_key=None)
    assert len(ps) == 2 and ps.dropped_too_long == 2 and ps.ground_truths == [None, None]
    assert ps.extras == [{}, {"reward_model": {"ground_truth": "1"}}]


def test_enable_thinking_reaches_the_template(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and enable_thinking %} think{% else %} nothink{% endif %}")
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "q", "reward_model": {"ground_truth": "1"}}])
    for flag, text in ((True, "q think"), (False, "q nothink")):
        ps = load_prompts([path], tok, max_prompt_tokens=64, enable_thinking=flag, **KEYS)
        assert tok.decode(ps.prompt_ids[0]) == text


def test_malformed_line_in_the_second_file_names_it(tmp_path, tokenizer):
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "ok", "reward_model": {"ground_truth": "1"}}])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok", "reward_model": {"ground_truth": "1"}}\n\n{"prompt": "x",\n')
    with pytest.raises(UserError) as info:
        load_prompts([good, str(bad)], tokenizer, max_prompt_tokens=64, enable_thinking=False, **KEYS)
    assert f"{bad}:3: malformed JSON" in str(info.value)


def test_template_prompt_key_follows_vllm_prompt_key(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    from chatlearn.config.load import load_config
    from conftest import REPO

    monkeypatch.chdir(REPO)

    train, _ = arith_data
    base = [f"models.policy_trainer.load={tiny_model_dir}", f"runtime_args.data_path={train}",
            f"runtime_args.output_dir={tmp_path}", "runtime_args.rollout_backend=hf",
            "runtime_args.enable_eval_before_training=False", "runtime_args.eval_episode_interval=0"]
    assert load_config("template/grpo_fsdp.yaml", base).runtime_args.prompt_key == "prompt"
    cfg = load_config("template/grpo_fsdp.yaml", base + ["models.policy.vllm_prompt_key=question"])
    assert cfg.runtime_args.prompt_key == "question"
    cfg = load_config("template/grpo_fsdp.yaml", base + ["runtime_args.prompt_key=q2"])
    assert cfg.runtime_args.prompt_key == "q2"
