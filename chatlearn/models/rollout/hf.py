"""Rollout over Hugging Face transformers: batched ``model.generate`` with a KV cache.

The simplest engine, and on a CPU the fastest one for small models. It returns, for each
sampled token, ``log_softmax(raw_logits / temperature)`` at that token: the untruncated,
temperature-scaled distribution that the trainer computes too (top-p/top-k only shape
what is sampled, never the reported log-probs).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import warnings
from typing import Iterable

import numpy as np
import torch

from chatlearn.config.names import Part
from chatlearn.models.base import Batch, Rollout
from chatlearn.models.stash import own_storage

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------
# Helpers shared by the rollout backends
# ---------------------------------------------------------------------------------------

# A sampling dict may leave out the filters: absent means "off" (no nucleus, no top-k cut) and
# no seed. temperature and max_tokens are required. The run's values come from the config
# (chatlearn/runtime/rollouts.py), which always sets all five.
SAMPLING_FILTERS_OFF = {"top_p": 1.0, "top_k": -1, "seed": None}
# Penalties (vLLM's definitions); absent means neutral.
PENALTIES_OFF = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def parse_sampling(sampling: dict) -> dict:
    """Normalise a sampling dict: temperature, max_tokens, and optionally top_p, top_k (-1: off),
    seed (see :data:`SAMPLING_FILTERS_OFF`) and ``continuation`` (default False: the prompts are a
    multi-turn rollout's trajectories so far, which may reach into the response budget; see
    :func:`check_lengths`).

    ``greedy`` is True for temperature 0 or top_k == 1; greedy log-probs are reported at
    temperature 1 (``temperature`` is 1.0 in the result then).
    """
    unknown = set(sampling) - {"temperature", "max_tokens", "continuation", *SAMPLING_FILTERS_OFF, *PENALTIES_OFF}
    if unknown:
        raise ValueError(f"sampling: unknown keys {sorted(unknown)}")
    full = {**SAMPLING_FILTERS_OFF, **PENALTIES_OFF, "continuation": False, **sampling}
    temperature = float(full["temperature"])
    top_k = int(full["top_k"])
    top_k = -1 if top_k <= 0 else top_k
    greedy = temperature <= 0.0 or top_k == 1
    seed = full["seed"]
    return {
        "greedy": greedy,
        "temperature": 1.0 if greedy else temperature,
        "top_p": float(full["top_p"]),
        "top_k": top_k,
        "max_tokens": int(full["max_tokens"]),
        "seed": None if seed is None else int(seed),
        "continuation": bool(full["continuation"]),
        **{k: float(full[k]) for k in PENALTIES_OFF},
    }


def penalties_on(sp: dict) -> bool:
    """True when a parsed sampling dict asks for any penalty."""
    return any(sp[k] != v for k, v in PENALTIES_OFF.items())


class PenaltyLogitsProcessor:
    """vLLM's sampling penalties as a transformers logits processor.

    For each row, with ``count[v]`` the number of times token ``v`` occurs in the generated
    tokens so far (the prompt is not counted)::

        logits -= presence_penalty * (count > 0) + frequency_penalty * count

    and for every token ``v`` seen in the prompt or the output (``repetition_penalty``)::

        logits[v] = logits[v] / r if logits[v] > 0 else logits[v] * r

    ``prompt_len`` is the (padded) prompt width: ``input_ids[:, prompt_len:]`` are the output
    tokens; ``pad_left[i]`` left-padding positions of row ``i`` are not part of its prompt.
    """

    def __init__(self, prompt_len: int, pad_left: list[int], presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: float = 1.0):
        self.prompt_len = prompt_len
        self.pad_left = torch.as_tensor(pad_left, dtype=torch.long)
        self.presence = presence_penalty
        self.frequency = frequency_penalty
        self.repetition = repetition_penalty

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        if self.repetition != 1.0:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
            real = positions[None, :] >= self.pad_left.to(input_ids.device)[:, None]
            seen = torch.zeros(scores.shape, dtype=torch.long, device=scores.device)
            seen = seen.scatter_add_(1, input_ids, real.long()) > 0  # padding adds 0
            penalised = torch.where(scores > 0, scores / self.repetition, scores * self.repetition)
            scores = torch.where(seen, penalised, scores)
        out = input_ids[:, self.prompt_len:]
        if out.shape[1] and (self.presence or self.frequency):
            counts = torch.zeros(scores.shape, dtype=torch.float32, device=scores.device)
            counts.scatter_add_(1, out, torch.ones(out.shape, dtype=torch.float32, device=out.device))
            penalty = self.presence * (counts > 0).float() + self.frequency * counts
            scores = scores - penalty.to(scores.dtype)
        return scores


def sampling_warpers(sp: dict):
    """The warpers ``generate`` applies after the logits processors for a parsed sampling dict
    (none when greedy): temperature, top-k, top-p, each only where it changes something."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList()
    if not sp["greedy"]:
        if sp["temperature"] != 1.0:
            warpers.append(TemperatureLogitsWarper(sp["temperature"]))
        if sp["top_k"] > 0:
            warpers.append(TopKLogitsWarper(top_k=sp["top_k"]))
        if sp["top_p"] < 1.0:
            warpers.append(TopPLogitsWarper(top_p=sp["top_p"]))
    return warpers


def context_length(max_prompt_len: int, max_response_len: int, seq_length: int | None) -> int:
    """The engine's tokens per sequence, prompt + response: ``seq_length``, else the longest prompt
    plus the longest response (vLLM's ``max_model_len``, SGLang's ``context_length``)."""
    return seq_length or max_prompt_len + max_response_len


def check_lengths(prompts: list, max_tokens: int, max_prompt_len: int,
                  max_response_len: int, seq_length: int | None = None, continuation: bool = False) -> None:
    """Reject prompts and responses longer than the engine was configured for (a prompt must also
    leave room for one response token within ``seq_length``, when set). With ``continuation`` the
    prompts are multi-turn trajectories so far (prompt, turns and observations), which may be as
    long as the context (:func:`context_length`) less one token."""
    if max_tokens < 1 or max_tokens > max_response_len:
        raise ValueError(f"max_tokens={max_tokens} must be in [1, {max_response_len}] "
                         "(max_response_tokens_length)")
    context = context_length(max_prompt_len, max_response_len, seq_length)
    longest = context - 1 if continuation else max_prompt_len if seq_length is None \
        else min(max_prompt_len, seq_length - 1)
    for i, p in enumerate(prompts):
        if len(p) == 0 or len(p) > longest:
            raise ValueError(f"prompt {i} has {len(p)} tokens; expected 1 to {longest} "
                             + ("(the context, less one token)" if continuation
                                else "(max_prompt_tokens_length, and below seq_length)"))


def response_budgets(prompts: list, max_tokens: int, context: int) -> list[int]:
    """New tokens each prompt may get: ``max_tokens``, and at most ``context - len(prompt)``
    (``context``: :func:`context_length`, the engine's tokens per sequence)."""
    return [min(max_tokens, context - len(p)) for p in prompts]


def pack_samples(prompts: list, responses: list, logprobs: list, finished: list) -> Batch:
    """Pack prompts and their responses into a rollout batch (see ``chatlearn.models.base``).

    ``responses[i]``/``logprobs[i]``: the sampled tokens of sample i and their log-probs;
    ``finished[i]``: True when the response ended with EOS.
    """
    n = len(prompts)
    prompt_lens = np.array([len(p) for p in prompts], dtype=np.int64)
    resp_lens = np.array([len(r) for r in responses], dtype=np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(prompt_lens + resp_lens, out=offsets[1:])
    tokens = np.empty(int(offsets[-1]), dtype=np.int64)
    lps = np.zeros(int(offsets[-1]), dtype=np.float32)
    for i in range(n):
        start, mid, end = int(offsets[i]), int(offsets[i] + prompt_lens[i]), int(offsets[i + 1])
        tokens[start:mid] = prompts[i]
        tokens[mid:end] = responses[i]
        lps[mid:end] = logprobs[i]
    return {
        "tokens": tokens,
        "offsets": offsets,
        "prompt_lens": prompt_lens,
        "rollout_logprobs": lps,
        "finish_reasons": np.asarray(finished, dtype=np.int8).reshape(n),
    }


def onednn_linears_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`onednn_linears` applies: float32 on a CPU whose torch has oneDNN's linear ops."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


# oneDNN's weight reordering pays for itself over many decoding steps on large weights: measured here
# (2 cores, float32), reordering the 38M model's weights takes about 65 ms and saves about 4 ms per
# 32-row step, and oneDNN is slower than plain linear on small matrices (the 1.3M-parameter test model)
PACK_MIN_STEPS = 64          # longest response budget of the call
PACK_MIN_ELEMENTS = 1 << 18  # entries of a weight matrix


@contextlib.contextmanager
def onednn_linears(model: torch.nn.Module, rows: int, min_elements: int = PACK_MIN_ELEMENTS):
    """While open, every ``nn.Linear`` of ``model`` computes with a copy of its weight reordered
    once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, the weight
    prepacking of inductor's CPU freezing) through ``mkldnn._linear_pointwise``. A decoding step
    multiplies a few rows by every weight matrix; the plain ``linear`` repacks each weight for
    every such product (38M model, 32 rows, 256 steps: about 12 % of the generation). Used by
    generate calls whose longest budget reaches ``PACK_MIN_STEPS``. The copies exist
    only while the context is open (one generate call), so weight pushes, offload and onload
    never see them; the outputs are ``F.linear``'s up to float rounding. ``rows``: the expected
    rows per product (a hint to oneDNN); only weights of at least ``min_elements`` entries are
    reordered."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.dim() == 2
               and m.weight.numel() >= min_elements]
    try:
        for m in linears:
            packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), rows)
            bias = None if m.bias is None else m.bias.detach()
            m.forward = functools.partial(_onednn_linear, packed, bias)
        yield
    finally:
        for m in linears:
            m.__dict__.pop("forward", None)


def _onednn_linear(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def reserved_kv_cache(config, capacity: int):
    """A ``DynamicCache`` for ``config`` whose full-attention layers keep their keys and values in
    buffers reserved for ``capacity`` positions (:func:`_reserved_layer_class`): a decoding step
    writes its token in place, where ``DynamicLayer`` concatenates, copying the whole cache at
    every step (quadratic in the response length). Other layer kinds (sliding windows) stay as
    they are."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    reserved = _reserved_layer_class()
    if reserved is not None:
        cache.layers = [reserved(capacity) if type(layer) is reserved.__base__ else layer for layer in cache.layers]
    return cache


@functools.cache
def _reserved_layer_class():
    """``DynamicLayer`` with reserved storage (transformers >= 4.56 cache layers), or None."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return None

    class ReservedLayer(DynamicLayer):
        """Keys and values ``[batch, heads, length, dim]`` as views of ``[batch, heads, capacity, dim]``
        buffers; grows by doubling past the capacity. Supports what the decoding loop uses:
        ``update``, ``batch_select_indices`` and the length queries."""

        def __init__(self, capacity: int):
            super().__init__()
            self.capacity, self.length = int(capacity), 0
            self._k = self._v = None

        def _reserve(self, like: torch.Tensor, capacity: int, rows=None) -> None:
            b, h, _, d = like.shape if rows is None else (len(rows), *self._k.shape[1:])
            k = like.new_empty((b, h, capacity, d))
            v = like.new_empty((b, h, capacity, d))
            if self._k is not None and self.length:
                src = slice(None) if rows is None else rows
                k[:, :, :self.length] = self._k[src, :, :self.length]
                v[:, :, :self.length] = self._v[src, :, :self.length]
            self._k, self._v, self.capacity = k, v, capacity

        def update(self, key_states, value_states, *args, **kwargs):
            # the base's lazy initialization is not used (its signature varies across versions)
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            end = self.length + key_states.shape[-2]
            if self._k is None or end > self.capacity:
                self._reserve(key_states, max(end, self.capacity, 2 * self.capacity if self._k is not None else 0))
            self._k[:, :, self.length:end] = key_states
            self._v[:, :, self.length:end] = value_states
            self.length = end
            self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.length:
                self._reserve(self._k, self.capacity, rows=indices)
                self.keys, self.values = self._k[:, :, :self.length], self._v[:, :, :self.length]

        def _unsupported(self, *args, **kwargs):
            raise NotImplementedError("ReservedLayer supports update and batch_select_indices only")

        crop = batch_repeat_interleave = reset = _unsupported

    return ReservedLayer


def to_torch(value) -> torch.Tensor:
    """A CPU tensor viewing ``value`` (numpy array or tensor) without copying when possible.

    Read-only numpy arrays (as Ray hands them out) are accepted: the tensor is only read.
    bfloat16 arrays from ``ml_dtypes`` are reinterpreted bit for bit.
    """
    if isinstance(value, torch.Tensor):
        return value
    arr = np.asarray(value)
    if arr.dtype.name == "bfloat16":
        return to_torch(arr.view(np.uint16)).view(torch.bfloat16)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        return torch.from_numpy(arr)


def eos_token_ids(generation_config, model_config) -> list[int]:
    """End-of-sequence ids: the generation config's, else the model config's."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model_config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def release_cuda_cache(device: torch.device) -> None:
    """Give the CUDA caching allocator's free blocks back to the device (on CUDA only).

    Freed tensors stay reserved by torch's caching allocator, invisible to other processes
    (the trainer sharing the GPU); ``torch.cuda.empty_cache()`` releases the unused ones.
    ``gc.collect()`` first drops tensors kept alive only by reference cycles.
    """
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def set_cpu_threads(threads) -> None:
    """Set torch's intra-op (OpenMP) thread count for this process, when given.

    Where other busy processes share the cores (a trainer next to the rollout), spinning
    OpenMP workers slow a CPU engine down several times over; one thread avoids that.
    """
    if threads:
        torch.set_num_threads(int(threads))


# ---------------------------------------------------------------------------------------
# The transformers backend
# ---------------------------------------------------------------------------------------

class HFRollout(Rollout):
    """Rollout with a ``transformers`` model: ``generate``'s sampling in a loop of its own in which
    ended sequences leave the batch (:meth:`_generate_chunk`).

    cfg keys: ``load`` (model folder), ``trust_remote_code``, ``seed``,
    ``generation_batch_size`` (sequences decoded together), ``max_prompt_tokens_length``,
    ``max_response_tokens_length``, ``dtype`` ("float32" | "bfloat16" | "float16"),
    ``device`` ("cpu" | "cuda"), ``cpu_threads`` (None or a count: see ``set_cpu_threads``).
    """

    def __init__(self, cfg: dict):
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.cfg = dict(cfg)
        self.device = torch.device(cfg["device"])
        self.batch_size = int(cfg["generation_batch_size"])
        self.max_prompt_len = int(cfg["max_prompt_tokens_length"])
        self.max_response_len = int(cfg["max_response_tokens_length"])
        self.seq_length = None if cfg["seq_length"] is None else int(cfg["seq_length"])
        self._rng = np.random.default_rng(int(cfg["seed"]))
        if self.device.type == "cpu":
            set_cpu_threads(cfg["cpu_threads"])

        model = AutoModelForCausalLM.from_pretrained(
            cfg["load"], dtype=DTYPES[cfg["dtype"]],
            trust_remote_code=bool(cfg["trust_remote_code"]))
        self.model = model.to(self.device).eval()
        self.dtype = self.model.dtype
        loaded = self.model.generation_config
        self.eos_ids = eos_token_ids(loaded, self.model.config)
        pad = getattr(loaded, "pad_token_id", None)
        if pad is None:
            pad = getattr(self.model.config, "pad_token_id", None)
        if isinstance(pad, (list, tuple)):
            pad = pad[0] if pad else None
        if pad is None:
            pad = self.eos_ids[0] if self.eos_ids else 0
        self.pad_id = int(pad)
        # Sampling is defined by the sampling dict alone: a clean generation config keeps
        # a checkpoint's defaults (top_k, repetition_penalty, ...) from leaking in.
        self.model.generation_config = GenerationConfig(
            eos_token_id=self.eos_ids or None, pad_token_id=self.pad_id,
            bos_token_id=getattr(loaded, "bos_token_id", None))

        own_storage(self.model.parameters())  # offload must be able to free the weights
        # Parameters by every name they are known under (a tied lm_head.weight included).
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        # Offloaded storages: (storage, host copy) pairs; empty while the weights are on.
        self._offloaded: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    # -- generation -----------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: dict) -> Batch:
        if self._offloaded:
            raise RuntimeError("HFRollout.generate: weights are offloaded; call onload first")
        sp = parse_sampling(sampling)
        prompts = [[int(t) for t in p] for p in prompts]
        check_lengths(prompts, sp["max_tokens"], self.max_prompt_len, self.max_response_len, self.seq_length,
                      sp["continuation"])
        budgets = response_budgets(prompts, sp["max_tokens"],
                                   context_length(self.max_prompt_len, self.max_response_len, self.seq_length))
        seed = sp["seed"] if sp["seed"] is not None else int(self._rng.integers(2**31))

        responses, logprobs, finished = [], [], []
        devices = [self.device] if self.device.type == "cuda" else []
        # A private RNG stream: same seed + same weights + same prompts => same samples,
        # without touching the caller's global RNG state.
        packed = (onednn_linears(self.model, min(self.batch_size, len(prompts)), PACK_MIN_ELEMENTS)
                  if onednn_linears_available(self.device, self.dtype) and max(budgets, default=0) >= PACK_MIN_STEPS
                  else contextlib.nullcontext())
        with torch.random.fork_rng(devices=devices), packed:
            torch.manual_seed(seed)
            for start in range(0, len(prompts), self.batch_size):
                r, lp, f = self._generate_chunk(prompts[start:start + self.batch_size], sp,
                                                budgets[start:start + self.batch_size])
                responses += r
                logprobs += lp
                finished += f
        return pack_samples(prompts, responses, logprobs, finished)

    @torch.no_grad()
    def _generate_chunk(self, prompts: list[list[int]], sp: dict, budgets: list[int]):
        """One batch of prompts decoded together; sample i keeps at most ``budgets[i]`` new tokens.

        The decoding loop of ``transformers``' ``generate`` (sampling) with one difference: a
        sequence that has ended (EOS or its budget) leaves the batch at once, its rows dropped from
        the KV cache (``batch_select_indices``), so the steps after it compute only
        the sequences still running, where ``generate`` keeps feeding every ended one padding until
        the last ends. Per step, as ``generate`` does: the raw logits of the last position, the
        penalties (:class:`PenaltyLogitsProcessor`), then ``TemperatureLogitsWarper``,
        ``TopKLogitsWarper``, ``TopPLogitsWarper`` (those the sampling dict turns on), then
        ``argmax`` (greedy) or ``multinomial(softmax)``. Log-probs are those of the raw logits at
        ``temperature`` (untouched by top-p or top-k). Prompts are left-padded; position ids count
        each row's real tokens only.
        """
        n, width = len(prompts), max(len(p) for p in prompts)
        steps = max(budgets)
        dev = self.device
        seqs = torch.full((n, width + steps), self.pad_id, dtype=torch.long, device=dev)
        mask = torch.zeros((n, width + steps), dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):  # left padding
            seqs[i, width - len(p):width] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):width] = 1
        pad_left = torch.tensor([width - len(p) for p in prompts], dtype=torch.long, device=dev)
        penalty = (PenaltyLogitsProcessor(width, pad_left.tolist(), sp["presence_penalty"], sp["frequency_penalty"],
                                          sp["repetition_penalty"]) if penalties_on(sp) else None)
        warpers = sampling_warpers(sp)
        eos = torch.tensor(self.eos_ids or [-1], dtype=torch.long, device=dev)
        budget = torch.tensor(budgets, dtype=torch.long, device=dev)
        token_lp = torch.zeros((n, steps), dtype=torch.float32, device=dev)
        length = torch.zeros(n, dtype=torch.long, device=dev)
        finished = torch.zeros(n, dtype=torch.bool, device=dev)

        rows = torch.arange(n, device=dev)  # the batch's rows still running
        cache = reserved_kv_cache(self.model.config, width + steps)
        positions = (mask[:, :width].cumsum(-1) - 1).clamp_(min=0)
        out = self.model(input_ids=seqs[:, :width], attention_mask=mask[:, :width], position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        next_pos = positions[:, -1:] + 1
        for step in range(steps):
            logits = out.logits[:, -1].float()
            cur = width + step
            scores = logits
            if penalty is not None:
                penalty.pad_left = pad_left[rows]
                scores = penalty(seqs[rows, :cur], scores)
            scores = warpers(seqs[rows, :cur], scores)
            if sp["greedy"]:
                tokens = scores.argmax(-1)
            else:
                tokens = torch.multinomial(torch.softmax(scores, -1), num_samples=1).squeeze(1)
            token_lp[rows, step] = torch.log_softmax(logits / sp["temperature"], -1).gather(1, tokens[:, None])[:, 0]
            seqs[rows, cur] = tokens
            mask[rows, cur] = 1
            length[rows] = step + 1
            ended = torch.isin(tokens, eos)
            finished[rows] = ended
            stop = ended | (step + 1 >= budget[rows])
            if bool(stop.all()):
                break
            if bool(stop.any()):
                keep = (~stop).nonzero()[:, 0]
                cache.batch_select_indices(keep)
                rows, tokens, next_pos = rows[keep], tokens[keep], next_pos[keep]
            out = self.model(input_ids=tokens[:, None], attention_mask=mask[rows, :cur + 1], position_ids=next_pos,
                             past_key_values=cache, use_cache=True)
            next_pos = next_pos + 1

        new_tokens, token_lp = seqs[:, width:].cpu().numpy(), token_lp.cpu().numpy()
        length, finished = length.cpu().numpy(), finished.cpu().numpy()
        return ([new_tokens[i, :length[i]] for i in range(n)], [token_lp[i, :length[i]] for i in range(n)],
                [bool(f) for f in finished])

    # -- weights ----------------------------------------------------------------------

    def begin_weight_update(self) -> None:
        """Start a streamed update (``chatlearn.runtime.weight_sync``); nothing to prepare."""
        if self._offloaded:
            raise RuntimeError("HFRollout: weights are offloaded; onload them before a push")

    @torch.no_grad()
    def load_weight_bucket(self, weights: list) -> None:
        """Copy one bucket's ``(hf_name, tensor or array)`` pairs straight into the model's
        parameters (and persistent buffers); no staging: the views are only valid during this
        call. A tied ``lm_head.weight`` is the embedding itself: either name updates it.
        """
        if self._offloaded:
            raise RuntimeError("HFRollout.load_weight_bucket: weights are offloaded; onload first")
        buffers = None
        for name, value in weights:
            target = self._params.get(name)
            if target is None:
                if buffers is None:
                    buffers = dict(self.model.named_buffers())
                target = buffers.get(name)
            if target is None:
                raise KeyError(f"HFRollout.load_weight_bucket: unknown weight {name!r}")
            src = to_torch(value)
            if tuple(src.shape) != tuple(target.shape):
                raise ValueError(f"{name}: shape {tuple(src.shape)} != {tuple(target.shape)}")
            target.data.copy_(src)

    def finish_weight_update(self) -> None:
        """End a streamed update; every bucket is already in place."""

    # -- memory -----------------------------------------------------------------------

    @torch.no_grad()
    def offload(self, parts: Iterable[str]) -> dict:
        """``weights``: copy every parameter storage to host memory, then free it.

        Buffers (e.g. rotary ``inv_freq``) stay in place. ``kv_cache``: the cache lives
        only inside a ``generate`` call, so there is nothing to free. On CUDA the freed
        storages (and the KV cache of the last ``generate``) are then returned to the device
        (:func:`release_cuda_cache`); the host copies are pinned for fast copies back.
        """
        if Part.WEIGHTS not in set(parts) or self._offloaded:
            release_cuda_cache(self.device)
            return {"bytes": 0}
        seen, moved, device_bytes = set(), 0, None
        for param in self.model.parameters():
            storage = param.data.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue  # tied / shared storages are handled once
            seen.add(storage.data_ptr())
            device_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8,
                               pin_memory=storage.device.type == "cuda")
            host.copy_(device_bytes)
            self._offloaded.append((storage, host))
            moved += storage.nbytes()
        del device_bytes
        for storage, _ in self._offloaded:
            storage.resize_(0)
        release_cuda_cache(self.device)
        return {"bytes": moved}

    @torch.no_grad()
    def onload(self, parts: Iterable[str]) -> dict:
        """Restore the offloaded parameter storages bit for bit (same tensors, same views)."""
        if Part.WEIGHTS not in set(parts) or not self._offloaded:
            return {"bytes": 0}
        moved = 0
        for storage, host in self._offloaded:
            storage.resize_(host.numel())
            device_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            device_bytes.copy_(host, non_blocking=host.is_pinned())
            moved += host.numel()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._offloaded = []
        return {"bytes": moved}
