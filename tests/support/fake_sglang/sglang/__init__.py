"""A test-only stand-in for SGLang's offline engine (``sglang.Engine``), on CPU.

Only what ``chatlearn.models.rollout.sglang`` calls exists here, with SGLang's names,
signatures and return structures (SGLang >= 0.5.3: ``srt/entrypoints/engine.py``,
``srt/server_args.py``, ``srt/sampling/sampling_params.py``, ``srt/layers/sampler.py``).
Unknown engine arguments and sampling keys raise TypeError as the real dataclasses do;
features SGLang has and this fake lacks raise NotImplementedError.

Behaviour copied from SGLang and relied on by the tests:

* The model is a transformers model. Each step's logits are float32; temperature 0
  becomes greedy (``top_k = 1``, temperature 1). Greedy rows return
  ``log_softmax(logits)``; sampled rows return ``log(softmax(logits / T))`` at the
  sampled token, untruncated (top-k/top-p only restrict what is sampled), or the
  pre-temperature ``log_softmax(logits)`` when ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is
  true.
* Sampling is seeded per request by ``sampling_seed`` (default 42; ``None`` is a
  ValueError) and the token position only with ``enable_deterministic_inference``;
  otherwise the field is accepted and ignored and sampling draws from one engine-wide
  generator seeded by ``random_seed`` (so repeated calls differ), as in SGLang 0.5.3
  (``sampling_batch_info.py`` builds the seed tensor only under deterministic inference).
* ``enable_deterministic_inference`` needs ``attention_backend`` in ``flashinfer``,
  ``fa3``, ``triton`` (``ServerArgs._handle_deterministic_inference``; for ordinary models
  the automatic choice is made only later, so ``None`` raises there, as here).
* A prefix cache (the radix cache's part here) keeps each prompt's KV across calls: it is
  dropped by ``flush_cache()``, by ``update_weights_from_tensor(flush_cache=True)`` and by
  releasing ``kv_cache``. Pushing weights with ``flush_cache=False`` and not flushing
  leaves stale KV in use, as in SGLang.
* ``release_memory_occupation(tags)`` frees the tagged storage for real ("weights":
  parameter storages resized to 0; "kv_cache": the cache). Resumed weights are restored
  only with ``enable_weights_cpu_backup``; without it they come back as NaN (SGLang gives
  back uninitialised memory).
* ``update_weights_from_tensor`` sends the pairs through torch's multiprocessing pickler,
  as SGLang's ``MultiprocessingSerializer`` does, and loads them by Hugging Face name; a
  tied ``lm_head.weight`` is skipped (SGLang's Qwen2 loader does the same).
"""
from __future__ import annotations

import dataclasses
import io
import os
from typing import List, Optional, Tuple

import torch

__version__ = "0.5.3+fake"
TOP_K_ALL = 1 << 30
_SAMPLING_EPS = 1e-6
DETERMINISTIC_ATTENTION_BACKEND_CHOICES = ["flashinfer", "fa3", "triton"]
GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_KV_CACHE = "weights", "kv_cache"
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def _env_true(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


@dataclasses.dataclass
class ServerArgs:
    """The subset of SGLang's ``ServerArgs`` fields this fake understands."""

    model_path: str
    tokenizer_path: Optional[str] = None
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    dtype: str = "auto"
    context_length: Optional[int] = None
    tp_size: int = 1
    mem_fraction_static: Optional[float] = None
    max_running_requests: Optional[int] = None
    max_total_tokens: Optional[int] = None
    random_seed: Optional[int] = None
    disable_cuda_graph: bool = False
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    enable_deterministic_inference: bool = False
    attention_backend: Optional[str] = None
    log_level: str = "error"

    def __post_init__(self):
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} must be in (0, 1)")
        if self.tp_size != 1:
            raise NotImplementedError("the fake engine runs tp_size=1 only")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.enable_deterministic_inference and \
                self.attention_backend not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
            raise ValueError(f"Currently only {DETERMINISTIC_ATTENTION_BACKEND_CHOICES} attention "
                             "backends are supported for deterministic inference.")


@dataclasses.dataclass
class SamplingParams:
    """The subset of SGLang's ``SamplingParams`` keys this fake understands."""

    max_new_tokens: int = 128
    stop_token_ids: Optional[List[int]] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: Optional[int] = 42

    def __post_init__(self):  # SGLang's normalisation and checks
        if 0 <= self.temperature < _SAMPLING_EPS:
            self.temperature, self.top_k = 1.0, 1
        if self.top_k == -1:
            self.top_k = TOP_K_ALL
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 1:
            raise ValueError(f"invalid sampling parameters {self}")
        if not -2.0 <= self.frequency_penalty <= 2.0 or not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError("frequency_penalty and presence_penalty must be in [-2, 2]")
        if not 0.0 <= self.repetition_penalty <= 2.0:
            raise ValueError("repetition_penalty must be in [0, 2]")
        if self.n != 1 or self.min_p != 0.0:
            raise NotImplementedError("the fake engine supports n=1 and min_p=0 only")
        if self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if self.sampling_seed is None:
            raise ValueError("sampling_seed should not be None")


def _penalise(logits: torch.Tensor, sp: SamplingParams, prompt: list, out_ids: list) -> torch.Tensor:
    """SGLang's penalties (vLLM's definitions): repetition over prompt + output, presence and
    frequency over the output only."""
    logits = logits.clone()
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(out_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    for token in set(out_ids):
        logits[token] -= sp.presence_penalty + sp.frequency_penalty * out_ids.count(token)
    return logits


class Engine:
    """``sglang.Engine(**server_args)`` backed by a transformers model on CPU."""

    def __init__(self, **kwargs):
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        self.server_args = args = ServerArgs(**kwargs)
        if not args.skip_tokenizer_init:
            raise NotImplementedError("the fake engine returns token ids only (skip_tokenizer_init=True)")
        dtype = "auto" if args.dtype == "auto" else _DTYPES[args.dtype]
        self.model = AutoModelForCausalLM.from_pretrained(
            args.model_path, dtype=dtype, trust_remote_code=args.trust_remote_code).eval()
        with torch.no_grad():
            for p in self.model.parameters():  # own, resizable storage (release frees it)
                p.data = p.data.clone()
        config = AutoConfig.from_pretrained(args.model_path, trust_remote_code=args.trust_remote_code)
        eos = config.eos_token_id
        try:
            gen_eos = GenerationConfig.from_pretrained(args.model_path).eos_token_id
        except OSError:
            gen_eos = None
        self._eos = {int(e) for x in (eos, gen_eos) if x is not None
                     for e in ([x] if isinstance(x, int) else x)}
        self._tied = bool(getattr(config, "tie_word_embeddings", False))
        self.context_length = args.context_length or int(config.max_position_embeddings)
        self._rng = torch.Generator().manual_seed(args.random_seed or 0)
        self._prefix_cache: dict = {}
        self._released: set[str] = set()
        self._backup: dict[str, torch.Tensor] = {}
        self._alive = True

    # -- generation -------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt=None, sampling_params=None, input_ids=None, image_data=None,
                 return_logprob=False, logprob_start_len=None, top_logprobs_num=None,
                 token_ids_logprob=None, lora_path=None, custom_logit_processor=None,
                 return_hidden_states=False, stream=False, rid=None):
        if not self._alive:
            raise RuntimeError("engine is shut down")
        if self._released:
            raise RuntimeError(f"memory released for {sorted(self._released)}; resume it first")
        if prompt is not None or input_ids is None:
            raise NotImplementedError("the fake engine takes input_ids only")
        if (image_data, top_logprobs_num, token_ids_logprob, lora_path, custom_logit_processor) != (None,) * 5 \
                or return_hidden_states or stream:
            raise NotImplementedError("the fake engine has no such feature")
        single = bool(input_ids) and isinstance(input_ids[0], int)
        batch = [input_ids] if single else list(input_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(batch)
        if len(params) != len(batch):
            raise ValueError("sampling_params must be one dict or one per prompt")
        rids = rid if isinstance(rid, list) else [rid] * len(batch)
        flags = return_logprob if isinstance(return_logprob, list) else [return_logprob] * len(batch)
        outs = [self._one(list(map(int, ids)), SamplingParams(**sp), bool(lp), r or f"req-{i}")
                for i, (ids, sp, lp, r) in enumerate(zip(batch, params, flags, rids))]
        return outs[0] if single else outs

    def _forward(self, ids: list[int], past):
        out = self.model(torch.tensor([ids]), past_key_values=past, use_cache=True)
        return out.logits[0, -1].float(), out.past_key_values

    def _one(self, prompt: list[int], sp: SamplingParams, return_logprob: bool, rid: str) -> dict:
        import copy

        if len(prompt) >= self.context_length:
            raise ValueError(f"input ({len(prompt)} tokens) is longer than the context length "
                             f"({self.context_length})")
        # TokenizerManager._validate_one_request (0.5.x, without allow_auto_truncate): input + max_new_tokens
        # must stay below the context length
        if sp.max_new_tokens + len(prompt) >= self.context_length:
            raise ValueError(f"Requested token count exceeds the model's maximum context length of "
                             f"{self.context_length} tokens. You requested a total of {sp.max_new_tokens + len(prompt)} "
                             f"tokens: {len(prompt)} tokens from the input messages and {sp.max_new_tokens} tokens "
                             "for the completion.")
        max_new = sp.max_new_tokens
        key = tuple(prompt)
        if key in self._prefix_cache:
            logits, past = self._prefix_cache[key]
            past, cached = copy.deepcopy(past), len(prompt)
        else:
            logits, past = self._forward(prompt, None)
            self._prefix_cache[key] = (logits, copy.deepcopy(past))
            cached = 0
        stops = set() if sp.ignore_eos else self._eos | set(sp.stop_token_ids or ())
        out_ids, out_lps, finish = [], [], None
        deterministic = self.server_args.enable_deterministic_inference
        for step in range(max_new):
            token, lp = self._sample(_penalise(logits, sp, prompt, out_ids), sp, deterministic,
                                     position=len(prompt) + step)
            out_ids.append(token)
            out_lps.append(lp)
            if token in stops:
                finish = {"type": "stop", "matched": token}
                break
            if step + 1 < max_new:
                logits, past = self._forward([token], past)
        if finish is None:
            finish = {"type": "length", "length": max_new}
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt),
                "completion_tokens": len(out_ids), "cached_tokens": cached}
        if return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(out_lps, out_ids)]
        return {"output_ids": out_ids, "meta_info": meta}

    def _sample(self, logits: torch.Tensor, sp: SamplingParams, deterministic: bool, position: int):
        if sp.top_k == 1:  # greedy: argmax, log-probs at temperature 1
            token = int(torch.argmax(logits))
            return token, float(torch.log_softmax(logits, -1)[token])
        probs = torch.softmax(logits / sp.temperature, -1)
        sorted_p, idx = probs.sort(descending=True)
        cum = torch.cumsum(sorted_p, -1)
        keep = sorted_p.clone()
        keep[torch.arange(len(keep)) >= sp.top_k] = 0.0
        keep[(cum - sorted_p) > sp.top_p] = 0.0
        if deterministic:
            gen = torch.Generator().manual_seed((sp.sampling_seed * 19349663) ^ (position * 73856093))
        else:
            gen = self._rng
        token = int(idx[torch.multinomial(keep, 1, generator=gen)])
        if _env_true("SGLANG_RETURN_ORIGINAL_LOGPROB"):
            return token, float(torch.log_softmax(logits, -1)[token])
        return token, float(torch.log(probs[token]))

    # -- weights ----------------------------------------------------------------------

    @torch.no_grad()
    def update_weights_from_tensor(self, named_tensors: List[Tuple[str, torch.Tensor]],
                                   load_format: Optional[str] = None, flush_cache: bool = True):
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401  (registers the tensor reductions)

        if load_format is not None:
            raise NotImplementedError(f"load_format={load_format!r}")
        if GPU_MEMORY_TYPE_WEIGHTS in self._released:
            raise RuntimeError("weights are released; resume_memory_occupation(['weights']) first")
        buf = io.BytesIO()
        ForkingPickler(buf).dump(named_tensors)
        received = ForkingPickler.loads(buf.getvalue())
        params = dict(self.model.named_parameters())
        for name, tensor in received:
            if self._tied and name == "lm_head.weight":
                continue
            param = params[name]  # KeyError for an unknown name, as SGLang's loader
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            param.data.copy_(tensor)
        if flush_cache:
            self.flush_cache()
        return True, "Succeeded to update model weights."

    def flush_cache(self):
        self._prefix_cache.clear()
        return True

    # -- memory -----------------------------------------------------------------------

    @torch.no_grad()
    def release_memory_occupation(self, tags: Optional[List[str]] = None):
        if not self.server_args.enable_memory_saver:
            raise RuntimeError("release_memory_occupation needs enable_memory_saver=True")
        tags = [GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_KV_CACHE] if tags is None else list(tags)
        for tag in tags:
            if tag not in (GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_KV_CACHE):
                raise ValueError(f"unknown memory tag {tag!r}")
            if tag in self._released:
                raise RuntimeError(f"{tag} is already released")
        if GPU_MEMORY_TYPE_KV_CACHE in tags:
            self._prefix_cache.clear()
            self._released.add(GPU_MEMORY_TYPE_KV_CACHE)
        if GPU_MEMORY_TYPE_WEIGHTS in tags:
            for name, p in self.model.named_parameters():
                if self.server_args.enable_weights_cpu_backup:
                    self._backup[name] = p.data.clone()
                p.data.untyped_storage().resize_(0)
            self._released.add(GPU_MEMORY_TYPE_WEIGHTS)

    @torch.no_grad()
    def resume_memory_occupation(self, tags: Optional[List[str]] = None):
        tags = [GPU_MEMORY_TYPE_WEIGHTS, GPU_MEMORY_TYPE_KV_CACHE] if tags is None else list(tags)
        for tag in tags:
            if tag not in self._released:
                raise RuntimeError(f"{tag} is not released")
        if GPU_MEMORY_TYPE_WEIGHTS in tags:
            for name, p in self.model.named_parameters():
                storage = p.data.untyped_storage()
                storage.resize_(p.numel() * p.element_size())
                if name in self._backup:
                    p.data.copy_(self._backup.pop(name))
                else:  # uninitialised memory
                    p.data.fill_(float("nan"))
            self._released.discard(GPU_MEMORY_TYPE_WEIGHTS)
        if GPU_MEMORY_TYPE_KV_CACHE in tags:
            self._released.discard(GPU_MEMORY_TYPE_KV_CACHE)

    def shutdown(self):
        self._alive = False
        self._prefix_cache.clear()
        self.model = None
