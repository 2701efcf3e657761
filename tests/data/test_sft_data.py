"""SFT data (chatlearn/data/sft.py): conversations rendered with the chat template, the loss mask on every
assistant turn (its content and its end-of-turn token, nothing of the other turns or of the headers), and the
refusals: no assistant turn, rows longer than sft.max_seq_len (refuse / truncate / drop), no messages field."""
from __future__ import annotations

import json

import numpy as np
import pytest

from chatlearn.data.dataset import load_tokenizer
from chatlearn.data.sft import load_sft
from chatlearn.errors import UserError

TOY = "assets/tiny_qwen2"


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _chat(*turns) -> dict:
    return {"messages": [{"role": role, "content": text} for role, text in turns]}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TOY, trust_remote_code=False, key="models.policy_trainer.load")


def _load(path, tokenizer, **kw):
    args = dict(messages_key="messages", max_seq_len=256, overlong="refuse", what="sft.data_path")
    return load_sft(path, tokenizer, **{**args, **kw})


def test_the_mask_covers_every_assistant_turn_and_its_end(tmp_path, tokenizer):
    rows = [_chat(("system", "add"), ("user", "1 + 2?"), ("assistant", "\\boxed{3}"), ("user", "and 2 + 2?"),
                  ("assistant", "\\boxed{4}"))]
    data = _load(_write(tmp_path / "d.jsonl", rows), tokenizer)
    ids, mask = data.tokens[0], data.loss_masks[0].astype(bool)
    text = tokenizer.apply_chat_template(rows[0]["messages"], tokenize=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids[mask]) == "\\boxed{3}<|im_end|>\\boxed{4}<|im_end|>"
    # the first assistant token starts the loss; the tokens between the turns are not trained
    assert data.prompt_lens[0] == int(np.argmax(mask)) > 0
    assert tokenizer.decode(ids[:data.prompt_lens[0]]).endswith("<|im_start|>assistant\n")
    batch = data.batch([0, 0])
    assert batch["offsets"].tolist() == [0, len(ids), 2 * len(ids)] and batch["loss_mask"].sum() == 2 * mask.sum()


def test_the_mask_is_the_same_with_the_transformers_tokenizer(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    rows = [_chat(("user", "5 + 6?"), ("assistant", "\\boxed{11}"), ("user", "7 + 1?"), ("assistant", "\\boxed{8}"))]
    path = _write(tmp_path / "d.jsonl", rows)
    ours, theirs = _load(path, tokenizer), _load(path, AutoTokenizer.from_pretrained(TOY))
    assert ours.tokens[0].tolist() == theirs.tokens[0].tolist()
    assert ours.loss_masks[0].tolist() == theirs.loss_masks[0].tolist()


def test_a_conversation_without_an_assistant_turn_is_refused_naming_its_line(tmp_path, tokenizer):
    rows = [_chat(("user", "1 + 1?"), ("assistant", "\\boxed{2}")), _chat(("user", "no answer"))]
    path = _write(tmp_path / "d.jsonl", rows)
    with pytest.raises(UserError, match=r"d\.jsonl:2: the conversation has no assistant turn \(1 such row"):
        _load(path, tokenizer)


def test_rows_longer_than_the_context_are_counted_and_refused_truncated_or_dropped(tmp_path, tokenizer):
    short, long = _chat(("user", "1 + 1?"), ("assistant", "\\boxed{2}")), _chat(("user", "9 " * 40),
                                                                              ("assistant", "\\boxed{9}"))
    mid = _chat(("user", "2 + 2?"), ("assistant", "\\boxed{4} " + "x" * 30))
    path = _write(tmp_path / "d.jsonl", [short, long, mid, long])
    limit = len(_load(_write(tmp_path / "s.jsonl", [short]), tokenizer).tokens[0]) + 4
    with pytest.raises(UserError, match=r"3 row\(s\) are longer than sft.max_seq_len .* the first .*d\.jsonl:2"):
        _load(path, tokenizer, max_seq_len=limit)
    cut = _load(path, tokenizer, max_seq_len=limit, overlong="truncate")
    # the long prompts leave no assistant token within the limit: dropped; the long answer is cut
    assert (len(cut), cut.truncated, cut.dropped) == (2, 3, 2)
    assert all(len(t) <= limit for t in cut.tokens) and cut.loss_masks[1].sum() > 0
    dropped = _load(path, tokenizer, max_seq_len=limit, overlong="drop")
    assert (len(dropped), dropped.dropped) == (1, 3)


def test_a_row_without_the_messages_field_is_refused(tmp_path, tokenizer):
    path = _write(tmp_path / "d.jsonl", [{"prompt": "1 + 1?"}])
    with pytest.raises(UserError, match=r"d\.jsonl:1: the row has no 'messages' field .* sft.messages_key"):
        _load(path, tokenizer)


def test_parquet_rows_through_the_same_data_layer(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_chat(("user", "3 + 4?"), ("assistant", "\\boxed{7}"))]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    data = _load(str(tmp_path / "d.parquet"), tokenizer)
    assert tokenizer.decode(data.tokens[0][data.loss_masks[0].astype(bool)]) == "\\boxed{7}<|im_end|>"
