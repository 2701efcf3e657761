"""Rollout over SGLang's offline engine (``sglang.Engine``, SGLang >= 0.5.3; GPU only).

Tested only against a fake of the engine API (``tests/support/fake_sglang``); not yet run
against real SGLang on hardware (``tests/models/rollout/test_rollout_cpu.py`` holds the GPU test).

Engine. ``sglang.Engine(model_path=load, tp_size, mem_fraction_static, dtype,
context_length = max prompt + max response + 1 (SGLang's ``TokenizerManager`` refuses a request whose
input + ``max_new_tokens`` reaches ``context_length``: ``>=``, not ``>``, in 0.5.x; the extra token lets
a sequence fill the context as in the other engines), max_running_requests = generation_batch_size,
disable_cuda_graph = enforce_eager, random_seed = seed, skip_tokenizer_init=True,
enable_memory_saver=True, enable_weights_cpu_backup=True,
enable_deterministic_inference = deterministic_inference)``, and with deterministic inference
an explicit ``attention_backend`` (see :func:`deterministic_attention_backend`).

Log-probs. ``generate(..., return_logprob=True)`` returns, per output token,
``meta_info["output_token_logprobs"][j] = (logprob, token_id, text)``. SGLang's sampler
(``srt/layers/sampler.py``) reports for a sampled token ``log(softmax(logits / T))``:
temperature-scaled and not truncated by top-k/top-p (those only shape the draw), the
quantity the trainer computes. Greedy requests (temperature 0, which SGLang turns into
``top_k = 1`` at temperature 1, or ``top_k = 1``) report ``log_softmax(logits)``, the
same convention as the other backends. With ``SGLANG_RETURN_ORIGINAL_LOGPROB`` set, SGLang
reports the pre-temperature ``log_softmax(logits)`` instead: that is refused.

Seeds. In SGLang 0.5.3 (``srt/sampling/sampling_batch_info.py``, ``srt/layers/sampler.py``)
a request's ``sampling_seed`` (a ``SamplingParams`` field, default 42) is used only under
``enable_deterministic_inference``: the batch's seed tensor is built only then, and
``multinomial_with_seed`` hashes it with the token position; without it the field is
accepted and ignored, and samples come from the engine's global generator (they depend on
batching). Deterministic inference also switches SGLang to batch-invariant kernels and the
pytorch sampling backend, which costs throughput, so it follows the rollout's
``deterministic_inference`` setting: when on, request i of a call gets ``sampling_seed =
seed + i`` and a seed reproduces the samples (as for vLLM); when off, no seed is sent.

Weights. Each bucket of a push (``chatlearn.runtime.weight_push.stream``: ``begin_weight_update``,
then ``load_weight_bucket`` per bucket, then ``finish_weight_update``) goes to
``update_weights_from_tensor(named_tensors=[(hf_name, tensor)], flush_cache=False)``, which
SGLang serialises to every TP rank and loads with the model's own loader (HF names; q/k/v and
gate/up are fused there). Tensors are put on the rollout's device first (CUDA IPC, as verl
does); ``update_weights_from_tensor`` returns once the engine has loaded them, and they are
dropped then. A tied ``lm_head.weight`` is not sent (SGLang's loaders skip it). The prefix
(radix) cache is flushed once before the next generation.

Memory. ``offload`` is ``release_memory_occupation(tags=[...])`` with the tags
``weights`` and ``kv_cache`` (torch_memory_saver; weights are kept in host memory by
``enable_weights_cpu_backup``), ``onload`` is ``resume_memory_occupation`` per tag, so
new weights can be pushed between the two wake steps. CUDA-graph memory is not released.
torch_memory_saver frees the engine processes' memory; this (adapter) process holds only
the tensors it staged for weight pushes, which torch's caching allocator keeps reserved
after they are dropped: ``offload`` and ``finish_weight_update`` empty that cache.
The reported bytes are those of the weights (from the checkpoint's tensor shapes, at the
engine's dtype); SGLang does not report the KV cache's size, which counts as 0.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable

import numpy as np
import torch

from chatlearn.config.names import Part
from chatlearn.errors import UserError
from chatlearn.models.base import Batch, Rollout
from chatlearn.models.rollout import kv_cache
from chatlearn.models.rollout.common import (check_lengths, context_length, eos_token_ids, pack_samples,
                                             parse_sampling, release_cuda_cache, response_budgets, to_torch)

if TYPE_CHECKING:
    from chatlearn.models.specs import RolloutSpec

# The parts this engine holds. SGLang's memory saver names its tags as we name these parts; the
# tags go to its API as the plain strings (str(part)).
PARTS = (Part.WEIGHTS, Part.KV_CACHE)
FINISH_REASONS = {"stop": 1, "length": 0}


def import_sglang():
    """``import sglang``, or a UserError that says how to install it."""
    try:
        import sglang
    except ImportError as err:
        raise UserError(
            f"the SGLang rollout backend needs the sglang package, which cannot be imported here ({err}). "
            "Install it on a machine with NVIDIA GPUs: pip install -e '.[sglang]'; or use "
            "rollout_backend: vllm (or hf).", key="runtime_args.rollout_backend") from None
    for name in ("SGLANG_RETURN_ORIGINAL_LOGPROB", "RETURN_ORIGINAL_LOGPROB"):
        if (os.environ.get(name) or "").lower() in ("1", "true", "yes"):
            raise UserError(
                f"the environment variable {name} makes SGLang report log-probs before temperature, "
                "which differ from the trainer's at any temperature other than 1. Unset it for chatlearn "
                "runs.", key="runtime_args.rollout_backend")
    return sglang


def deterministic_attention_backend(device: torch.device) -> str:
    """The attention backend to start SGLang with under deterministic inference.

    SGLang 0.5.3 ``ServerArgs._handle_deterministic_inference`` raises unless
    ``attention_backend`` is one of ``flashinfer``, ``fa3``, ``triton``; for most models
    (Qwen2, Llama, ...) it is still unset (``None``) at that point, since the automatic choice
    happens later in the model runner, so it must be given. ``fa3`` (the only one of the
    three that keeps the radix cache under deterministic inference) on Hopper (sm90),
    ``triton`` elsewhere.
    """
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
        return "fa3"
    return "triton"


class SGLangRollout(Rollout):
    """Rollout with ``sglang.Engine`` (see the module docstring).

    ``spec``: a :class:`~chatlearn.models.specs.RolloutSpec` resolved for its device, kept as
    ``self.spec``; the fields read: ``load``, ``trust_remote_code``, ``seed``,
    ``generation_batch_size``, ``max_prompt_tokens_length``, ``max_response_tokens_length``,
    ``seq_length``, ``dtype``, ``gpu_memory_utilization``, ``kv_cache``, ``enforce_eager``,
    ``tensor_model_parallel_size``, ``deterministic_inference``, ``device``.
    """

    def __init__(self, spec: RolloutSpec):
        sglang = import_sglang()
        from transformers import AutoConfig, GenerationConfig

        self.spec = spec
        self.max_prompt_len = int(spec.max_prompt_tokens_length)
        self.max_response_len = int(spec.max_response_tokens_length)
        self.seq_length = None if spec.seq_length is None else int(spec.seq_length)
        self._rng = np.random.default_rng(int(spec.seed))
        config = AutoConfig.from_pretrained(spec.load, trust_remote_code=bool(spec.trust_remote_code))
        try:
            generation_config = GenerationConfig.from_pretrained(spec.load)
        except OSError:  # no generation_config.json
            generation_config = None
        self.eos_ids = eos_token_ids(generation_config, config)
        self._tied = bool(getattr(config, "tie_word_embeddings", False))
        self._device = torch.device(spec.device)
        if self._device.type == "cuda":
            self._device = torch.device("cuda", torch.cuda.current_device())
        self.deterministic = bool(spec.deterministic_inference)
        extra = ({"attention_backend": deterministic_attention_backend(self._device)}
                 if self.deterministic else {})
        context = context_length(self.max_prompt_len, self.max_response_len, self.seq_length)
        self._weight_bytes = kv_cache.checkpoint_bytes(spec.load, spec.dtype)
        if spec.kv_cache == "fit":  # SGLang keeps the smaller of this and what mem_fraction_static leaves
            sized = kv_cache.fit(spec.load, spec.dtype, int(spec.generation_batch_size), context,
                                 int(spec.tensor_model_parallel_size), float(spec.gpu_memory_utilization),
                                 block_size=1, weight_bytes=self._weight_bytes)
            if sized.tokens is not None:
                extra["max_total_tokens"] = sized.tokens
        self.engine = sglang.Engine(
            model_path=spec.load,
            trust_remote_code=bool(spec.trust_remote_code),
            skip_tokenizer_init=True,  # token ids in and out
            dtype=spec.dtype,
            context_length=context + 1,  # input + max_new_tokens must stay below it (see the module docstring)
            tp_size=int(spec.tensor_model_parallel_size),
            mem_fraction_static=float(spec.gpu_memory_utilization),
            max_running_requests=int(spec.generation_batch_size),
            disable_cuda_graph=bool(spec.enforce_eager),
            random_seed=int(spec.seed),
            enable_memory_saver=True,
            enable_weights_cpu_backup=True,
            enable_deterministic_inference=self.deterministic,
            **extra,
        )
        self._released: set[str] = set()
        self._stale_cache = False

    # -- generation -----------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: dict) -> Batch:
        if self._released:
            raise RuntimeError(f"SGLangRollout.generate: {sorted(self._released)} offloaded; "
                               "call onload first")
        sp = parse_sampling(sampling)
        prompts = [[int(t) for t in p] for p in prompts]
        check_lengths(prompts, sp["max_tokens"], self.max_prompt_len, self.max_response_len, self.seq_length,
                      sp["continuation"])
        if not prompts:
            return pack_samples([], [], [], [])
        if self._stale_cache:
            self.engine.flush_cache()
            self._stale_cache = False
        base = sp["seed"] if sp["seed"] is not None else int(self._rng.integers(2**31))
        params = [{
            "max_new_tokens": budget,
            "temperature": 0.0 if sp["greedy"] else sp["temperature"],
            "top_p": 1.0 if sp["greedy"] else sp["top_p"],
            "top_k": -1 if sp["greedy"] else sp["top_k"],
            "presence_penalty": sp["presence_penalty"],
            "frequency_penalty": sp["frequency_penalty"],
            "repetition_penalty": sp["repetition_penalty"],
            "stop_token_ids": list(self.eos_ids),
        } for budget in response_budgets(prompts, sp["max_tokens"],
                                          context_length(self.max_prompt_len, self.max_response_len, self.seq_length))]
        if self.deterministic:  # one stream per request: reproducible (ignored otherwise)
            for i, p in enumerate(params):
                p["sampling_seed"] = (base + i) % 2**31
        outputs = self.engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)

        responses, logprobs, finished = [], [], []
        for out in outputs:
            meta = out["meta_info"]
            reason = (meta.get("finish_reason") or {}).get("type")
            if reason not in FINISH_REASONS:
                raise RuntimeError(f"SGLang request {meta.get('id')} ended with {meta.get('finish_reason')!r}")
            ids = [int(t) for t in out["output_ids"]]
            steps = meta["output_token_logprobs"]
            if [int(s[1]) for s in steps] != ids:
                raise RuntimeError(f"SGLang request {meta.get('id')}: output_token_logprobs do not match "
                                   "output_ids")
            responses.append(ids)
            logprobs.append([float(s[0]) for s in steps])
            finished.append(FINISH_REASONS[reason])
        return pack_samples(prompts, responses, logprobs, finished)

    # -- weights ----------------------------------------------------------------------

    def begin_weight_update(self) -> None:
        """Start a streamed update (``chatlearn.runtime.weight_push.stream``); the weights must be on."""
        if Part.WEIGHTS in self._released:
            raise RuntimeError("SGLangRollout: weights are offloaded; onload them before a push")

    def load_weight_bucket(self, weights: list) -> None:
        """Load one bucket of ``(hf_name, tensor or array)`` pairs into the engine (see the module
        docstring); they are copied to the rollout's device first, since the views are valid
        only during this call."""
        if Part.WEIGHTS in self._released:
            raise RuntimeError("SGLangRollout.load_weight_bucket: weights are offloaded; onload them first")
        named = [(name, to_torch(value).to(self._device, copy=True)) for name, value in weights
                 if not (self._tied and name == "lm_head.weight")]
        if not named:
            return
        result = self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=False)
        del named  # loaded by now: the call returns after the engine's load
        if isinstance(result, tuple) and result and not result[0]:
            raise RuntimeError(f"SGLang update_weights_from_tensor failed: {result[1:]}")
        self._stale_cache = True

    def finish_weight_update(self) -> None:
        """End a streamed update; the prefix cache is flushed before the next generation.
        The staged device copies of the buckets go back to the device."""
        release_cuda_cache(self._device)

    # -- memory -----------------------------------------------------------------------

    def offload(self, parts: Iterable[str]) -> dict:
        """``release_memory_occupation`` of the named parts that are on; returns the bytes freed."""
        parts = set(parts)
        release_cuda_cache(self._device)  # this process's staged push buffers
        tags = [str(p) for p in PARTS if p in parts and p not in self._released]
        if not tags:
            return {"bytes": 0}
        self.engine.release_memory_occupation(tags=tags)
        self._released.update(tags)
        if Part.KV_CACHE in tags:
            self._stale_cache = False  # the cache is gone with its memory
        return {"bytes": self._bytes(tags)}

    def onload(self, parts: Iterable[str]) -> dict:
        """``resume_memory_occupation`` per part, weights first."""
        parts = set(parts)
        tags = [str(p) for p in PARTS if p in parts and p in self._released]
        for tag in tags:
            self.engine.resume_memory_occupation(tags=[tag])
            self._released.discard(tag)
        return {"bytes": self._bytes(tags)}

    def _bytes(self, tags) -> int:
        return self._weight_bytes if Part.WEIGHTS in tags else 0

    def shutdown(self) -> None:
        self.engine.shutdown()
