"""A test-only stand-in for SGLang's offline engine (``sglang.Engine``), on CPU.

Only what ``chatlearn.models.rollout.sglang`` calls exists here, with SGLang's names,
signatures and return structures (SGLang >= 0.5.3: ``srt/entrypoints/engine.py``,
``srt/server_args.py``, ``srt/sampling/sampling_params.py``, ``srt/layers/sampler.py``; the
modules of ``sglang.srt`` the adapter imports, at 0.5.3's paths). Unknown engine arguments and
sampling keys raise TypeError as the real dataclasses do; features SGLang has and this fake
lacks raise NotImplementedError. Any ``tp_size`` runs one model on the CPU; the TP ranks exist
for the weight push (below). The fake's pickles name its classes, so a ``tp_size`` > 1 push
runs where ``sglang`` imports (in the tests, inside ``fake_sglang()``).

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
* ``return_logprob`` with ``logprob_start_len`` s >= 0 (``None`` or -1: the last input token only, here
  none): ``meta_info["input_token_logprobs"]`` holds one ``(logprob, token_id, None)`` per token of
  ``input_ids[s:]``, the first ``None`` (``scheduler_output_processor_mixin``: the first is always
  padded with None), ``log_softmax`` of the float32 logits (``LogitsProcessor``, temperature 1 for a
  greedy request); such a request matches no cached prefix past s (``Req.init_next_round_input``).
* ``release_memory_occupation(tags)`` frees the tagged storage for real ("weights":
  parameter storages resized to 0; "kv_cache": the cache). Resumed weights are restored
  only with ``enable_weights_cpu_backup``; without it they come back as NaN (SGLang gives
  back uninitialised memory).
* Lengths, as SGLang checks them (0.5.3; ``context_len`` the engine's context length):
  ``context_length`` above the model's own (``get_context_length``: the first of
  ``max_sequence_length``, ``seq_length``, ``max_seq_len``, ``model_max_length``,
  ``max_position_embeddings``) is refused at start unless
  ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN`` is true (``ModelConfig._derive_context_length``).
  ``TokenizerManager._validate_one_request`` refuses input >= ``context_len`` and input +
  ``max_new_tokens`` >= ``context_len`` (``>=`` to 0.5.10; 0.5.16 on allow ``==``: the fake keeps
  the stricter rule of the lowest supported release). The scheduler (``tp_worker.py``,
  ``scheduler.py``, the same to 0.5.23) has ``max_req_len = min(context_len - 1, KV tokens - 1)``:
  an input of ``max_req_len - 5`` tokens or more is aborted (``validate_input_length``, a
  ValueError from ``generate``) and ``max_new_tokens`` is cut to ``max_req_len - input - 1``
  without a word (``init_req_max_new_tokens``).
* ``update_weights_from_tensor`` serialises the pairs once per TP rank with
  ``sglang.srt.utils.MultiprocessingSerializer`` (torch's multiprocessing pickler, tensors by
  reference) and each rank's scheduler unpickles its own copy, taking ``values[tp_rank]`` of a
  ``LocalSerializedTensor`` (``srt/model_executor/model_runner.py``); they are loaded by Hugging
  Face name, and a tied ``lm_head.weight`` is skipped (SGLang's Qwen2 loader does the same).
  Ranks run on fake GPUs (``fake_sglang_cuda``): rank r on GPU ``base_gpu_id + r * gpu_id_step``.
  Stricter than SGLang, which would copy a tensor of another device over (from the other GPU, with
  a CUDA context on it in every scheduler): a tensor on a fake GPU must be on the receiving
  rank's, and with ``tp_size`` > 1 every tensor must be on one; a plain CPU tensor stands for the
  rollout's own device with one rank. Every rank's tensors must hold the same values (full
  Hugging Face tensors: SGLang's loaders narrow them to the rank's shard).
"""
from __future__ import annotations

import dataclasses
import os
from typing import List, Optional, Tuple

import torch

import fake_sglang_cuda as _fake_cuda
from sglang.srt.configs.model_config import derive_context_length
from sglang.srt.model_executor.model_runner import _unwrap_tensor
from sglang.srt.utils import MultiprocessingSerializer

__version__ = "0.5.3+fake"
TOP_K_ALL = 1 << 30
_SAMPLING_EPS = 1e-6
_PROFILED_KV_TOKENS = 1 << 20  # the KV pool SGLang sizes from free memory, when max_total_tokens is not given
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
    base_gpu_id: int = 0
    gpu_id_step: int = 1
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
        if self.tp_size < 1 or self.base_gpu_id < 0 or self.gpu_id_step < 1:
            raise ValueError(f"tp_size={self.tp_size}, base_gpu_id={self.base_gpu_id}, "
                             f"gpu_id_step={self.gpu_id_step}")
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
        self.context_length = derive_context_length(config, args.context_length)  # ModelConfig.context_len
        # tp_worker.py: the longest request the scheduler takes, and its longest input
        kv_tokens = args.max_total_tokens if args.max_total_tokens is not None else _PROFILED_KV_TOKENS
        self.max_req_len = min(self.context_length - 1, kv_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        if not (self.max_req_len > 0 and self.max_req_input_len > 0):
            raise AssertionError("Memory pool size is too small")
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
        starts = logprob_start_len if isinstance(logprob_start_len, list) else [logprob_start_len] * len(batch)
        outs = [self._one(list(map(int, ids)), SamplingParams(**sp), bool(lp), r or f"req-{i}", start)
                for i, (ids, sp, lp, r, start) in enumerate(zip(batch, params, flags, rids, starts))]
        return outs[0] if single else outs

    def _forward(self, ids: list[int], past):
        out = self.model(torch.tensor([ids]), past_key_values=past, use_cache=True)
        return out.logits[0, -1].float(), out.past_key_values

    def _one(self, prompt: list[int], sp: SamplingParams, return_logprob: bool, rid: str,
             logprob_start_len: Optional[int] = None) -> dict:
        import copy

        max_new = self._admitted_new_tokens(prompt, sp.max_new_tokens)
        key = tuple(prompt)
        start = _input_logprob_start(prompt, return_logprob, logprob_start_len)
        input_lps = None
        if start < len(prompt) - 1:  # input log-probs wanted: no cached prefix past their start
            logits, past, input_lps = self._forward_with_input_logprobs(prompt, start)
            self._prefix_cache[key] = (logits, copy.deepcopy(past))
            cached = 0
        elif key in self._prefix_cache:
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
            meta["input_token_logprobs"] = ([] if input_lps is None else  # one per prompt[start:], the first None
                                            [(lp, t, None) for lp, t in zip([None, *input_lps], prompt[start:])])
            meta["output_token_logprobs"] = [(lp, t, None) for lp, t in zip(out_lps, out_ids)]
        return {"output_ids": out_ids, "meta_info": meta}

    @torch.no_grad()
    def _forward_with_input_logprobs(self, prompt: list[int], start: int):
        """The prompt's forward (no cached prefix, as SGLang caps the prefix it matches at the request's
        ``logprob_start_len``: ``Req.init_next_round_input``) with the input-token log-probs of
        ``prompt[start + 1:]``: ``log_softmax`` of the float32 logits (``LogitsProcessor``; temperature 1,
        top-p 1 for a greedy request). Returns (the last logits, the KV, the log-probs)."""
        out = self.model(torch.tensor([prompt]), use_cache=True)
        logits = out.logits[0].float()
        lps = torch.log_softmax(logits[start:-1], -1).gather(1, torch.tensor(prompt[start + 1:])[:, None])[:, 0]
        return logits[-1], out.past_key_values, [float(x) for x in lps]

    def _admitted_new_tokens(self, prompt: list[int], max_new_tokens: int) -> int:
        """The request's checks on its way in (without allow_auto_truncate) and the new tokens it may
        have: TokenizerManager._validate_one_request (0.5.3: ``>=``), then the scheduler's
        init_req_max_new_tokens and validate_input_length."""
        n, context = len(prompt), self.context_length
        if n >= context:
            raise ValueError(f"The input ({n} tokens) is longer than the model's context length ({context} tokens).")
        if max_new_tokens + n >= context:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
                f"requested a total of {max_new_tokens + n} tokens: {n} tokens from the input messages and "
                f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit.")
        max_new = min(max_new_tokens, self.max_req_len - n - 1)  # cut without a word
        if n >= self.max_req_input_len:  # the scheduler aborts it: generate raises its message
            raise ValueError(f"Input length ({n} tokens) exceeds the maximum allowed length "
                             f"({self.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate.")
        return max_new

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
        if load_format is not None:
            raise NotImplementedError(f"load_format={load_format!r}")
        if GPU_MEMORY_TYPE_WEIGHTS in self._released:
            raise RuntimeError("weights are released; resume_memory_occupation(['weights']) first")
        tp_size = self.server_args.tp_size
        serialized = [MultiprocessingSerializer.serialize(named_tensors) for _ in range(tp_size)]
        ranks = [self._receive(rank, serialized[rank]) for rank in range(tp_size)]
        params = dict(self.model.named_parameters())
        for i, (name, tensor) in enumerate(ranks[0]):
            for rank in range(1, tp_size):
                if ranks[rank][i][0] != name or not torch.equal(ranks[rank][i][1], tensor):
                    raise ValueError(f"{name}: TP rank {rank} got other values than rank 0")
            if self._tied and name == "lm_head.weight":
                continue
            param = params[name]  # KeyError for an unknown name, as SGLang's loader
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
            param.data.copy_(tensor)
        if flush_cache:
            self.flush_cache()
        return True, "Succeeded to update model weights."

    def _receive(self, rank: int, blob: bytes) -> list:
        """TP rank ``rank``'s scheduler: its own payload, each ``LocalSerializedTensor`` as its
        ``values[rank]`` (``ModelRunner.update_weights_from_tensor``), on its own fake GPU."""
        args = self.server_args
        gpu = _fake_cuda.uuid_of(args.base_gpu_id + rank * args.gpu_id_step)
        received = []
        for name, tensor in MultiprocessingSerializer.deserialize(blob):
            tensor = _unwrap_tensor(tensor, tp_rank=rank, device="cpu")
            where = _fake_cuda.device_of(tensor)
            if where not in (gpu, None) or (where is None and args.tp_size > 1):
                raise RuntimeError(
                    f"TP rank {rank}'s scheduler (on {gpu}) got {name} on {where or 'the CPU'}: with "
                    f"tp_size={args.tp_size} every rank needs a tensor on its own GPU (a LocalSerializedTensor "
                    "whose values[tp_rank] was made on that rank's GPU); SGLang would copy it over from the "
                    "other device, with a CUDA context on it in every scheduler")
            received.append((name, tensor))
        return received

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


def _input_logprob_start(prompt: list, return_logprob: bool, logprob_start_len: Optional[int]) -> int:
    """Where a request's input-token log-probs start: ``logprob_start_len`` (SGLang's default, None or
    -1, is ``len(input_ids) - 1``: output log-probs only), as ``TokenizerManager`` sets it; without
    ``return_logprob`` none. A start past the prompt is refused as SGLang's scheduler aborts it."""
    if not return_logprob or logprob_start_len is None or logprob_start_len == -1:
        return len(prompt) - 1
    if not 0 <= logprob_start_len < len(prompt):
        raise ValueError(f"logprob_start_len ({logprob_start_len}) is larger than the input length ({len(prompt)})")
    return int(logprob_start_len)
