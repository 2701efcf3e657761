"""Prompt data: ChatLearn's jsonl/parquet rows or a Hugging Face Hub dataset, chat templates, and a
resumable sampler.

A row of ChatLearn's format looks like::

    {"data_source": "gsm8k",
     "prompt": [{"role": "user", "content": "..."}],          # chat messages (or a string)
     "reward_model": {"style": "rule", "ground_truth": "42"}}

A data path is a local file or folder (read as today, errors name the file and line) or a Hub
dataset id (``openai/gsm8k``, ``org/name@revision``), read with ``datasets.load_dataset`` with a
config name and a split; ``prompt_key``/``ground_truth_key`` then name its columns. Prompts are
tokenized with ``datasets.Dataset.map`` into a cache file named by a ``datasets`` fingerprint of
the prompts and the tokenizer, so a rerun on the same data does not tokenize again.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field

import numpy as np

# the data path's entries are checked and resolved in the config layer (validation runs it)
from chatlearn.config.data_sources import DATA_SUFFIXES, DataSource, resolve_data_sources
from chatlearn.config.data_sources import brief as _brief
from chatlearn.config.data_sources import datasets_offline as _offline
from chatlearn.config.data_sources import quiet_datasets as _quiet_datasets
from chatlearn.data.tokenizer import fast_tokenizer
from chatlearn.data.vision import check_image_prompts, expand_image_tokens, message_images, model_vision
from chatlearn.errors import UserError

TOKENIZED_CACHE = "chatlearn_prompts"  # folder under the datasets cache holding tokenized prompts


def read_hub_rows(source: DataSource, *, name: str | None, split: str) -> list[tuple[dict, str]]:
    """Rows of the Hub dataset ``source`` (config ``name``, ``split``), each with where it came from."""
    datasets = _quiet_datasets()
    local = os.path.isdir(source.path)  # the snapshot folder; else the id, in datasets' own cache
    try:
        with _offline(not local):
            ds = datasets.load_dataset(source.path, name, split=split, revision=None if local else source.revision)
    except Exception as err:  # as in chatlearn.config.data_sources._builder
        raise UserError(f"cannot read the Hub dataset {source.spec!r} (config {name!r}, split {split!r}): "
                        f"{type(err).__name__}: {_brief(err)}.") from None
    label = f"{source.spec} ({name + ', ' if name else ''}split {split})"
    return [(row, f"{label} row {i + 1}") for i, row in enumerate(ds.to_list())]


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


def load_tokenizer(path: str, *, trust_remote_code: bool, key: str):
    """The tokenizer of a Hugging Face model folder (:func:`chatlearn.data.tokenizer.fast_tokenizer` where
    it gives the same ids, else transformers'); a folder without a usable one is a user error."""
    tokenizer = fast_tokenizer(path) if os.path.isdir(path) else None
    if tokenizer is not None:
        return _with_chat_template(tokenizer, path, key)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises OSError, ValueError, JSONDecodeError, ... for a bad folder
        raise UserError(f"cannot load a tokenizer from {path!r}: {_brief(err)}. Point it at a "
                        "model folder that holds the tokenizer files (tokenizer.json or the tokenizer's vocabulary "
                        "files, tokenizer_config.json).", key=key) from err
    return _with_chat_template(tokenizer, path, key)


def _with_chat_template(tokenizer, path: str, key: str):
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
    messages: list[list[dict]] = field(default_factory=list)  # the chat messages of each prompt (multi-turn: reset's row)
    # the warning for prompts whose ground truth is null or empty, None when there are none (see check_truths)
    empty_truth_warning: str | None = None
    # each prompt's images (resolved references: chatlearn.data.vision), empty when no prompt has any
    images: list[list] = field(default_factory=list)
    # each prompt's reference response (token ids of the row's last, assistant message as the chat template renders
    # it, through its end-of-turn token), empty unless asked for (algorithm: gkd with gkd_lambda < 1)
    responses: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class VisionData:
    """What loading prompts with images needs: the model folder (its config and image processor) and the
    most images a prompt may hold (models.policy.max_images_per_prompt)."""

    model_path: str | None
    max_images: int


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


def empty_truth(value) -> bool:
    """Whether a ground truth holds no answer: null, a blank string, an empty list or object."""
    return value is None or (isinstance(value, str) and not value.strip()) or (
        isinstance(value, (list, dict)) and not value)


def check_truths(truths: list, wheres: list[str], what: str, ground_truth_key: str | None) -> str | None:
    """The warning for rows whose ground truth is empty (:func:`empty_truth`; ``wheres``: where each came
    from), None when there are none; a UserError when every row's is (nothing could be rewarded).
    ``ground_truth_key`` None: no ground truth, nothing to check."""
    if ground_truth_key is None:
        return None
    empty = [where for truth, where in zip(truths, wheres) if empty_truth(truth)]
    where = (f"null or empty at runtime_args.ground_truth_key {ground_truth_key!r}; the first: {empty[0]}"
             if empty else "")
    if truths and len(empty) == len(truths):
        raise UserError(f"{what}: every one of the {len(truths)} prompts has an empty ground truth ({where}), so no "
                        "response could be rewarded against an answer and the run would train on nothing. Fill in "
                        "the answers, set runtime_args.ground_truth_key to the field that holds them, or to null "
                        "if the reward functions need no ground truth.")
    if not empty:
        return None
    return (f"{what}: {len(empty)} of the {len(truths)} prompts have an empty ground truth ({where}): the reward "
            "functions cannot score their responses against an answer, so they train at the reward of a missing "
            "answer (0 with builtin:math). Fill in the answers, or remove those rows.")


def load_prompts(paths: list[str], tokenizer, *, max_prompt_tokens: int, enable_thinking: bool,
                 prompt_key: str, ground_truth_key: str | None,
                 what: str = "runtime_args.data_path", name: str | None = None, split: str = "train",
                 ground_truth_pattern: str | None = None, prompt_instruction: str | None = None,
                 tools: list | None = None, vision: VisionData | None = None,
                 responses: bool = False, drop_replies: bool = False) -> PromptSet:
    """Read every row of ``paths`` (local files or folders, or Hub dataset ids read with config ``name``
    and ``split``), apply the chat template to ``row[prompt_key]`` (a string becomes one user message,
    ``prompt_instruction`` is appended to the last user message; ``enable_thinking`` is passed to the
    template) and drop prompts longer than ``max_prompt_tokens``. The ground truth is the value at
    ``ground_truth_key``, cut down to the first group of ``ground_truth_pattern`` when one is given.
    ``extras`` keeps each row without the prompt, ``data_source`` and ground-truth columns (the first
    part of ``ground_truth_key``). ``tools``: JSON schemas passed to the chat template (a multi-turn
    rollout's tools), None: none. ``vision``: the model folder and the image limit, for rows whose messages
    hold images (:mod:`chatlearn.data.vision`): each is decoded once here (a bad one is an error naming the row)
    and its placeholder token expanded to the image's vision tokens. ``responses``: every row's messages end with
    the assistant's reply (TRL's conversational format), taken off the prompt and kept tokenized
    (:func:`reference_response`; a row without one is refused); ``drop_replies``: a last assistant message is taken
    off and not kept (the evaluation set of such a run, which may be of the same rows)."""
    messages_all, replies, wheres, truths, sources, extras, images, base_dirs = [], [], [], [], [], [], [], []
    taken = {prompt_key, "data_source"} | ({ground_truth_key.split(".")[0]} if ground_truth_key else set())
    pattern = re.compile(ground_truth_pattern) if ground_truth_pattern else None
    for source in resolve_data_sources(",".join(paths), what, name=name, split=split):
        if source.hub_id:  # rows without a data_source column are named after the dataset, or the file
            rows = [(row, where, source.hub_id, "") for row, where in read_hub_rows(source, name=name, split=split)]
        else:  # an image path in a row is relative to its file's folder
            rows = [(row, where, os.path.basename(path), os.path.dirname(os.path.abspath(path)))
                    for path in list_data_files([source.path]) for row, where in read_rows(path)]
        for row, where, default_source, base_dir in rows:
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
            if responses:
                messages = split_reply(messages, where, prompt_key)
                replies.append(messages.pop())
            elif drop_replies and len(messages) > 1 and messages[-1]["role"] == "assistant":
                messages = messages[:-1]
            if prompt_instruction:
                messages = _with_instruction(messages, prompt_instruction)
            truth = _ground_truth(row, ground_truth_key, where) if ground_truth_key else None
            if pattern is not None and truth is not None:
                truth = _match_truth(pattern, truth, where)
            messages_all.append(messages)
            images.append(message_images(messages))
            base_dirs.append(base_dir)
            wheres.append(where)
            truths.append(truth)
            sources.append(str(row.get("data_source", default_source)))
            extras.append({k: v for k, v in row.items() if k not in taken})
    vision = vision or VisionData(None, 0)  # no model named: a text-only caller
    images, counts = check_image_prompts(images, base_dirs, wheres, model_path=vision.model_path,
                                         max_images=vision.max_images)  # before the template sees image parts
    token_ids = tokenize_prompts(messages_all, wheres, tokenizer, enable_thinking=enable_thinking, tools=tools)
    token_ids = _with_images(counts, wheres, token_ids, vision, max_prompt_tokens)
    keep = [i for i, ids in enumerate(token_ids) if len(ids) <= max_prompt_tokens]
    dropped = len(token_ids) - len(keep)
    if not keep:
        reason = (f"all {dropped} prompts are longer than models.policy.max_prompt_tokens_length "
                  f"({max_prompt_tokens}); raise it" if dropped else "the files hold no rows; add data")
        raise UserError(f"{what}: no usable prompts: {reason}.")
    warning = check_truths([truths[i] for i in keep], [wheres[i] for i in keep], what, ground_truth_key)
    return PromptSet([token_ids[i] for i in keep], [truths[i] for i in keep], [sources[i] for i in keep], dropped,
                     [extras[i] for i in keep], [messages_all[i] for i in keep], warning,
                     [images[i] for i in keep] if any(images) else [],
                     [reference_response(tokenizer, messages_all[i], replies[i], wheres[i], enable_thinking)
                      for i in keep] if responses else [])


def split_reply(messages: list[dict], where: str, prompt_key: str) -> list[dict]:
    """``messages`` (a copy) checked to end with the assistant's reply after at least one other message: the reference
    response of ``algorithm: gkd`` with ``gkd_lambda`` < 1; a UserError naming the row otherwise."""
    last = messages[-1]
    if len(messages) < 2 or last["role"] != "assistant" or not isinstance(last["content"], str):
        raise UserError(
            f"{where}: the row has no reference response: with models.policy_trainer.gkd_lambda < 1, "
            "algorithm: gkd trains some episodes on the dataset's own responses, and a row's response is the last "
            f"message of its {prompt_key!r} messages, which must be the assistant's (role 'assistant', text content) "
            f"after the prompt's messages (this row's roles: {[m['role'] for m in messages]}). Add the answer as a "
            "last assistant message (e.g. assets/arith_sft/train.jsonl with runtime_args.prompt_key: messages), "
            "or set models.policy_trainer.gkd_lambda: 1 (the student's samples only).",
            key="models.policy_trainer.gkd_lambda")
    return list(messages)


def reference_response(tokenizer, prompt: list[dict], reply: dict, where: str, enable_thinking: bool) -> list[int]:
    """The token ids of ``reply`` after ``prompt`` as the chat template renders them: the conversation's ids after
    those of the prompt with the generation prompt, through the reply's last end-of-turn token (``eos_token``; what
    follows it, such as a newline, is not the model's to write). A template that renders the prompt otherwise once the
    reply follows it is refused with the row."""
    def ids(messages, generation_prompt):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                             enable_thinking=enable_thinking)
        return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]

    head, full = ids(prompt, True), ids([*prompt, reply], False)
    reply_ids = full[len(head):]
    if full[:len(head)] != head or not reply_ids:
        raise UserError(f"{where}: the chat template renders this row's prompt differently once its assistant reply "
                        "follows it (or renders no reply), so the reply's tokens cannot be told apart from the "
                        "prompt's. Use a template that renders earlier messages alike whatever follows (ChatML-style "
                        "templates do), or set models.policy_trainer.gkd_lambda: 1.",
                        key="models.policy_trainer.gkd_lambda")
    eos_text = getattr(tokenizer, "eos_token", None)
    eos_ids = tokenizer.encode(eos_text, add_special_tokens=False) if isinstance(eos_text, str) and eos_text else []
    eos = int(eos_ids[0]) if len(eos_ids) == 1 else None
    if eos is not None and eos in reply_ids:
        reply_ids = reply_ids[:len(reply_ids) - reply_ids[::-1].index(eos)]
    return reply_ids


def _with_images(counts: list[list[int]], wheres: list[str], token_ids: list[list[int]],
                 vision: VisionData, max_prompt_tokens: int) -> list[list[int]]:
    """``token_ids`` with each image's placeholder token expanded to its vision tokens (``counts``: each prompt's
    images' vision tokens, :func:`chatlearn.data.vision.check_image_prompts`); an image prompt longer than
    ``max_prompt_tokens`` is an error (its images make it so: dropping it silently would hide that)."""
    if not any(counts):
        return token_ids
    image_id = model_vision(vision.model_path)["image_token_id"]
    out = []
    for ids, n, where in zip(token_ids, counts, wheres, strict=True):
        try:
            ids = expand_image_tokens(ids, n, image_id) if n else ids
        except ValueError as err:
            raise UserError(f"{where}: the chat template rendered {err}: it must write one image placeholder "
                            "per image part of a message. Fix the template, or the row.") from None
        if n and len(ids) > max_prompt_tokens:
            raise UserError(f"{where}: with its {len(n)} image(s) ({sum(n)} vision tokens) the prompt is {len(ids)} "
                            f"tokens, more than models.policy.max_prompt_tokens_length ({max_prompt_tokens}). Raise "
                            "that key, or use smaller images (the image processor's max_pixels).",
                            key="models.policy.max_prompt_tokens_length")
        out.append(ids)
    return out


def _with_instruction(messages: list[dict], instruction: str) -> list[dict]:
    """``messages`` with ``instruction`` appended (after a space) to the last user message with text content."""
    out = [dict(m) for m in messages]
    for m in reversed(out):
        if m["role"] == "user" and isinstance(m["content"], str):
            m["content"] = f"{m['content'].rstrip()} {instruction}"
            break
    return out


def _match_truth(pattern: re.Pattern, truth, where: str) -> str:
    found = pattern.search(str(truth))
    if found is None:
        raise UserError(f"{where}: the ground truth {_brief(ValueError(str(truth)), 120)!r} does not match "
                        f"runtime_args.ground_truth_pattern {pattern.pattern!r}. Fix the row, or the pattern "
                        "(its first group, or the whole match, becomes the ground truth).")
    return found.group(1) if pattern.groups else found.group(0)


def tokenizer_fingerprint(tokenizer) -> list:
    """What the token ids of a prompt depend on: the tokenizer's class, its folder's tokenizer files (name,
    size, modification time), its chat template and vocabulary size."""
    path = str(getattr(tokenizer, "name_or_path", "") or "")
    files = []
    if os.path.isdir(path):
        for f in sorted(os.listdir(path)):
            if f.startswith(("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template")) \
                    or f.endswith((".model", ".tiktoken")):
                st = os.stat(os.path.join(path, f))
                files.append((f, st.st_size, st.st_mtime_ns))
    return [type(tokenizer).__name__, os.path.abspath(path) if path else "", files,
            getattr(tokenizer, "chat_template", None), len(tokenizer)]


def prompts_cache_dir() -> str:
    """``<datasets cache>/chatlearn_prompts``: ``HF_DATASETS_CACHE``, else ``HF_HOME/datasets``, else
    ``~/.cache/huggingface/datasets`` (``datasets``' own rule, without importing it)."""
    root = os.environ.get("HF_DATASETS_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                  os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"),
        "datasets")
    return os.path.join(os.path.expanduser(root), TOKENIZED_CACHE)


def tokenize_prompts(messages: list[list[dict]], wheres: list[str], tokenizer, *,
                     enable_thinking: bool, tools: list | None = None) -> list[list[int]]:
    """Token ids of each prompt's chat template, kept in a cache file ``<fingerprint>.npz`` under
    :func:`prompts_cache_dir`, named by a hash of the prompts, the tokenizer, ``enable_thinking`` and the
    ``tools`` given to the template:
    the same prompts with the same tokenizer are read back, not tokenized again. The file is written
    whole or not at all (a temporary file renamed into place)."""
    if not messages:
        return []
    texts = [json.dumps(m, ensure_ascii=False, sort_keys=True) for m in messages]
    parts = ["chatlearn-prompts-v2", texts, tokenizer_fingerprint(tokenizer), bool(enable_thinking)]
    key = json.dumps(parts + ([tools] if tools else []), ensure_ascii=False, default=str, sort_keys=True)
    folder = prompts_cache_dir()
    path = os.path.join(folder, hashlib.sha256(key.encode("utf-8")).hexdigest()[:32] + ".npz")
    if os.path.exists(path):
        try:
            with np.load(path, allow_pickle=False) as cached:
                ids, offsets = cached["ids"], cached["offsets"]
            if len(offsets) == len(texts) + 1:
                return [ids[offsets[i]:offsets[i + 1]].tolist() for i in range(len(texts))]
        except (OSError, ValueError, KeyError):
            pass  # a damaged cache file is replaced
    out = []
    for text, where in zip(texts, wheres):
        try:
            ids = tokenizer.apply_chat_template(json.loads(text), add_generation_prompt=True, tokenize=True,
                                                enable_thinking=enable_thinking, **({"tools": tools} if tools else {}))
        except Exception as err:  # the template is user code (jinja): any error is about the data or it
            raise UserError(f"{where}: the tokenizer's chat template fails on this row: "
                            f"{type(err).__name__}: {_brief(err)}. Fix the row, or give the "
                            "model folder a chat template (chat_template.jinja or tokenizer_config.json) that "
                            "accepts it.") from err
        if hasattr(ids, "keys"):  # transformers returns a BatchEncoding
            ids = ids["input_ids"]
        out.append([int(t) for t in ids])
    tmp = None
    try:
        os.makedirs(folder, exist_ok=True)
        offsets = np.cumsum([0] + [len(ids) for ids in out], dtype=np.int64)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, ids=np.fromiter((t for ids in out for t in ids), np.int64, int(offsets[-1])),
                     offsets=offsets)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass  # a read-only or full cache folder: tokenized again next time
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return out


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
