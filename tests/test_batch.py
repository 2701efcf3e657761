"""chatlearn.batch: every column declared once; selecting and joining samples go by the declaration."""
from __future__ import annotations

import numpy as np
import pytest

from chatlearn.batch import (COLUMNS, SAMPLE, TOKEN, UndeclaredColumn, check, column, columns, concat_batches,
                             select_samples, token_columns)


def batch3() -> dict:
    """3 samples of 2, 3 and 4 tokens (prompts of 1 token), every declared kind of column."""
    lens = np.array([2, 3, 4])
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    t = int(offsets[-1])
    return {"tokens": np.arange(10, 10 + t, dtype=np.int64), "offsets": offsets,
            "prompt_lens": np.ones(3, np.int64), "rollout_logprobs": -np.arange(t, dtype=np.float32),
            "loss_mask": np.ones(t, np.uint8), "finish_reasons": np.array([1, 0, 1], np.int8),
            "advantages": np.array([0.5, -0.5, 0.0], np.float32), "env/turns": np.array([1, 2, 3])}


def test_every_column_declares_what_it_is():
    for name, col in COLUMNS.items():
        assert col.name == name and col.per in (SAMPLE, TOKEN, "index") and col.kind and col.writer and col.doc
    assert set(token_columns()) == {"tokens", "rollout_logprobs", "old_logprobs", "ref_logprobs", "loss_mask",
                                    "routed_experts", "teacher_logprobs", "teacher_top1", "teacher_topk_logprobs",
                                    "teacher_topk_ids",
                                    "values", "returns", "token_advantages"}
    assert column("env/anything").per == SAMPLE


def test_selection_slices_per_token_columns_by_the_samples_tokens():
    b = batch3()
    out = select_samples(b, [2, 0])
    assert out["offsets"].tolist() == [0, 4, 6]
    assert out["tokens"].tolist() == [15, 16, 17, 18, 10, 11]
    assert out["rollout_logprobs"].tolist() == [-5, -6, -7, -8, 0, -1]
    assert out["advantages"].tolist() == [0.0, 0.5] and out["env/turns"].tolist() == [3, 1]
    check(out)
    joined = concat_batches([out, b])
    assert joined["offsets"].tolist() == [0, 4, 6, 8, 11, 15]
    assert joined["tokens"].tolist() == out["tokens"].tolist() + b["tokens"].tolist()
    check(joined)


def test_an_undeclared_column_is_an_error_where_a_batch_is_cut_or_joined():
    b = {**batch3(), "q_values": np.zeros(9, np.float32)}  # a per-token column nobody declared
    with pytest.raises(UndeclaredColumn, match="'q_values' is not declared in chatlearn/batch.py"):
        select_samples(b, [0])
    with pytest.raises(UndeclaredColumn):
        concat_batches([b, b])
    with pytest.raises(UndeclaredColumn):
        check(b)


def test_check_refuses_a_wrong_length_or_kind():
    b = batch3()
    with pytest.raises(ValueError, match="'advantages' .sample. has 2 entries, not 3"):
        check({**b, "advantages": np.zeros(2, np.float32)})
    with pytest.raises(TypeError, match="'tokens' has dtype kind 'f'"):
        check({**b, "tokens": b["tokens"].astype(np.float32)})


def test_columns_takes_what_the_batch_holds_with_its_offsets():
    b = batch3()
    got = columns(b, ("tokens", "old_logprobs", "prompt_lens"))
    assert list(got) == ["offsets", "tokens", "prompt_lens"] and got["tokens"] is b["tokens"]
