"""The GPU worker of vLLM 0.11 - 0.15 (``vllm/v1/worker/gpu_worker.py``), as far as a worker
extension sees it: ``vllm_config``, ``device``, ``model_runner`` and ``reload_weights()``, which
in those releases takes no arguments (it reloads the checkpoint from disk)."""
from __future__ import annotations

import torch


class ModelRunner:
    def __init__(self, model):
        self.model = model
        self.kv_caches: list = []

    def get_model(self):
        return self.model

    def reload_weights(self) -> None:
        raise RuntimeError("the fake does not reload from disk")


class Worker:
    def __init__(self, vllm_config, model):
        self.vllm_config = vllm_config
        self.device = torch.device("cpu")  # "cuda:<local rank>" in vLLM
        self.model_runner = ModelRunner(model)

    def reload_weights(self) -> None:
        self.model_runner.reload_weights()
