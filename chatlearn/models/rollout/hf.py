"""Rollout over Hugging Face transformers: batched ``model.generate`` with a KV cache.

The simplest engine, and on a CPU the fastest one for small models. It returns, for each
sampled token, ``log_softmax(raw_logits / temperature)`` at that token: the untruncated,
temperature-scaled distribution that the trainer computes too (top-p/top-k only shape
what is sampled, never the reported log-probs).
"""
from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Iterable

import numpy as np
import torch

from chatlearn.config.names import Part
from chatlearn.models.base import Batch, Rollout
from chatlearn.models.moe import layout as moe_layout
from chatlearn.models.moe.routing import DecodeRoutes, RouterPatch, routers
from chatlearn.models.rollout.common import (check_lengths, context_length, eos_token_ids, pack_samples,
                                             parse_sampling, penalties_on, release_cuda_cache, response_budgets,
                                             set_cpu_threads, to_torch)
from chatlearn.models.stash import own_storage
from chatlearn.models.vision import embed_with_images, is_vlm, model_class, sample_grids, sample_positions, stack_images

if TYPE_CHECKING:
    from chatlearn.models.specs import RolloutSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------
# Helpers of the transformers engine (those the adapters share are in common.py)
# ---------------------------------------------------------------------------------------

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
        """Keys and values ``[batch, heads, length, dim]`` as views of ``[rows, heads, capacity, dim]``
        buffers; grows by doubling past the capacity. Supports what the decoding loop uses:
        ``update``, ``move_rows`` (the batch shrinks in place), ``batch_select_indices`` and the
        length queries."""

        def __init__(self, capacity: int):
            super().__init__()
            self.capacity, self.length, self.rows = int(capacity), 0, 0
            self._k = self._v = None

        def _reserve(self, like: torch.Tensor, capacity: int, rows=None) -> None:
            """New buffers of ``capacity`` positions for the batch's rows (``rows``: the indices of
            the rows kept, else the first ``like.shape[0]``), the cached positions copied."""
            b, h, _, d = like.shape if rows is None else (len(rows), *self._k.shape[1:])
            k = like.new_empty((b, h, capacity, d))
            v = like.new_empty((b, h, capacity, d))
            if self._k is not None and self.length:
                src = slice(0, b) if rows is None else rows
                k[:, :, :self.length] = self._k[src, :, :self.length]
                v[:, :, :self.length] = self._v[src, :, :self.length]
            self._k, self._v, self.capacity = k, v, capacity

        def update(self, key_states, value_states, *args, **kwargs):
            # the base's lazy initialization is not used (its signature varies across versions)
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            end, b = self.length + key_states.shape[-2], key_states.shape[0]
            if self._k is None or end > self.capacity or b > self._k.shape[0]:
                self._reserve(key_states, max(end, self.capacity, 2 * self.capacity if self._k is not None else 0))
            self._k[:b, :, self.length:end] = key_states
            self._v[:b, :, self.length:end] = value_states
            self.length, self.rows = end, b
            self.keys, self.values = self._k[:b, :, :end], self._v[:b, :, :end]
            return self.keys, self.values

        def move_rows(self, dst: torch.Tensor, src: torch.Tensor, rows: int) -> None:
            """The batch becomes its first ``rows`` rows after row ``src[i]`` is copied onto row
            ``dst[i]`` (the cached positions only; the buffers stay, nothing is allocated)."""
            if self.length and len(dst):
                self._k[dst, :, :self.length] = self._k[src, :, :self.length]
                self._v[dst, :, :self.length] = self._v[src, :, :self.length]
            self.rows = rows
            if self._k is not None:
                self.keys, self.values = self._k[:rows, :, :self.length], self._v[:rows, :, :self.length]

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.length:
                self._reserve(self._k, self.capacity, rows=indices)
                self.rows = len(indices)
                self.keys, self.values = self._k[:, :, :self.length], self._v[:, :, :self.length]

        def _unsupported(self, *args, **kwargs):
            raise NotImplementedError("ReservedLayer supports update, move_rows and batch_select_indices only")

        crop = batch_repeat_interleave = reset = _unsupported

    return ReservedLayer


# Decoding steps between two reads of which rows still run. On a GPU a read waits for every queued
# kernel and leaves the device idle until the host launches the next ones: 16 steps per read there
# (at most 15 steps of a row that ended are computed for nothing). On the CPU a read costs nothing:
# every step, so a row leaves as soon as it ends.
CHECK_EVERY = {"cuda": 16, "cpu": 1}


def decode_mask_kind(config) -> str:
    """How a decoding step hands the model its attention mask: ``"bool"`` (SDPA) or ``"float"``
    (eager attention, additive), a 4D mask that transformers takes as it is; ``"2d"`` for other
    attention kernels and for models with sliding-window layers (the 4D mask would drop their
    window): the padding mask, from which transformers builds the masks itself, reading the mask on
    the host at every step (``masking_utils``: whether any position is padding)."""
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types - {"full_attention"} or getattr(config, "use_sliding_window", False):
        return "2d"
    kinds = {"sdpa": "bool", CPU_GQA_SDPA: "bool", "eager": "float"}
    impl = getattr(config, "_attn_implementation", None)
    return kinds[impl] if impl in kinds else "2d"


CPU_GQA_SDPA = "chatlearn_cpu_gqa_sdpa"  # the attention the transformers engine gives an SDPA model on the CPU


def cpu_gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention (``sdpa_attention_forward``), except for a one-token query (a
    decoding step) with a mask on the CPU: grouped-query KV heads go to SDPA as they are
    (``enable_gqa``) where transformers repeats them to the query heads' count whenever there is a
    mask (CUDA's kernels that take a mask do not take grouped heads; the CPU's do), copying the
    whole KV cache of every layer at every step. Measured here (2 cores, 32 rows, 300 positions,
    8 query / 2 KV heads): 1.2 ms per layer instead of 2.9."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = kwargs.get("position_bias") is None and kwargs.get("cache") is None
    if query.device.type != "cpu" or not grouped or attention_mask is None or query.shape[2] != 1 or not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask[:, :, :, :key.shape[-2]], dropout_p=dropout, scale=scaling,
        enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_cpu_gqa_sdpa(model) -> bool:
    """Give a model on the CPU whose attention is transformers' SDPA :func:`cpu_gqa_sdpa` instead
    (registered once with transformers' attention and mask interfaces, its masks those of SDPA);
    returns whether it did."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or model.device.type != "cpu":
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CPU_GQA_SDPA, cpu_gqa_sdpa)
    AttentionMaskInterface.register(CPU_GQA_SDPA, sdpa_mask)
    model.set_attn_implementation(CPU_GQA_SDPA)
    return model.config._attn_implementation == CPU_GQA_SDPA


def step_mask(amask: torch.Tensor, length: int, kind: str, dtype: torch.dtype, padded: bool) -> torch.Tensor | None:
    """The attention mask of a decoding step over the first ``length`` positions of the batch's
    padding mask ``amask`` (bool, ``[rows, positions]``), as :func:`decode_mask_kind` says; None
    when no running row has padding (``padded`` False, known on the host): a one-token query then
    attends to every cached position, and SDPA runs without a mask (with grouped-query attention
    natively, where a mask makes transformers repeat the KV heads)."""
    if not padded and kind != "2d":
        return None
    m = amask[:, :length]
    if kind == "bool":  # contiguous, as transformers builds it (a strided view costs every layer's SDPA more)
        return m[:, None, None, :].contiguous()
    if kind == "float":
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)[:, None, None]
    return m


def next_position(positions: torch.Tensor) -> torch.Tensor:
    """``[rows, 1]``: the position of the first generated token of each row, one past the prompt's last (a
    vision-language model's ``[3, rows, width]`` positions: their text section, where the three are equal)."""
    return (positions[0] if positions.dim() == 3 else positions)[:, -1:] + 1


class _RunningRows:
    """The decoding batch's rows (row b of the batch is sample ``rows[b]``), with what each needs
    from step to step: whether it still runs (``alive``, on the device), its budget (on the device
    and on the host), its padding mask, its next position and its last token."""

    def __init__(self, budgets: list[int], pads: list[int], amask: torch.Tensor, next_pos: torch.Tensor,
                 device: torch.device):
        self.device = device
        self.host_budget, self.host_pad = list(budgets), list(pads)
        self.rows = torch.arange(len(budgets), device=device)
        self.alive = torch.ones(len(budgets), dtype=torch.bool, device=device)
        self.budget = self._tensor(budgets)
        self.amask, self.next_pos, self.tokens = amask, next_pos, None

    @property
    def padded(self) -> bool:
        """Whether a row of the batch has left padding (its prompt is shorter than the longest)."""
        return any(self.host_pad)

    def _tensor(self, values: list[int]) -> torch.Tensor:
        """``values`` on the device without waiting for it (a pinned copy on CUDA)."""
        t = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def advance(self, tokens: torch.Tensor, ended: torch.Tensor, step: int, cur: int) -> None:
        """After step ``step`` wrote position ``cur``: the rows that ended or spent their budget stop."""
        self.tokens = tokens
        self.alive = self.alive & ~ended & (self.budget > step + 1)
        self.amask[:, cur] = True

    def keep(self, step: int, read: bool) -> list[int] | None:
        """The batch rows to keep after ``step``, or None to keep the batch as it is. ``read``: ask
        the device which rows still run (one wait); otherwise only rows whose budget is spent (known
        here) leave, and rows that ended by EOS since the last read stay until the next."""
        if read:
            keep = self.alive.nonzero()[:, 0].tolist()
        else:
            keep = [b for b, budget in enumerate(self.host_budget) if budget > step + 1]
        return None if len(keep) == len(self.host_budget) else keep

    def compact(self, keep: list[int], cache) -> None:
        """Keep the batch rows ``keep`` (ascending): each running row past the new batch size moves
        into the place of a row that leaves; the cache's layers move the same rows."""
        m, kept = len(keep), set(keep)
        holes = [b for b in range(m) if b not in kept]
        movers = [b for b in keep if b >= m]
        dst, src = self._tensor(holes), self._tensor(movers)
        order = list(range(m))
        for h, s in zip(holes, movers):
            order[h] = s
            self.host_budget[h], self.host_pad[h] = self.host_budget[s], self.host_pad[s]
        self.host_budget, self.host_pad = self.host_budget[:m], self.host_pad[:m]
        for layer in cache.layers:
            if hasattr(layer, "move_rows"):
                layer.move_rows(dst, src, m)
            else:  # another layer kind (e.g. a sliding window): its own selection
                layer.batch_select_indices(self._tensor(order))
        for name in ("rows", "alive", "budget", "amask", "next_pos", "tokens"):
            t = getattr(self, name)
            if holes:
                t[dst] = t[src]
            setattr(self, name, t[:m])


# ---------------------------------------------------------------------------------------
# The transformers backend
# ---------------------------------------------------------------------------------------

class HFRollout(Rollout):
    """Rollout with a ``transformers`` model: ``generate``'s sampling in a loop of its own in which
    ended sequences leave the batch (:meth:`_generate_chunk`).

    ``spec``: a :class:`~chatlearn.models.specs.RolloutSpec` resolved for its device, kept as
    ``self.spec``; the fields read: ``load`` (model folder), ``trust_remote_code``, ``seed``,
    ``generation_batch_size`` (sequences decoded together), ``max_prompt_tokens_length``,
    ``max_response_tokens_length``, ``seq_length``, ``dtype`` ("float32" | "bfloat16" | "float16"),
    ``device`` ("cpu" | "cuda"), ``cpu_threads`` (None or a count: see ``set_cpu_threads``),
    ``routing_replay`` ("rollout" on an MoE model: the batch carries ``routed_experts``, each token's top-k
    experts per MoE layer as the prefill and the decoding steps routed it; ``chatlearn/models/moe``).
    """

    def __init__(self, spec: RolloutSpec):
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.spec = spec
        self.device = torch.device(spec.device)
        self.batch_size = int(spec.generation_batch_size)
        self.max_prompt_len = int(spec.max_prompt_tokens_length)
        self.max_response_len = int(spec.max_response_tokens_length)
        self.seq_length = None if spec.seq_length is None else int(spec.seq_length)
        self._rng = np.random.default_rng(int(spec.seed))
        if self.device.type == "cpu":
            set_cpu_threads(spec.cpu_threads)

        model = model_class(spec.load, AutoModelForCausalLM, bool(spec.trust_remote_code)).from_pretrained(
            spec.load, dtype=DTYPES[spec.dtype],
            trust_remote_code=bool(spec.trust_remote_code))
        self.model = model.to(self.device).eval()
        self.vlm = is_vlm(self.model)  # prompts may come with images (chatlearn/models/vision.py)
        use_cpu_gqa_sdpa(self.model)
        self.read_every = CHECK_EVERY[self.device.type] if self.device.type in CHECK_EVERY else CHECK_EVERY["cuda"]
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

        # routing_replay: rollout: every MoE router records each token's top-k experts while generating
        # (prefill and decoding steps), returned as the batch's routed_experts (chatlearn/models/moe)
        self.routing = (RouterPatch(self.model) if spec.routing_replay == "rollout" and routers(self.model)
                        else None)
        own_storage(self.model.parameters())  # offload must be able to free the weights
        # Parameters by every name they are known under (a tied lm_head.weight included).
        self._params = dict(self.model.named_parameters(remove_duplicate=False))
        # Offloaded storages: (storage, host copy) pairs; empty while the weights are on.
        self._offloaded: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    # -- generation -----------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: dict, images: list | None = None) -> Batch:
        """``Rollout.generate``; ``images``: with a vision-language model, each prompt's image dict (or None;
        chatlearn/models/vision.py)."""
        if self._offloaded:
            raise RuntimeError("HFRollout.generate: weights are offloaded; call onload first")
        sp = parse_sampling(sampling)
        prompts = [[int(t) for t in p] for p in prompts]
        if images is not None and not self.vlm and any(x is not None for x in images):
            raise ValueError(f"{type(self.model).__name__} takes no images (prompts with images need a "
                             "vision-language model)")
        images = images if images is not None else [None] * len(prompts)
        check_lengths(prompts, sp["max_tokens"], self.max_prompt_len, self.max_response_len, self.seq_length,
                      sp["continuation"])
        budgets = response_budgets(prompts, sp["max_tokens"],
                                   context_length(self.max_prompt_len, self.max_response_len, self.seq_length))
        seed = sp["seed"] if sp["seed"] is not None else int(self._rng.integers(2**31))

        responses, logprobs, finished, routes = [], [], [], []
        devices = [self.device] if self.device.type == "cuda" else []
        # A private RNG stream: same seed + same weights + same prompts => same samples,
        # without touching the caller's global RNG state.
        packed = (onednn_linears(self.model, min(self.batch_size, len(prompts)), PACK_MIN_ELEMENTS)
                  if onednn_linears_available(self.device, self.dtype) and max(budgets, default=0) >= PACK_MIN_STEPS
                  else contextlib.nullcontext())
        if self.routing is not None:
            self.routing.start_capture()
        try:
            with torch.random.fork_rng(devices=devices), packed:
                torch.manual_seed(seed)
                for start in range(0, len(prompts), self.batch_size):
                    r, lp, f, rt = self._generate_chunk(prompts[start:start + self.batch_size], sp,
                                                        budgets[start:start + self.batch_size],
                                                        images[start:start + self.batch_size])
                    responses += r
                    logprobs += lp
                    finished += f
                    routes += rt
        finally:
            if self.routing is not None:
                self.routing.off()
        out = pack_samples(prompts, responses, logprobs, finished)
        if self.routing is not None:
            out["routed_experts"] = moe_layout.assemble(routes, np.diff(out["offsets"]), self.routing.layout)
        return out

    @torch.no_grad()
    def _generate_chunk(self, prompts: list[list[int]], sp: dict, budgets: list[int], images: list | None = None):
        """One batch of prompts decoded together; sample i keeps at most ``budgets[i]`` new tokens.

        The decoding loop of ``transformers``' ``generate`` (sampling), with ended sequences (EOS
        or their budget) leaving the batch, so later steps compute only the sequences still
        running, where ``generate`` feeds every ended one padding until the last ends. Per step, as
        ``generate`` does: the raw logits of the last position, the penalties
        (:class:`PenaltyLogitsProcessor`), then ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
        ``TopPLogitsWarper`` (those the sampling dict turns on), then ``argmax`` (greedy) or
        ``multinomial(softmax)``. Log-probs are those of the raw logits at ``temperature``
        (untouched by top-p or top-k). Prompts are left-padded; position ids count each row's real
        tokens only (with images: :meth:`_prefill_inputs`).

        What runs where (:class:`_RunningRows`): which rows are still running is kept on the device
        and read on the host only every ``read_every`` steps (``CHECK_EVERY``: 16 on a GPU, where
        each read waits for the device, every step on the CPU, where it costs nothing;
        rows whose budget ends are known on the host and leave at once, without a read); a row that
        ended between two reads runs on, its tokens past its end ignored. Leaving rows are removed
        by moving the last running rows into their places (``ReservedLayer.move_rows``), so the KV
        cache copies only the rows that move, never the whole cache. The attention mask of a step
        is a ready 4D view of the batch's padding mask (:func:`decode_mask_kind`), which
        transformers uses as it is, instead of a 2D mask it would read on the host every step.
        """
        n, width = len(prompts), max(len(p) for p in prompts)
        steps, dev = max(budgets), self.device
        seqs = torch.full((n, width + steps), self.pad_id, dtype=torch.long, device=dev)
        amask = torch.zeros((n, width + steps), dtype=torch.bool, device=dev)
        for i, p in enumerate(prompts):  # left padding
            seqs[i, width - len(p):width] = torch.tensor(p, dtype=torch.long)
            amask[i, width - len(p):width] = True
        pad_left = torch.tensor([width - len(p) for p in prompts], dtype=torch.long, device=dev)
        penalty = (PenaltyLogitsProcessor(width, pad_left.tolist(), sp["presence_penalty"], sp["frequency_penalty"],
                                          sp["repetition_penalty"]) if penalties_on(sp) else None)
        warpers = sampling_warpers(sp)
        eos = torch.tensor(self.eos_ids or [-1], dtype=torch.long, device=dev)
        token_lp = torch.zeros((n, steps), dtype=torch.float32, device=dev)
        length = torch.zeros(n, dtype=torch.long, device=dev)
        finished = torch.zeros(n, dtype=torch.bool, device=dev)

        cache = reserved_kv_cache(self.model.config, width + steps)
        inputs, positions = self._prefill_inputs(seqs[:, :width], amask[:, :width], prompts, images)
        out = self.model(**inputs, attention_mask=amask[:, :width].long(), position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        routes = DecodeRoutes(self.routing, n, width, steps, dev) if self.routing is not None else None
        batch = _RunningRows(budgets, [width - len(p) for p in prompts], amask, next_position(positions), dev)
        mask_kind = decode_mask_kind(self.model.config)
        for step in range(steps):
            cur, rows, live = width + step, batch.rows, batch.alive
            logits = out.logits[:, -1].float()
            ids = None
            if penalty is not None:
                penalty.pad_left, ids = pad_left[rows], seqs[rows, :cur]
            scores = warpers(ids, penalty(ids, logits) if penalty is not None else logits)
            if sp["greedy"]:
                tokens = scores.argmax(-1)
            else:
                tokens = torch.multinomial(torch.softmax(scores, -1), num_samples=1).squeeze(1)
            token_lp[rows, step] = torch.log_softmax(logits / sp["temperature"], -1).gather(1, tokens[:, None])[:, 0]
            seqs[rows, cur] = tokens
            length[rows] = torch.where(live, step + 1, length[rows])
            ended = (tokens[:, None] == eos[None, :]).any(-1) & live
            finished[rows] = finished[rows] | ended
            batch.advance(tokens, ended, step, cur)
            keep = batch.keep(step, read=(step + 1) % self.read_every == 0)
            if step + 1 == steps or keep == []:
                break
            if keep is not None:
                batch.compact(keep, cache)
            mask = step_mask(batch.amask, cur + 1, mask_kind, self.dtype, batch.padded)
            out = self.model(input_ids=batch.tokens[:, None], attention_mask=mask, position_ids=batch.next_pos,
                             past_key_values=cache, use_cache=True)
            if routes is not None:  # the routes of the token at position cur of each running row
                routes.step(batch.rows, cur)
            batch.next_pos = batch.next_pos + 1

        new_tokens, token_lp = seqs[:, width:].cpu().numpy(), token_lp.cpu().numpy()
        length, finished = length.cpu().numpy(), finished.cpu().numpy()
        per_sample = routes.per_sample([len(p) for p in prompts], length) if routes is not None else [None] * n
        return ([new_tokens[i, :length[i]] for i in range(n)], [token_lp[i, :length[i]] for i in range(n)],
                [bool(f) for f in finished], per_sample)

    def _prefill_inputs(self, ids: torch.Tensor, amask: torch.Tensor, prompts: list[list[int]], images: list):
        """``({"input_ids": ...} or {"inputs_embeds": ...}, position ids)`` of the prefill of the left-padded
        prompts ``ids``: the text path (positions count each row's real tokens), or with images the embeddings
        with the images' features in place (:func:`embed_with_images`) and ``[3, rows, width]`` multimodal
        rotary positions, each row's computed by the model for its prompt alone (:func:`sample_positions`)."""
        if not self.vlm or images is None or all(x is None for x in images):
            return {"input_ids": ids}, (amask.long().cumsum(-1) - 1).clamp_(min=0)
        width = ids.shape[1]
        positions = torch.zeros((3, *ids.shape), dtype=torch.long, device=ids.device)
        for i, (grid, p) in enumerate(zip(sample_grids(images), prompts, strict=True)):
            positions[:, i, width - len(p):] = sample_positions(self.model, ids[i, width - len(p):], grid, len(p))
        pixels, grid = stack_images(images)
        embeds = embed_with_images(self.model, ids, pixels.to(self.dtype), grid)
        return {"inputs_embeds": embeds}, positions

    @torch.no_grad()
    def probe_logprobs(self, tokens: list[int]) -> dict:
        """``Rollout.probe_logprobs``: one forward of ``tokens`` without a cache (nothing sampled, no RNG)."""
        if self._offloaded:
            raise RuntimeError("HFRollout.probe_logprobs: weights are offloaded; call onload first")
        ids = torch.tensor([[int(t) for t in tokens]], dtype=torch.long, device=self.device)
        logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        found = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
        return {"logprobs": found.cpu().numpy().astype(np.float32), "dtype": str(self.spec.dtype)}

    # -- weights ----------------------------------------------------------------------

    def begin_weight_update(self) -> None:
        """Start a streamed update (``chatlearn.runtime.weight_push.stream``); nothing to prepare."""
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
