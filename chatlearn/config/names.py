"""The run's vocabulary, named once: the parts a model can hold on its devices and the stages of an
episode. The scheduler, the backends, the timeline, metrics, progress, plots and docs read these
enums; nothing else spells the names out. Which parts a model holds and which stage it runs is its
kind's (chatlearn/config/kinds.py).

Both are ``str`` enums: a member equals its value (``Part.WEIGHTS == "weights"``), formats as its
value and is written to JSON as its value, so timeline files, metric names and backend calls keep
their plain strings.
"""
from __future__ import annotations

import enum


class _Name(str, enum.Enum):
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __hash__(self) -> int:  # as its value's, so that "weights" and Part.WEIGHTS meet in sets and dicts
        return hash(self.value)


class Part(_Name):
    """What a model can hold on its devices, and move off and back (``offload``/``onload``)."""

    WEIGHTS = "weights"
    OPTIMIZER = "optimizer"  # optimizer state (trainers)
    GRADS = "grads"  # gradient buffers (trainers; dropped, not copied)
    KV_CACHE = "kv_cache"  # the rollout engine's KV cache


class Stage(_Name):
    """The timed stages of an episode (``time/<stage>`` metrics, timeline ``stage`` events), in the
    order an episode runs them; ``EVAL`` runs between episodes."""

    GENERATE = "generate"
    REWARD = "reward"
    REWARD_MODEL = "reward_model"  # the reward model scores the samples (models.reward.load)
    JUDGE = "judge"  # an LLM judge gives the samples its verdicts (a model of kind judge)
    REF_LOGPROBS = "ref_logprobs"
    OLD_LOGPROBS = "old_logprobs"
    VALUES = "values"  # the critic's values of the samples' tokens (PPO)
    TEACHER_LOGPROBS = "teacher_logprobs"  # a distillation teacher's log-probs of the samples' tokens
    TRAIN = "train"
    CHECKPOINT = "checkpoint"
    WEIGHT_PUSH = "weight_push"
    EVAL = "eval"

    @property
    def label(self) -> str:
        """How the console names the stage (``old log-probs``, ``weight push``)."""
        return STAGE_LABELS[self]


STAGE_LABELS = {Stage.GENERATE: "generate", Stage.REWARD: "reward", Stage.REWARD_MODEL: "reward model",
                Stage.JUDGE: "judge",
                Stage.REF_LOGPROBS: "ref log-probs", Stage.OLD_LOGPROBS: "old log-probs", Stage.VALUES: "values",
                Stage.TEACHER_LOGPROBS: "teacher log-probs",
                Stage.TRAIN: "train", Stage.CHECKPOINT: "checkpoint",
                Stage.WEIGHT_PUSH: "weight push", Stage.EVAL: "eval"}
