"""The one interface every backend implements.

A *batch* travels between stages as a plain ``dict[str, np.ndarray]`` (columnar, ragged
sequences packed with offsets, never padded), so that Ray moves it zero-copy:

    tokens        int64   [T]    prompt + response tokens of every sample, concatenated
    offsets       int64   [N+1]  sample i is tokens[offsets[i]:offsets[i+1]]
    prompt_lens   int64   [N]    the first prompt_lens[i] tokens of sample i are its prompt

Per-token values are aligned with ``tokens`` (length T): position j holds the value for
token j given the tokens before it; positions inside a prompt hold 0 and are masked out.

    rollout_logprobs  float32 [T]  from the rollout engine (sampled tokens)
    old_logprobs      float32 [T]  from policy_trainer before the update
    ref_logprobs      float32 [T]  from ref_policy (present when the KL term is used)
    advantages        float32 [N]  one per sample (GRPO: group-relative)

Parts that a model can hold on its devices: ``weights``, ``optimizer``, ``grads``,
``kv_cache``. ``offload(parts)`` frees their storage on the device for real (the data is
kept on the host), ``onload(parts)`` restores it bit for bit.
"""
from __future__ import annotations

import abc
import math
from typing import Iterable, Iterator

import numpy as np

Batch = dict  # dict[str, np.ndarray]; see the module docstring
Bucket = list  # list[tuple[str, np.ndarray]] in Hugging Face parameter names

PARTS = ("weights", "optimizer", "grads", "kv_cache")


def sample_slices(batch: Batch) -> Iterator[slice]:
    """Slices of ``tokens`` for each sample."""
    off = batch["offsets"]
    for i in range(len(off) - 1):
        yield slice(int(off[i]), int(off[i + 1]))


def response_mask(batch: Batch) -> np.ndarray:
    """bool [T]: True on response tokens (the ones a loss or a log-prob covers)."""
    off, plen = batch["offsets"], batch["prompt_lens"]
    mask = np.zeros(int(off[-1]), dtype=bool)
    for i in range(len(plen)):
        mask[int(off[i] + plen[i]) : int(off[i + 1])] = True
    return mask


TOKEN_KEYS = ("tokens", "rollout_logprobs", "old_logprobs", "ref_logprobs")


def select_samples(batch: Batch, index) -> Batch:
    """A new batch holding the given samples, in the given order.

    Keys in ``TOKEN_KEYS`` are per-token; ``offsets`` is rebuilt; every other array or
    list is per-sample.
    """
    index = np.asarray(index, dtype=np.int64)
    off = batch["offsets"]
    lens = off[1:] - off[:-1]
    new_off = np.zeros(len(index) + 1, dtype=np.int64)
    np.cumsum(lens[index], out=new_off[1:])
    token_idx = (np.concatenate([np.arange(off[i], off[i + 1]) for i in index])
                 if len(index) else np.zeros(0, np.int64))
    out: Batch = {"offsets": new_off}
    for key, val in batch.items():
        if key == "offsets":
            continue
        if key in TOKEN_KEYS:
            out[key] = val[token_idx]
        elif isinstance(val, np.ndarray):
            out[key] = val[index]
        else:
            out[key] = [val[i] for i in index]
    return out


class Model(abc.ABC):
    """What the scheduler needs of every model."""

    @abc.abstractmethod
    def offload(self, parts: Iterable[str]) -> dict:
        """Free the named parts on the device; returns {"bytes": int} moved."""

    @abc.abstractmethod
    def onload(self, parts: Iterable[str]) -> dict:
        """Restore the named parts bit for bit; returns {"bytes": int} moved."""


def step_is_finite(loss: float, grad_norm: float) -> bool:
    """Whether an optimizer step may be taken: its loss and gradient norm are finite numbers.

    A non-finite one means the gradients are nan or inf, and stepping would write them into the
    weights and the optimizer state for good, so the trainers skip that step instead (as
    Megatron-LM, DeepSpeed and torch's GradScaler skip a step whose gradients overflowed): the
    gradients are dropped and neither the weights, the optimizer state nor the learning-rate
    schedule move. Both numbers are all-reduced over the ranks, so every rank decides alike.
    The engine stops the run after ``optimizer.max_nonfinite_steps`` skipped steps in a row.
    """
    return math.isfinite(loss) and math.isfinite(grad_norm)


class Trainer(Model):
    """policy_trainer and ref_policy (FSDP2 and Megatron).

    Every rank receives the full batch; data-parallel replica ``dp_rank`` of ``dp_size`` works
    on its contiguous share of the samples (``_my_samples``). Offloaded parts live in
    ``self._stashes`` (part name -> what restores it).
    """

    dp_size: int = 1
    dp_rank: int = 0
    _stashes: dict

    def _require_weights(self) -> None:
        if "weights" in self._stashes:
            raise RuntimeError(f"{type(self).__name__}: weights are offloaded; call onload(['weights'])")

    # parts a trainer copies to the host and back; "grads" are dropped, "kv_cache" does not exist
    OFFLOADABLE = ("weights", "optimizer")

    def _part_tensors(self, part: str) -> list:
        """The tensors whose storage makes up ``part`` ("weights" or "optimizer")."""
        raise NotImplementedError

    def _check_parts(self, parts: Iterable[str]) -> list[str]:
        parts = list(parts)
        unknown = [p for p in parts if p not in PARTS]
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown parts {unknown}; known: {PARTS}")
        return parts

    def _stash_parts(self, parts: list[str]) -> int:
        """Free the device storage of the offloadable ``parts`` not yet offloaded, keeping
        their bytes on the host (``chatlearn.models.trainer.stash.Stash``); returns the bytes."""
        from chatlearn.models.trainer.stash import Stash

        moved = 0
        for part in self.OFFLOADABLE:
            if part in parts and part not in self._stashes:
                self._stashes[part] = Stash(self._part_tensors(part))
                moved += self._stashes[part].nbytes
        return moved

    def _unstash_parts(self, parts: list[str]) -> int:
        """Restore offloaded ``parts`` bit for bit; returns the bytes copied back."""
        return sum(self._stashes.pop(part).restore() for part in self.OFFLOADABLE
                   if part in parts and part in self._stashes)

    def _require_finite_weights(self, params: Iterable, path: str) -> None:
        """Refuse, on every rank, to write a checkpoint at ``path`` from weights that hold nan or
        inf (``params``: this rank's local weight tensors; a collective: the count is
        all-reduced). Skipped steps keep the weights finite; this catches a finite step that
        overflowed them (a learning rate far too large)."""
        import torch
        import torch.distributed as dist

        params = list(params)
        bad = torch.tensor([sum(int(not bool(torch.isfinite(t).all())) for t in params), len(params)],
                           dtype=torch.int64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(bad)
        if int(bad[0]):
            from chatlearn.errors import UserError

            raise UserError(f"{int(bad[0])} of the trainer's {int(bad[1])} weight tensors (shards of all "
                            f"ranks) hold nan or inf, so no checkpoint is written to {path!r}: training "
                            "diverged. Resume from the last checkpoint with a lower "
                            "models.policy_trainer.optimizer.lr (or a smaller clip_grad).")

    def _require_onloaded(self, what: str) -> None:
        offloaded = [part for part in self.OFFLOADABLE if part in self._stashes]
        if offloaded:
            raise RuntimeError(f"{type(self).__name__}.{what}: {' and '.join(offloaded)} offloaded; "
                               f"call onload({offloaded}) first")

    def _my_samples(self, batch: Batch) -> np.ndarray:
        """Indices of this data-parallel replica's contiguous share of the samples."""
        n = len(batch["offsets"]) - 1
        if n % self.dp_size:
            raise ValueError(f"{type(self).__name__}: the batch has {n} samples, which does not "
                             f"divide by the {self.dp_size} data-parallel replicas")
        if n and int(np.min(batch["prompt_lens"])) < 1:
            raise ValueError(f"{type(self).__name__}: every sample needs a prompt of at least 1 token")
        share = n // self.dp_size
        return np.arange(self.dp_rank * share, (self.dp_rank + 1) * share)

    @abc.abstractmethod
    def compute_logprobs(self, batch: Batch, temperature: float = 1.0) -> np.ndarray:
        """float32 [T] log-probs of every token given its prefix (0 at prompt positions)."""

    @abc.abstractmethod
    def train(self, batch: Batch) -> dict:
        """One optimizer step on one global batch; returns metrics (floats)."""

    @abc.abstractmethod
    def weight_specs(self) -> list[tuple[str, str, tuple, int]]:
        """``(hf_name, dtype, full shape, group)`` of every exported weight, in export order
        (the same on every rank); names of one ``group`` come out of one gather."""

    @abc.abstractmethod
    def export_tensors(self, names: Iterable[str]) -> Iterator[tuple]:
        """``(hf_name, full tensor on rank 0, None elsewhere)`` for the names given (whole
        groups), gathered group by group; a collective: every rank iterates to the end."""

    def export_weights(self, bucket_mb: int) -> Iterator[Bucket]:
        """All weights as ``[(hf_name, np.ndarray), ...]`` buckets of about ``bucket_mb`` MiB,
        planned as the weight push plans them (``chatlearn.models.weight_buckets.plan_buckets``).
        A collective: every rank iterates to the end; rank 0's buckets hold the arrays, the
        other ranks' are empty lists. For tests and tools; runs push with ``WeightSync``."""
        from chatlearn.models.weight_buckets import plan_buckets

        for index in plan_buckets(self.weight_specs(), bucket_mb * 2 ** 20):
            yield [(name, t.detach().to("cpu").numpy()) for name, t in self.export_tensors(index.names)
                   if t is not None]

    @abc.abstractmethod
    def save_hf(self, path: str) -> None:
        """Write a Hugging Face model folder (rank 0 writes; a collective)."""


class Rollout(Model):
    """The policy: vLLM, SGLang or transformers."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], sampling: dict) -> Batch:
        """Sample one response per prompt.

        ``sampling``: temperature, top_p, top_k (-1: off), max_tokens, seed (optional), and the
        penalties presence_penalty, frequency_penalty, repetition_penalty (optional, vLLM's
        definitions; absent: off).
        Returns a batch (tokens, offsets, prompt_lens, rollout_logprobs) plus
        ``finish_reasons`` (int8 [N]: 1 stopped at EOS, 0 cut at max_tokens).
        ``rollout_logprobs`` are log-probs under the temperature-scaled distribution
        (no top-p/top-k truncation), the same quantity the trainer computes.
        """

    @abc.abstractmethod
    def update_weights(self, bucket: Bucket) -> None:
        """Load one bucket of (hf_name, array) into the engine."""


def concat_batches(batches: list[Batch]) -> Batch:
    """One batch holding the samples of ``batches`` in order."""
    out: Batch = {}
    lens = np.concatenate([b["offsets"][1:] - b["offsets"][:-1] for b in batches])
    out["offsets"] = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=out["offsets"][1:])
    for key in batches[0]:
        if key == "offsets":
            continue
        vals = [b[key] for b in batches]
        out[key] = np.concatenate(vals) if isinstance(vals[0], np.ndarray) else [x for v in vals for x in v]
    return out
