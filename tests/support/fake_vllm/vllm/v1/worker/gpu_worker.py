"""The GPU worker of vLLM 0.32 (``vllm/v1/worker/gpu_worker.py``), as far as the engine and a
worker extension see it: ``vllm_config``, ``device``, ``model_runner`` (``get_model()``,
``kv_caches``), ``load_model``, the KV cache, ``sleep(level)`` / ``wake_up(tags)`` and
``reload_weights``.

* ``load_model``: the fake Qwen2 of ``model_executor/models/qwen2.py``, loaded from the folder's
  safetensors (every parameter must be loaded, as vLLM's default loader checks). With sleep mode
  the weights are allocated in the ``CuMemAllocator`` pool under the tag ``weights``.
* KV cache: one ``[2, blocks, block_size, kv_heads, head_dim]`` tensor per layer (tag
  ``kv_cache``), ``kv_cache_memory_bytes`` of it, or (sized by ``gpu_memory_utilization`` in
  vLLM) enough blocks for ``max_num_seqs`` sequences of ``max_model_len`` tokens. Too small for
  one sequence of ``max_model_len`` fails as there (``check_enough_kv_cache_memory``).
* ``sleep(level)``: level 1 offloads the weights to host memory and discards the KV cache; level
  2 discards both (the buffers are saved to host memory and restored when the weights wake up).
  ``wake_up(tags)`` maps the tags' memory again (``device_allocator/cumem.py``).
* ``reload_weights``: vLLM 0.32 takes ``weights_iterator`` / ``weights_path`` /
  ``is_checkpoint_format`` (in-place reload of given weights, or of the checkpoint); releases
  before 0.16 take no arguments and reload the checkpoint (``FAKE_VLLM_RELEASE``, see the
  package docstring). The fake loads through ``model.load_weights`` in both.
* ``model_runner.weights_fingerprint()``: what the fake's sampler derives its logits from; it
  fails on weights that are asleep or hold uninitialised memory (NaN), where vLLM would fault or
  compute garbage.
"""
from __future__ import annotations

import hashlib
import math
import os
import struct

import torch

from vllm.device_allocator.cumem import UNMAPPED, CuMemAllocator


class ModelRunner:
    def __init__(self, vllm_config, model):
        self.vllm_config = vllm_config
        self.model = model
        self.kv_caches: list[torch.Tensor] = []

    def get_model(self):
        return self.model

    def load_checkpoint(self, path: str | None = None) -> None:
        """The default loader: every ``*.safetensors`` of the folder through ``load_weights``."""
        from safetensors.torch import load_file

        from vllm.config import set_current_vllm_config

        folder = path or self.vllm_config.model_config.model
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            loaded = set()
            for name in names:
                loaded |= self.model.load_weights(load_file(os.path.join(folder, name)).items())
        missing = sorted(set(dict(self.model.named_parameters())) - loaded)
        if missing:
            raise ValueError(f"Following weights were not initialized from checkpoint: {set(missing)}")

    def reload_weights(self, weights_iterator=None, weights_path: str | None = None,
                       is_checkpoint_format: bool = True) -> None:
        if not is_checkpoint_format:
            raise NotImplementedError("the fake reloads checkpoint-format weights only")
        if weights_iterator is None:
            self.load_checkpoint(weights_path)
            return
        with torch.no_grad():
            self.model.load_weights(weights_iterator)

    def weights_fingerprint(self) -> int:
        total = []
        for name, p in self.model.named_parameters():
            if getattr(p, UNMAPPED, False):
                raise RuntimeError(f"CUDA error: an illegal memory access was encountered (the fake: {name} "
                                   "is asleep)")
            value = float(p.detach().double().sum())
            if not math.isfinite(value):
                raise RuntimeError(f"the fake: {name} holds uninitialised memory; the weights were discarded "
                                   "(sleep level 2) and not all loaded again, so vLLM would generate garbage")
            total.append(value)
        digest = hashlib.blake2b(struct.pack(f"{len(total)}d", *total), digest_size=8).digest()
        return int.from_bytes(digest, "little")


class Worker:
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config
        self.device = torch.device("cpu")  # "cuda:<local rank>" in vLLM
        self.model_runner: ModelRunner | None = None
        self._allocator = CuMemAllocator()
        self._sleep_saved_buffers: dict[str, torch.Tensor] = {}

    def load_model(self) -> None:
        from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

        model = Qwen2ForCausalLM(self.vllm_config.model_config.hf_config)
        self.model_runner = ModelRunner(self.vllm_config, model)
        self.model_runner.load_checkpoint()
        if self.vllm_config.model_config.enable_sleep_mode:
            self._allocator.register(model.parameters(), "weights")

    def initialize_kv_cache(self) -> None:
        c = self.vllm_config.model_config.hf_config
        cache, sched = self.vllm_config.cache_config, self.vllm_config.scheduler_config
        max_model_len = self.vllm_config.model_config.max_model_len
        kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        layers, block = c["num_hidden_layers"], cache.block_size
        page = 2 * layers * kv_heads * head_dim * block * 4  # bytes of one block, float32
        per_seq = math.ceil(max_model_len / block)
        if cache.kv_cache_memory_bytes is None:
            blocks = sched.max_num_seqs * per_seq + 1
        else:
            blocks = cache.kv_cache_memory_bytes // page
            if blocks <= 0:
                raise ValueError("No available memory for the cache blocks. Try increasing "
                                 "`gpu_memory_utilization` when initializing the engine.")
            if (per_seq + 1) > blocks:  # one sequence of max_model_len, and the null block
                raise ValueError(
                    f"To serve at least one request with the model's max seq len ({max_model_len}), "
                    f"({(per_seq + 1) * page / 2**30:.2f} GiB KV cache is needed, which is larger than the "
                    f"available KV cache memory ({blocks * page / 2**30:.2f} GiB). Based on the available memory, "
                    f"the estimated maximum model length is {(blocks - 1) * block}. Try increasing "
                    "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.")
        self.model_runner.kv_caches = [torch.zeros(2, blocks, block, kv_heads, head_dim) for _ in range(layers)]
        if self.vllm_config.model_config.enable_sleep_mode:
            self._allocator.register(self.model_runner.kv_caches, "kv_cache")

    def sleep(self, level: int = 1) -> None:
        if level == 2:
            self._sleep_saved_buffers = {name: buffer.cpu().clone()
                                         for name, buffer in self.model_runner.model.named_buffers()}
        self._allocator.sleep(offload_tags=("weights",) if level == 1 else ())

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._allocator.wake_up(tags)
        if (tags is None or "weights" in tags) and self._sleep_saved_buffers:
            for name, buffer in self.model_runner.model.named_buffers():
                if name in self._sleep_saved_buffers:
                    buffer.data.copy_(self._sleep_saved_buffers[name].data)
            self._sleep_saved_buffers = {}

    def reload_weights(self, *args, **kwargs) -> None:
        import vllm
        from vllm.config import set_current_vllm_config

        if vllm.RELEASE < (0, 16):  # reload_weights(self) -> None: the checkpoint again
            if args or kwargs:
                raise TypeError("Worker.reload_weights() takes 1 positional argument but more were given")
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.reload_weights(*args, **kwargs)
