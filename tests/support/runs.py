"""Whole runs in a subprocess for the end-to-end tests: start one and SIGKILL it at a chosen moment."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from conftest import REPO


def finish(cmd: list, timeout: float = 500, env: dict | None = None) -> str:
    """Run ``cmd`` in the repository to its end (``env``: the whole environment, None for this one's); it must
    exit 0 (else the tails of its output are the failure). Returns its standard output."""
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def run_and_kill(cmd: list, when, env: dict | None = None, deadline_s: float = 400) -> None:
    """Start ``cmd`` in the repository (a session of its own), SIGKILL its whole process group once
    ``when()`` is true, and wait for it to die; it must still be running then."""
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    deadline = time.time() + deadline_s
    try:
        while not when():
            assert proc.poll() is None, "the run ended before it could be interrupted"
            assert time.time() < deadline, "timed out waiting for the moment to interrupt"
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def metric_rows(out) -> list:
    """The rows of ``<out>/metrics.jsonl`` written so far ([] before the first)."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def learning_metrics(out) -> list:
    """Per row, the episode and the ``train/`` and ``eval/`` metrics: what a resumed run must repeat."""
    return [{k: v for k, v in r.items() if k == "episode" or k.startswith(("train/", "eval/"))}
            for r in metric_rows(out)]


def small_eval_set(folder, n: int = 16) -> str:
    """The first ``n`` rows of the default's eval data in ``<folder>/eval.jsonl``: evaluations of a few
    seconds less each, for the runs that only compare or check their metrics."""
    path = os.path.join(folder, "eval.jsonl")
    with open(os.path.join(REPO, "assets", "arith", "eval.jsonl"), encoding="utf-8") as f:
        rows = f.readlines()[:n]
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(rows))
    return path
