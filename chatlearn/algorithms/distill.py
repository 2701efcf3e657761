"""On-policy distillation (``algorithm: opd``), numpy only: the per-token advantages of a student trained on its own
samples against a teacher's log-probs of them.

The reverse KL from the student to the teacher, estimated on the token the student sampled, is
``kl_t = log pi_student(y_t | y_<t) - log pi_teacher(y_t | y_<t)`` (its expectation under the student's samples is
KL(student || teacher)). Its negative is a dense reward on every response token, used undiscounted as that
token's advantage (Thinking Machines' on-policy distillation; verl's ``docs/algo/opd.md``; slime's
``A_t - opd_kl_coef * kl_t``), and added to the task reward's group advantage of the token's sample::

    A_t = A_group(sample of t) - distill_coef * kl_t

on the tokens a loss covers (the model's own: not the prompt, not a multi-turn observation), 0 elsewhere. The
policy's clipped policy-gradient loss then trains on ``A_t`` with its ratio and clipping, as PPO on GAE's.
"""
from __future__ import annotations

import numpy as np

from chatlearn.algorithms.response import response_mask


def distill_token_advantages(batch: dict, student_logprobs: np.ndarray, teacher_logprobs: np.ndarray,
                             sample_advantages: np.ndarray, distill_coef: float) -> np.ndarray:
    """float32 [T]: ``A_t = sample_advantages[sample of t] - distill_coef * (student_t - teacher_t)`` on the
    response tokens of :func:`response_mask`, 0 elsewhere."""
    mask = response_mask(batch)
    off = np.asarray(batch["offsets"], np.int64)
    per_token = np.repeat(np.asarray(sample_advantages, np.float64), np.diff(off))
    kl = np.asarray(student_logprobs, np.float64) - np.asarray(teacher_logprobs, np.float64)
    return np.where(mask, per_token - float(distill_coef) * kl, 0.0).astype(np.float32)


def distill_metrics(batch: dict, student_logprobs: np.ndarray, teacher_logprobs: np.ndarray,
                    teacher_top1: np.ndarray) -> dict:
    """Means over the response tokens (:func:`response_mask`): ``reverse_kl`` (student minus teacher log-prob of
    the sampled token), ``top1_agreement`` (the share of sampled tokens that are the teacher's most likely),
    ``teacher_logprob`` and ``student_logprob``."""
    mask = response_mask(batch)
    if not mask.any():
        return {}
    student = np.asarray(student_logprobs, np.float64)[mask]
    teacher = np.asarray(teacher_logprobs, np.float64)[mask]
    return {"reverse_kl": float(np.mean(student - teacher)),
            "top1_agreement": float(np.mean(np.asarray(teacher_top1, np.float64)[mask])),
            "teacher_logprob": float(np.mean(teacher)), "student_logprob": float(np.mean(student))}
