"""The batch that travels between the stages of an episode: every column declared once.

A batch is a ``dict[str, np.ndarray]`` holding N samples: ``tokens`` (every sample's prompt and
response, concatenated), ``offsets`` [N + 1] (sample i is ``tokens[offsets[i]:offsets[i+1]]``), and
then columns that hold one value per sample (``per="sample"``, length N) or one per token
(``per="token"``, aligned with ``tokens``). Ray moves the arrays without copying.

:data:`COLUMNS` declares each column: its name, whether it is per sample or per token, the kind of
its dtype, and the stage that writes it. Selecting, concatenating, replaying and checkpointing
samples (:func:`select_samples`, :func:`concat_batches`, :func:`columns`) go by that declaration, so
a per-token column is never sliced as a per-sample one; a column that is not declared is an error
(:class:`UndeclaredColumn`) wherever a batch is cut or joined. Columns whose names begin with a
declared prefix (``env/``: what a multi-turn environment reports of each trajectory) are declared by
that prefix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

Batch = dict  # str -> np.ndarray (or a list of Python objects, per sample)

SAMPLE, TOKEN, INDEX = "sample", "token", "index"


@dataclass(frozen=True)
class Column:
    """One column of a batch. ``kind``: the numpy dtype kind its values have (``"i"`` integer,
    ``"u"`` unsigned, ``"f"`` float, ``"U"`` text, ``"b"`` boolean; several letters: any of them)."""

    name: str
    per: str  # SAMPLE | TOKEN | INDEX (offsets)
    kind: str
    writer: str  # the stage or component that writes it
    doc: str


COLUMNS: dict[str, Column] = {c.name: c for c in (
    Column("tokens", TOKEN, "iu", "generate (rollout engine)", "prompt and response token ids, concatenated"),
    Column("offsets", INDEX, "i", "generate (rollout engine)", "[N + 1] where each sample starts; rebuilt on selection"),
    Column("prompt_lens", SAMPLE, "iu", "generate (rollout engine)", "prompt tokens of each sample"),
    Column("rollout_logprobs", TOKEN, "f", "generate (rollout engine)",
           "the engine's log-probs of the sampled tokens (0 on prompt and observation tokens)"),
    Column("finish_reasons", SAMPLE, "iub", "generate (rollout engine)", "1: ended by EOS (or DONE), 0: truncated"),
    Column("routed_experts", TOKEN, "iu", "generate (rollout engine, routing_replay: rollout)",
           "[T, MoE layers, top_k] experts each MoE layer routed the token to (uint8 with 255, or int16 with -1: "
           "no record; chatlearn/models/moe/layout.py)"),
    Column("loss_mask", TOKEN, "iu", "generate (multi-turn loop)",
           "1 on the model's own tokens of a multi-turn trajectory (absent: every response token)"),
    Column("images", SAMPLE, "O", "generate (driver: the prompts' images, vision-language models)",
           "each sample's {'pixel_values', 'image_grid_thw'} (None: no image); the samples of a prompt share one"),
    Column("policy_version", SAMPLE, "i", "generate (rollout pipeline, max_staleness)",
           "the weight version that generated the sample"),
    Column("old_logprobs", TOKEN, "f", "old_logprobs (policy trainer)",
           "the trainer's log-probs before the update (NaN where the first step's forward gives them)"),
    Column("ref_logprobs", TOKEN, "f", "ref_logprobs (reference model)", "the reference model's log-probs"),
    Column("advantages", SAMPLE, "f", "advantages (algorithm)", "each sample's advantage"),
    Column("values", TOKEN, "f", "values (critic)", "the critic's value of the state before each response token"),
    Column("returns", TOKEN, "f", "advantages (algorithm: PPO)", "the critic's targets: GAE advantages + values"),
    Column("token_advantages", TOKEN, "f", "advantages (algorithm: PPO)",
           "each response token's advantage (GAE); where present the policy loss reads it, not advantages"),
    Column("teacher_logprobs", TOKEN, "f", "teacher_logprobs (teacher)",
           "the distillation teacher's log-probs of the sampled tokens (0 on prompt and observation tokens)"),
    Column("teacher_top1", TOKEN, "f", "teacher_logprobs (teacher)",
           "1 where the sampled token is the teacher's most likely token at that position, else 0"),
    Column("teacher_topk_logprobs", TOKEN, "f", "teacher_logprobs (teacher, algorithm: gkd)",
           "[T, k] the teacher's log-probs of its k most likely tokens at each position, most likely first "
           "(k: distill_topk, or the vocabulary; 0 on prompt and observation tokens)"),
    Column("teacher_topk_ids", TOKEN, "iu", "teacher_logprobs (teacher, algorithm: gkd)",
           "[T, k] the ids of those tokens"),
    Column("reward_model_scores", SAMPLE, "f", "reward_model (reward model)",
           "the reward model's raw score of each sample"),
    Column("sample_weights", SAMPLE, "f", "advantages (algorithm)",
           "1 for a sample the loss counts, 0 for one it leaves out (filtered groups)"),
)}
# prefixes that declare a family of per-sample columns
PREFIXES: dict[str, Column] = {
    "env/": Column("env/", SAMPLE, "iufU", "generate (multi-turn loop)",
                   "a multi-turn trajectory's environment outcome: env/reward, env/turns, env/status, ..."),
}


class UndeclaredColumn(KeyError):
    """A batch holds a column that :data:`COLUMNS` does not declare."""


def column(name: str) -> Column:
    """The declaration of ``name``; :class:`UndeclaredColumn` when there is none."""
    found = COLUMNS.get(name)
    if found is not None:
        return found
    for prefix, col in PREFIXES.items():
        if name.startswith(prefix):
            return col
    raise UndeclaredColumn(f"batch column {name!r} is not declared in chatlearn/batch.py (COLUMNS): declare it "
                           "there (per sample or per token, its dtype kind and the stage that writes it)")


def check(batch: Mapping) -> None:
    """Every column of ``batch`` is declared, has its declared dtype kind and its declared length."""
    n = len(batch["offsets"]) - 1
    tokens = int(batch["offsets"][-1])
    for name, values in batch.items():
        col = column(name)
        if col.per == INDEX:
            continue
        want = n if col.per == SAMPLE else tokens
        if len(values) != want:
            raise ValueError(f"batch column {name!r} ({col.per}) has {len(values)} entries, not {want}")
        kind = np.asarray(values).dtype.kind
        if kind not in col.kind:
            raise TypeError(f"batch column {name!r} has dtype kind {kind!r}, declared {col.kind!r}")


def columns(batch: Mapping, names: Iterable[str]) -> Batch:
    """The columns ``names`` of ``batch`` that it holds (with ``offsets``), as a new dict (no copy)."""
    out = {"offsets": batch["offsets"]}
    out.update((k, batch[k]) for k in names if k in batch)
    return out


def select_samples(batch: Batch, index) -> Batch:
    """A new batch holding the given samples, in the given order: per-token columns by the samples'
    token ranges, ``offsets`` rebuilt, per-sample columns by index (a list of objects stays a list)."""
    index = np.asarray(index, dtype=np.int64)
    off = batch["offsets"]
    lens = off[1:] - off[:-1]
    new_off = np.zeros(len(index) + 1, dtype=np.int64)
    np.cumsum(lens[index], out=new_off[1:])
    token_idx = (np.concatenate([np.arange(off[i], off[i + 1]) for i in index])
                 if len(index) else np.zeros(0, np.int64))
    out: Batch = {"offsets": new_off}
    for key, val in batch.items():
        per = column(key).per
        if per == INDEX:
            continue
        if per == TOKEN:
            out[key] = val[token_idx]
        elif isinstance(val, np.ndarray):
            out[key] = val[index]
        else:
            out[key] = [val[i] for i in index]
    return out


def concat_batches(batches: list[Batch]) -> Batch:
    """One batch holding the samples of ``batches`` in order (each holds the same columns)."""
    out: Batch = {}
    lens = np.concatenate([b["offsets"][1:] - b["offsets"][:-1] for b in batches])
    out["offsets"] = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=out["offsets"][1:])
    for key in batches[0]:
        if column(key).per == INDEX:
            continue
        vals = [b[key] for b in batches]
        out[key] = np.concatenate(vals) if isinstance(vals[0], np.ndarray) else [x for v in vals for x in v]
    return out


def token_columns() -> tuple[str, ...]:
    """The names of the declared per-token columns."""
    return tuple(c.name for c in COLUMNS.values() if c.per == TOKEN)
