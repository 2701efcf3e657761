"""Supervised fine-tuning data: conversations (``messages: [{role, content}, ...]``) rendered with the model's
chat template, with a mask of the tokens the loss covers: every assistant turn's.

Rows come through the same data layer as the prompts (:mod:`chatlearn.data.dataset`: JSONL, JSON, parquet
files or folders, or a Hub dataset id through ``datasets``). The mask is found by rendering prefix by prefix
(as TRL's and verl's multi-turn SFT datasets do where the template has no ``{% generation %}`` markers):
for assistant turn k, its tokens are those between the ids of ``messages[:k]`` rendered with the generation
prompt and the ids of ``messages[:k + 1]``, cut after the turn's end-of-turn token (``eos_token``) where it has
one, so the model learns to stop and nothing of the next turn's header is trained. That works with any chat
template whose renderings of a conversation's prefixes are prefixes of its rendering (every ChatML-style
template); one that is not is refused with the row. transformers' ``return_assistant_tokens_mask`` needs
``{% generation %}`` markers in the template, which few models' templates have, and is not used.

A sample is ``(tokens, prompt_len, loss_mask)``: ``prompt_len`` the index of its first assistant token (the
trainers' forward computes log-probs from there on) and ``loss_mask`` 1 on the assistant tokens; a batch of
them has the columns a multi-turn rollout's batch has (``tokens``, ``offsets``, ``prompt_lens``,
``loss_mask``), so the trainers' micro-batching, packing and forward are the RL ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from chatlearn.config.data_sources import resolve_data_sources
from chatlearn.data.dataset import list_data_files, read_hub_rows, read_rows
from chatlearn.errors import UserError

OVERLONG = ("refuse", "truncate", "drop")


@dataclass
class SFTSet:
    """Tokenized conversations, one entry per sample, and what loading counted."""

    tokens: list[np.ndarray] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)
    loss_masks: list[np.ndarray] = field(default_factory=list)
    wheres: list[str] = field(default_factory=list)
    truncated: int = 0  # rows cut to max_seq_len (overlong: truncate)
    dropped: int = 0  # rows left out: longer than max_seq_len (overlong: drop), or no assistant token left

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def loss_tokens(self) -> int:
        return int(sum(int(m.sum()) for m in self.loss_masks))

    def batch(self, rows) -> dict:
        """The batch of samples ``rows`` (indices): ``tokens``, ``offsets``, ``prompt_lens``, ``loss_mask``."""
        rows = [int(r) for r in rows]
        lens = [len(self.tokens[r]) for r in rows]
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        return {"tokens": np.concatenate([self.tokens[r] for r in rows]).astype(np.int64),
                "offsets": offsets, "prompt_lens": np.asarray([self.prompt_lens[r] for r in rows], np.int64),
                "loss_mask": np.concatenate([self.loss_masks[r] for r in rows]).astype(np.int32)}


def _ids(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def _eos_id(tokenizer) -> int | None:
    eos = getattr(tokenizer, "eos_token", None)
    if not isinstance(eos, str) or not eos:
        return None
    ids = tokenizer.encode(eos, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def _check_messages(messages, where: str, key: str) -> list[dict]:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise UserError(f"{where}: {key!r} must be a non-empty list of chat messages ({{'role': '...', 'content': "
                        "'...'}, roles such as system, user, assistant); fix that row.", key="sft.messages_key")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def render(tokenizer, messages: list[dict], where: str, eos: int | None) -> tuple[list[int], np.ndarray]:
    """The ids of the conversation and its loss mask (1 on every assistant turn's tokens), by prefixes."""
    full = _ids(tokenizer, messages, False)
    mask = np.zeros(len(full), np.int32)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head, upto = _ids(tokenizer, messages[:k], True), _ids(tokenizer, messages[:k + 1], False)
        if full[:len(upto)] != upto or upto[:len(head)] != head:
            raise UserError(f"{where}: the chat template does not render this conversation's turns as prefixes of "
                            f"one another (message {k + 1} changes the text before it), so its assistant tokens "
                            "cannot be told apart. Use a template that renders earlier turns alike whatever follows "
                            "(ChatML-style templates do), or drop the row.")
        turn = upto[len(head):]
        if eos is not None and eos in turn:  # the end of turn is the model's to learn; what follows it is not
            turn = turn[:len(turn) - turn[::-1].index(eos)]
        mask[len(head):len(head) + len(turn)] = 1
    return full, mask


def _rows(paths: str, what: str, name: str | None, split: str):
    for source in resolve_data_sources(paths, what, name=name, split=split):
        if source.hub_id:
            yield from read_hub_rows(source, name=name, split=split)
        else:
            for path in list_data_files([source.path]):
                yield from read_rows(path)


def load_sft(paths: str, tokenizer, *, messages_key: str, max_seq_len: int, overlong: str, what: str,
             name: str | None = None, split: str = "train") -> SFTSet:
    """Every row of ``paths`` (comma-separated) rendered (:func:`render`). A row without an assistant turn is
    refused (one paragraph naming the first such row and counting them); rows longer than ``max_seq_len``
    tokens are refused (``overlong: refuse``, counted, the first named), cut to ``max_seq_len``
    (``truncate``; a row left without an assistant token is dropped) or dropped (``drop``)."""
    out, eos = SFTSet(), _eos_id(tokenizer)
    no_assistant, too_long = [], []
    for row, where in _rows(paths, what, name, split):
        if messages_key not in row:
            raise UserError(f"{where}: the row has no {messages_key!r} field (it has: {', '.join(sorted(row)) or 'nothing'}). "
                            "SFT data holds conversations: add it, or set sft.messages_key to the field that holds "
                            "the messages.", key="sft.messages_key")
        messages = _check_messages(row[messages_key], where, messages_key)
        if not any(m["role"] == "assistant" for m in messages):
            no_assistant.append(where)
            continue
        ids, mask = render(tokenizer, messages, where, eos)
        if len(ids) > max_seq_len:
            too_long.append((where, len(ids)))
            if overlong == "drop":
                out.dropped += 1
                continue
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
            out.truncated += 1
        first = int(np.argmax(mask)) if mask.any() else -1
        if first < 1:  # nothing of an assistant turn left, or no token before it to predict it from
            out.dropped += 1
            continue
        out.tokens.append(np.asarray(ids, np.int64))
        out.prompt_lens.append(first)
        out.loss_masks.append(mask)
        out.wheres.append(where)
    _refuse(out, no_assistant, too_long, what, max_seq_len, overlong)
    return out


def _refuse(out: SFTSet, no_assistant: list, too_long: list, what: str, max_seq_len: int, overlong: str) -> None:
    if no_assistant:
        raise UserError(f"{what}: {no_assistant[0]}: the conversation has no assistant turn "
                        f"({len(no_assistant)} such row(s)); supervised fine-tuning learns the assistant's tokens "
                        "only, so the row teaches nothing. Add the assistant's reply (a message with role "
                        "'assistant'), or remove those rows.", key=what)
    if too_long and overlong == "refuse":
        where, n = too_long[0]
        raise UserError(f"{what}: {len(too_long)} row(s) are longer than sft.max_seq_len ({max_seq_len} tokens), the "
                        f"first {where} ({n} tokens). Raise sft.max_seq_len, or set sft.overlong to truncate (cut "
                        "them to max_seq_len) or drop (leave them out).", key="sft.overlong")
    if not out.tokens:
        raise UserError(f"{what}: no usable conversations ({out.dropped} dropped: longer than sft.max_seq_len "
                        f"{max_seq_len}, or with no assistant token within it). Raise sft.max_seq_len, or add data.",
                        key=what)
