"""Data loading: ChatLearn rows, chat template, long prompts dropped, errors name file and line."""
from __future__ import annotations

import json

import pytest

from chatlearn.data.dataset import PromptSampler, load_prompts
from chatlearn.errors import UserError


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
    ps = load_prompts([str(path)], tokenizer, max_prompt_tokens=64, enable_thinking=False)
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
    ps = load_prompts([str(d)], tokenizer, max_prompt_tokens=64, enable_thinking=False)
    assert len(ps) == 3 and ps.data_sources == ["p"] * 3


@pytest.mark.parametrize("content, words", [
    ('{"prompt": "ok", "reward_model": {"ground_truth": "1"}}\n{"prompt": oops}\n', [":2:", "malformed JSON"]),
    ('{"question": "no prompt"}\n', [":1:", "no 'prompt' field"]),
    ('', ["no usable prompts", "no rows"]),
    ('{"prompt": "' + "9 " * 300 + '"}\n', ["no usable prompts", "longer than"]),
])
def test_data_errors_name_file_and_line(tmp_path, tokenizer, content, words):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(UserError) as info:
        load_prompts([str(path)], tokenizer, max_prompt_tokens=64, enable_thinking=False)
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
