"""Prompt data: ChatLearn's jsonl/parquet rows, chat templates, and a resumable sampler.

A row looks like::

    {"data_source": "gsm8k",
     "prompt": [{"role": "user", "content": "..."}],          # chat messages (or a string)
     "reward_model": {"style": "rule", "ground_truth": "42"}}
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from chatlearn.errors import UserError

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


def list_data_files(paths: list[str]) -> list[str]:
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(DATA_SUFFIXES))
            if not found:
                raise UserError(f"data folder {path!r} holds no .jsonl, .json or .parquet file. "
                                "Put the data files there or point the data path at the files.")
            files += found
        else:
            files.append(path)
    return files


def read_rows(path: str) -> list[tuple[dict, str]]:
    """Rows of one file, each with where it came from ("file:line") for error messages."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as err:  # pyarrow raises several types for a bad file
            raise UserError(f"cannot read parquet file {path!r}: {_brief(err).rstrip('.')}. Check that it is a valid "
                            "parquet file.")
        return [(row, f"{path}:row {i + 1}") for i, row in enumerate(table.to_pylist())]
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise UserError(f"{path}:{lineno}: malformed JSON ({err.msg} at column {err.colno}). "
                                    "Each line of a .jsonl file must be one JSON object; fix or remove that line.")
                if not isinstance(row, dict):
                    raise UserError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}. "
                                    "Each line must be an object with a 'prompt' field.")
                rows.append((row, f"{path}:{lineno}"))
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read data file {path!r}: {err}. Check the path and that it is UTF-8 text.")
    return rows


def _brief(err: Exception, limit: int = 300) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " (...)"


def load_tokenizer(path: str, *, trust_remote_code: bool, key: str):
    """The tokenizer of a Hugging Face model folder; a folder without a usable one is a user error."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises OSError, ValueError, JSONDecodeError, ... for a bad folder
        raise UserError(f"cannot load a tokenizer from {path!r}: {_brief(err)}. Point it at a "
                        "model folder that holds the tokenizer files (tokenizer.json or the tokenizer's vocabulary "
                        "files, tokenizer_config.json).", key=key) from err
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"the tokenizer in {path!r} has no chat template, and prompts are formatted with it. Add "
                        "one to the folder (chat_template.jinja, or chat_template in tokenizer_config.json), or "
                        "use the folder of the model's instruct/chat version.", key=key)
    return tokenizer


@dataclass
class PromptSet:
    """Tokenized prompts plus what the reward needs, one entry per prompt."""

    prompt_ids: list[list[int]]
    ground_truths: list  # the value at ground_truth_key (None when it is null)
    data_sources: list[str]
    dropped_too_long: int
    extras: list[dict] = field(default_factory=list)  # the row's other columns (given to reward functions)

    def __len__(self) -> int:
        return len(self.prompt_ids)


def _ground_truth(row: dict, key: str, where: str):
    """``row`` at the dotted path ``key`` (e.g. ``reward_model.ground_truth``); a missing field is a UserError."""
    value, walked = row, []
    for part in key.split("."):
        if not isinstance(value, dict):
            raise UserError(f"{where}: {'.'.join(walked)!r} must be an object such as "
                            f"{{\"{part}\": \"42\"}} holding the ground truth ({key}), not a "
                            f"{type(value).__name__}; fix that row, or set runtime_args.ground_truth_key.")
        if part not in value:
            raise UserError(f"{where}: the row has no {key!r} field (the ground truth; at {part!r} it has: "
                            f"{', '.join(sorted(map(str, value))) or 'nothing'}). Add it, or set "
                            "runtime_args.ground_truth_key to the field holding the answer (null if the reward "
                            "needs none).")
        value = value[part]
        walked.append(part)
    return value


def load_prompts(paths: list[str], tokenizer, *, max_prompt_tokens: int, enable_thinking: bool,
                 prompt_key: str, ground_truth_key: str | None,
                 what: str = "runtime_args.data_path") -> PromptSet:
    """Read every row, apply the chat template to ``row[prompt_key]`` (a string becomes one user message;
    ``enable_thinking`` is passed to the template) and drop prompts longer than ``max_prompt_tokens``.
    ``extras`` keeps each row without the prompt, ``data_source`` and ground-truth columns (the first
    part of ``ground_truth_key``)."""
    ids, truths, sources, extras = [], [], [], []
    dropped = 0
    taken = {prompt_key, "data_source"} | ({ground_truth_key.split(".")[0]} if ground_truth_key else set())
    for path in list_data_files(paths):
        for row, where in read_rows(path):
            if prompt_key not in row:
                raise UserError(f"{where}: the row has no {prompt_key!r} field (it has: "
                                f"{', '.join(sorted(row)) or 'nothing'}). Add it, or set the prompt key "
                                "(runtime_args.prompt_key) to the field holding the prompt.")
            prompt = row[prompt_key]
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, list))
                    for m in messages):
                raise UserError(f"{where}: {prompt_key!r} must be a string or a non-empty list of chat messages "
                                "({'role': '...', 'content': '...'}); fix that row.")
            truth = _ground_truth(row, ground_truth_key, where) if ground_truth_key else None
            try:
                token_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          enable_thinking=enable_thinking)
            except Exception as err:  # the template is user code (jinja): any error is about the data or it
                raise UserError(f"{where}: the tokenizer's chat template fails on this row: "
                                f"{type(err).__name__}: {_brief(err)}. Fix the row, or give the "
                                "model folder a chat template (chat_template.jinja or tokenizer_config.json) that "
                                "accepts it.") from err
            if hasattr(token_ids, "keys"):  # some tokenizers return a BatchEncoding
                token_ids = token_ids["input_ids"]
            if len(token_ids) > max_prompt_tokens:
                dropped += 1
                continue
            ids.append(list(token_ids))
            truths.append(truth)
            sources.append(str(row.get("data_source", os.path.basename(path))))
            extras.append({k: v for k, v in row.items() if k not in taken})
    if not ids:
        reason = (f"all {dropped} prompts are longer than models.policy.max_prompt_tokens_length "
                  f"({max_prompt_tokens}); raise it" if dropped else "the files hold no rows; add data")
        raise UserError(f"{what}: no usable prompts: {reason}.")
    return PromptSet(ids, truths, sources, dropped, extras)


class PromptSampler:
    """Endless, epoch-wise shuffled order over a prompt set; its state can be saved and restored."""

    def __init__(self, size: int, *, shuffle: bool, seed: int):
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self.epoch, self.pos = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.size)
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.size)

    def next(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.pos == self.size:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._make_order()
            take = min(k - len(out), self.size - self.pos)
            out += self._order[self.pos:self.pos + take].tolist()
            self.pos += take
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "size": self.size, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._order = self._make_order()
