"""A strict fake of vLLM 0.32 (the release ``pyproject.toml`` pins for CUDA) on a CUDA platform,
running on the CPU, for the rollout adapter (``chatlearn/models/rollout/vllm.py``). Each module
says which of vLLM's files it models; ``tests/models/rollout/test_vllm_fake_strict.py`` compares
the fake's signatures, fields, defaults and ``SamplingParams`` checks with the installed vLLM.

* ``LLM`` (``entrypoints/llm.py``): 0.32's constructor parameters and defaults; the other engine
  arguments go to ``EngineArgs`` (``engine/arg_utils.py``), which refuses unknown ones and checks
  the values vLLM's configs check. The engine (``v1/engine/llm_engine.py``) builds one worker
  with the ``worker_extension_cls`` mixed in (``v1/executor/abstract.py``), loads the fake Qwen2
  (``model_executor/models/qwen2.py``) from the folder's safetensors and allocates its KV cache
  (``v1/worker/gpu_worker.py``). ``collective_rpc(method, args=...)`` runs a worker method; with
  ``FAKE_VLLM_MULTIPROCESS=1`` the engine core is a ``SyncMPClient`` and the arguments and
  results cross as msgpack, as vLLM's multiprocess engine sends them (no tensors, no pickles).
* ``SamplingParams`` (``sampling_params.py``): 0.32's fields (those the fake has), defaults and
  checks, ``VLLMValidationError`` (``exceptions.py``) for a rejected value.
* ``generate``: deterministic tokens from the weights, the context and the seed, with 0.32's
  request checks, stop rules, ``n``, log-probs per ``logprobs_mode`` and ``RequestOutput``s
  (``outputs.py``); it fails where vLLM would hang (paused engine) or compute garbage (weights
  discarded by sleep level 2 and not reloaded).
* Sleep mode (``enable_sleep_mode``): ``sleep(level)`` 1 offloads the weights to host memory and
  drops the KV cache, 2 drops both; ``wake_up(tags)`` with "weights", "kv_cache" (and
  "scheduling"); tags that are not asleep make it a no-op with a warning, as in vLLM; the engine
  runs again once every tag is awake (``device_allocator/cumem.py``). Without sleep mode, sleep
  pauses the engine but frees nothing.

Release. ``FAKE_VLLM_RELEASE`` (read at import, default "0.32.0") picks the release the worker
and model loader follow: before 0.16 there is no ``model_executor.model_loader.reload`` package
(the layerwise reload) and ``Worker.reload_weights()`` takes no arguments. The rest is 0.32's
whatever the release. Not modelled: tokenizers and text (prompts are token ids, ``text`` is
empty, stop strings are refused), tensor parallelism, quantization, the layerwise reload itself,
model dtypes other than float32, LoRA, multimodal inputs, vLLM's one ``CuMemAllocator`` per
process (each fake engine has its own).
"""
from __future__ import annotations

import os

__version__ = os.environ.get("FAKE_VLLM_RELEASE", "0.32.0")
RELEASE = tuple(int(x) for x in __version__.split(".")[:2])

from vllm.entrypoints.llm import LLM  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "TokensPrompt", "RequestOutput", "CompletionOutput", "__version__"]
