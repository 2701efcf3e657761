"""Throughput from the stage times, and the peak memory a worker reports."""
from __future__ import annotations

import numpy as np
import torch

from chatlearn.logging.perf import throughput
from chatlearn.runtime.cluster.worker import Worker


def test_throughput():
    # two samples, 9 tokens, 5 of them prompt tokens: 4 response tokens
    batch = {"offsets": np.array([0, 5, 9]), "prompt_lens": np.array([3, 2])}
    out = throughput(batch, {"time/generate": 2.0, "time/train": 3.0}, epochs=2)
    assert out == {"perf/generate_tokens_per_s": 2.0, "perf/train_tokens_per_s": 6.0}
    assert throughput(batch, {"time/generate": 0.0}, epochs=1) == {}


def test_worker_memory_on_cpu():
    worker = Worker.__new__(Worker)  # memory() needs no backend
    out = worker.memory()
    assert out["device"] == ("cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu")
    assert 10 < out["peak_mb"] < 1_000_000  # this process's peak RSS, in MiB


def test_worker_memory_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: 3 * 2**20)
    assert Worker.__new__(Worker).memory() == {"peak_mb": 3.0, "device": "cuda"}
