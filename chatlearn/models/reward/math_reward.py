"""Rule-based math reward: the last ``\\boxed{...}`` of a response checked with math-verify."""
from __future__ import annotations

import functools
import logging
import re
import threading

import numpy as np


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


_INTEGER = re.compile(r"-?[0-9]{1,18}")


class MathReward:
    """``score`` returns correct_score when the boxed answer equals the ground truth, else incorrect_score."""

    def __init__(self, cfg: dict):
        self.correct = float(cfg["correct_score"])
        self.incorrect = float(cfg["incorrect_score"])

    def is_correct(self, response: str, ground_truth: str) -> bool:
        answer = last_boxed(response)
        if answer is None:
            return False
        a, g = answer.strip(), ground_truth.strip()
        if a == g:
            return True
        if _INTEGER.fullmatch(a) and _INTEGER.fullmatch(g):
            return int(a) == int(g)  # math-verify's verdict on two integers, without parsing
        # math-verify's timeouts use signals, which work only in the main thread; elsewhere they are
        # turned off (and its warning about that silenced).
        timeout = 5 if threading.current_thread() is threading.main_thread() else None
        if timeout is None:
            for name in ("math_verify.parser", "math_verify.grader"):
                logging.getLogger(name).setLevel(logging.ERROR)
        return _equivalent(answer, ground_truth, timeout)

    def score(self, responses: list[str], ground_truths: list, data_sources: list[str] | None = None
              ) -> np.ndarray:
        return np.array([self.correct if self.is_correct(r, str(g)) else self.incorrect
                         for r, g in zip(responses, ground_truths)], dtype=np.float32)


@functools.lru_cache(maxsize=1 << 16)
def _equivalent(answer: str, ground_truth: str, timeout: int | None) -> bool:
    """math-verify's verdict on a boxed answer against the ground truth: a pure function of the two
    texts, so it is remembered (a group's samples often give the same answer, and every sample of
    a prompt has the same ground truth; parsing dominates the reward's time)."""
    from math_verify import parse, verify

    gold = _parsed(ground_truth, timeout)
    pred = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
    return bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout)


@functools.lru_cache(maxsize=1 << 12)
def _parsed(ground_truth: str, timeout: int | None):
    from math_verify import parse

    return parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=timeout)


def warm_math_verify() -> None:
    """Import math-verify and parse once (its first parse builds the LaTeX grammar): the first
    reward stage of a run then does not wait for it."""
    from math_verify import parse

    parser = logging.getLogger("math_verify.parser")
    level = parser.level
    parser.setLevel(logging.ERROR)  # its warning that a parse without timeout could hang: this one cannot
    try:
        parse("\\boxed{\\frac{1}{2}}", parsing_timeout=None)
    finally:
        parser.setLevel(level)


def math_reward(*, prompts: list[str], responses: list[str], ground_truths: list, data_sources: list[str],
                extra: list[dict], correct_score: float, incorrect_score: float) -> list[float]:
    """``builtin:math``: correct_score where the last ``\\boxed{}`` of the response equals the ground truth
    (compared as text, then with math-verify), else incorrect_score."""
    scorer = MathReward({"correct_score": correct_score, "incorrect_score": incorrect_score})
    return scorer.score(responses, ground_truths).tolist()
