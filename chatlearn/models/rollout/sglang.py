"""Rollout over SGLang's offline engine (``sglang.Engine``, SGLang >= 0.5.3; GPU only).

Tested only against a fake of the engine API (``tests/support/fake_sglang``); not yet run
against real SGLang on hardware (``tests/models/rollout/test_rollout_cpu.py`` holds the GPU test).

Engine. ``sglang.Engine(model_path=load, tp_size, base_gpu_id=0, gpu_id_step=1, mem_fraction_static,
dtype, context_length = max prompt + max response + 6 (see Lengths),
max_running_requests = generation_batch_size, disable_cuda_graph = enforce_eager, random_seed = seed,
skip_tokenizer_init=True, enable_memory_saver=True, enable_weights_cpu_backup=True,
enable_deterministic_inference = deterministic_inference)``, and with deterministic inference
an explicit ``attention_backend`` (see :func:`deterministic_attention_backend`).

Lengths. A run's sequences hold up to ``context`` tokens (max prompt + max response, or
``seq_length``); a prompt may have up to ``context - 1`` (a multi-turn continuation), and a request
asks for at most ``context - len(prompt)`` new tokens. SGLang's own limits on an engine of
``context_length`` c (0.5.3 to 0.5.23, without ``allow_auto_truncate``):
``TokenizerManager._validate_one_request`` refuses input + ``max_new_tokens`` >= c (``>=`` to 0.5.10,
``>`` from 0.5.16); the scheduler (``tp_worker.py``, ``scheduler.py``) takes ``max_req_len =
min(c - 1, KV tokens - 1)``, aborts an input of ``max_req_len - 5`` tokens or more
(``validate_input_length``) and cuts ``max_new_tokens`` to ``max_req_len - input - 1`` without a
word (``init_req_max_new_tokens``). So the engine gets ``c = context + 6``
(:func:`engine_context_length`) and a KV pool of at least c tokens: every request of the run is
admitted whole. Those 6 tokens are room in SGLang's bookkeeping, never positions of a sequence.
SGLang refuses a ``context_length`` above the model's (``ModelConfig._derive_context_length``:
``get_context_length`` of the HF config, the first of ``max_sequence_length``, ``seq_length``,
``max_seq_len``, ``model_max_length``, ``max_position_embeddings``, see
:func:`derived_context_length`) unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN`` is true: when
the run's ``context`` fits the model but c does not, that variable is set to 1 while the engine
starts (SGLang reads it then, in this process and in the schedulers it spawns, and logs its warning
about a context_length above the model's); a ``context`` above the model's is refused here.

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
then ``load_weight_bucket`` or ``load_weight_slot`` per bucket, then ``finish_weight_update``) goes to
``update_weights_from_tensor(named_tensors, flush_cache=False)``, which serialises the list once per
TP rank (``MultiprocessingSerializer``: CUDA tensors as IPC handles) and loads it in each rank's
scheduler with the model's own loader (HF names; q/k/v and gate/up are fused there, each rank
narrows the full tensor to its shard). With one rank (``tp_size`` 1) the pairs are plain tensors,
copied to the rollout's device first (CUDA IPC, as verl does; the views given are valid only
during the call). With several, every scheduler would open the one GPU's tensors and copy them
over, with a CUDA context on that GPU in each: instead each name is a ``LocalSerializedTensor``
whose ``values[r]`` is a serialised tensor on TP rank r's GPU (``base_gpu_id + r * gpu_id_step`` of
the devices this process sees, which the schedulers inherit), and the scheduler of rank r loads
``values[r]``, as SGLang's ``weight_sync.utils.update_weights`` (used by verl) hands them over.
With the ``cuda_ipc`` transport such an engine maps the trainer's slots itself
(``maps_weight_slots``): the slot of each rank's GPU is mapped once per push in this process
(:meth:`SGLangRollout.attach_weight_slots`), and each bucket is copied within that GPU into a
tensor of this process (torch refuses to share a tensor mapped from another process) and
serialised for its rank. Otherwise (a bucket in host memory or on this process's GPU) it is copied
to every rank's GPU. ``update_weights_from_tensor`` returns once the engine has loaded the
tensors, and the copies are dropped then. A tied ``lm_head.weight`` is not sent (SGLang's loaders
skip it). The prefix (radix) cache is flushed once before the next generation. This process does
not apply SGLang's ``monkey_patch_torch_reductions`` (it would replace torch's
``rebuild_cuda_tensor``, which the trainer's slot handles name): the device indices in the handles
are this process's, the schedulers' too.

Memory. ``offload`` is ``release_memory_occupation(tags=[...])`` with the tags
``weights`` and ``kv_cache`` (torch_memory_saver; weights are kept in host memory by
``enable_weights_cpu_backup``), ``onload`` is ``resume_memory_occupation`` per tag, so
new weights can be pushed between the two wake steps. CUDA-graph memory is not released.
torch_memory_saver frees the engine processes' memory; this (adapter) process holds only
the tensors it staged for weight pushes, which torch's caching allocator keeps reserved
after they are dropped: ``offload`` and ``finish_weight_update`` empty that cache (every device's).
With several TP ranks it stages them on every rank's GPU, and so holds a CUDA context on each.
The reported bytes are those of the weights (from the checkpoint's tensor shapes, at the
engine's dtype); SGLang does not report the KV cache's size, which counts as 0.
"""
from __future__ import annotations

import contextlib
import gc
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
from chatlearn.models.weight_buckets import device_stream, entry_views, ipc_rebuild, slots_for_device

if TYPE_CHECKING:
    from chatlearn.models.specs import RolloutSpec

# The parts this engine holds. SGLang's memory saver names its tags as we name these parts; the
# tags go to its API as the plain strings (str(part)).
PARTS = (Part.WEIGHTS, Part.KV_CACHE)
FINISH_REASONS = {"stop": 1, "length": 0}
# SGLang's scheduler admits an input below min(context_length - 1, KV tokens - 1) - 5 tokens and cuts
# max_new_tokens to that min - input - 1: the engine's context is the run's plus this (see Lengths)
SCHEDULER_RESERVE = 6
# SGLang runs TP rank r on GPU BASE_GPU_ID + r * GPU_ID_STEP of the devices this process sees (passed
# to the engine, so that the weight push knows each rank's GPU)
BASE_GPU_ID, GPU_ID_STEP = 0, 1
# ModelConfig: the HF config keys SGLang reads the model's context length from, the first present wins
# (get_context_length, srt/utils/hf_transformers_utils.py in 0.5.3, srt/utils/hf_transformers/common.py
# in 0.5.23)
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")
LONGER_CONTEXT_SWITCH = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"


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


def engine_context_length(context: int) -> int:
    """The ``context_length`` SGLang's engine is started with for sequences of ``context`` tokens
    (see Lengths in the module docstring)."""
    return context + SCHEDULER_RESERVE


def derived_context_length(config) -> tuple[int, str]:
    """The model's context length as SGLang derives it (``get_context_length`` of the language
    model's config): the first of :data:`CONTEXT_LENGTH_KEYS` the config has, times a RoPE scaling
    ``factor`` unless the scaling has ``original_max_position_embeddings`` or is llama3; 2048 when
    it has none. Returns the length and the key it came from."""
    config = getattr(config, "text_config", None) or config
    scaling = getattr(config, "rope_scaling", None) or {}
    factor = scaling["factor"] if "factor" in scaling else 1
    if "original_max_position_embeddings" in scaling or ("rope_type" in scaling and scaling["rope_type"] == "llama3"):
        factor = 1
    for key in CONTEXT_LENGTH_KEYS:
        value = getattr(config, key, None)
        if value is not None:
            return int(factor * value), key
    return 2048, "none of " + ", ".join(CONTEXT_LENGTH_KEYS)


@contextlib.contextmanager
def longer_context_allowed(allow: bool):
    """``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1`` inside the block when ``allow`` (the engine
    reads it as it starts: its ``ModelConfig`` here, the schedulers' in the processes it spawns
    then); the variable is put back after."""
    if not allow:
        yield
        return
    before = os.environ.get(LONGER_CONTEXT_SWITCH)
    os.environ[LONGER_CONTEXT_SWITCH] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[LONGER_CONTEXT_SWITCH]
        else:
            os.environ[LONGER_CONTEXT_SWITCH] = before


def per_rank_tensor_class():
    """SGLang's ``LocalSerializedTensor`` (``values[r]``: a serialised tensor for TP rank r) and
    ``MultiprocessingSerializer``. The class lives in ``srt/model_executor/model_runner.py`` to 0.5.10
    and in ``srt/model_executor/model_runner_components/weight_updater.py`` from 0.5.16."""
    from sglang.srt.utils import MultiprocessingSerializer

    try:
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith("sglang.srt.model_executor.model_runner_components"):
            raise
        from sglang.srt.model_executor.model_runner import LocalSerializedTensor
    return LocalSerializedTensor, MultiprocessingSerializer


def stage(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``tensor`` on ``device``, allocated by this process: what SGLang's engine may serialise
    (the views a push hands over are reused after the call, and torch refuses to share again a
    tensor it mapped from another process)."""
    return tensor.to(device, copy=True)


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

    With ``tensor_model_parallel_size`` > 1 the process sees the GPUs of all ranks (rank r on
    ``cuda:r``, ``chatlearn.runtime.cluster.group.spanning_env``) and ``maps_weight_slots`` is on.
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
        tp = int(spec.tensor_model_parallel_size)
        # the GPU of each TP rank's scheduler; with one rank, the rollout's device as before
        self._rank_devices = [self._device] if tp == 1 else [
            torch.device("cuda", BASE_GPU_ID + r * GPU_ID_STEP) for r in range(tp)]
        # cuda_ipc with several ranks: the slots of every rank's GPU are mapped here (attach_weight_slots)
        self.maps_weight_slots = tp > 1
        self._per_rank = per_rank_tensor_class() if tp > 1 else None
        self._rank_slots: list[list[torch.Tensor]] = []
        self.deterministic = bool(spec.deterministic_inference)
        context = context_length(self.max_prompt_len, self.max_response_len, self.seq_length)
        model_limit = self._check_context(context, config)
        self._weight_bytes = kv_cache.checkpoint_bytes(spec.load, spec.dtype)
        with longer_context_allowed(engine_context_length(context) > model_limit):
            self.engine = sglang.Engine(**self._engine_args(engine_context_length(context)))
        self._released: set[str] = set()
        self._stale_cache = False

    def _check_context(self, context: int, config) -> int:
        """The model's context length as SGLang derives it; a run whose sequences are longer is a
        UserError (SGLang would refuse it, or with the switch set, run past the model's positions)."""
        limit, key = derived_context_length(config)
        if context > limit:
            name = "seq_length" if self.seq_length is not None else "max_response_tokens_length"
            raise UserError(
                f"the SGLang rollout runs sequences of up to {context} tokens (models.policy.seq_length, or "
                "max_prompt_tokens_length + max_response_tokens_length), more than the model at "
                f"{self.spec.load} takes: {limit} ({key} in its config.json, as SGLang reads it). Lower "
                f"models.policy.{name} so that a sequence fits in {limit} tokens.", key=f"models.policy.{name}")
        return limit

    def _engine_args(self, engine_context: int) -> dict:
        """The keyword arguments of ``sglang.Engine`` (see the module docstring)."""
        spec = self.spec
        extra = ({"attention_backend": deterministic_attention_backend(self._device)}
                 if self.deterministic else {})
        if spec.kv_cache == "fit":  # SGLang keeps the smaller of this and what mem_fraction_static leaves
            sized = kv_cache.fit(spec.load, spec.dtype, int(spec.generation_batch_size), engine_context,
                                 int(spec.tensor_model_parallel_size), float(spec.gpu_memory_utilization),
                                 block_size=1, weight_bytes=self._weight_bytes)
            if sized.tokens is not None:  # at least engine_context: the scheduler's max_req_len needs it
                extra["max_total_tokens"] = sized.tokens
        return dict(
            model_path=spec.load,
            trust_remote_code=bool(spec.trust_remote_code),
            skip_tokenizer_init=True,  # token ids in and out
            dtype=spec.dtype,
            context_length=engine_context,  # every request of the run admitted whole (see Lengths)
            tp_size=int(spec.tensor_model_parallel_size),
            base_gpu_id=BASE_GPU_ID,
            gpu_id_step=GPU_ID_STEP,
            mem_fraction_static=float(spec.gpu_memory_utilization),
            max_running_requests=int(spec.generation_batch_size),
            disable_cuda_graph=bool(spec.enforce_eager),
            random_seed=int(spec.seed),
            enable_memory_saver=True,
            enable_weights_cpu_backup=True,
            enable_deterministic_inference=self.deterministic,
            **extra,
        )

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

    def probe_logprobs(self, tokens: list[int]) -> dict:
        """``Rollout.probe_logprobs``: SGLang's input-token log-probs of one greedy request of one token
        (``return_logprob=True, logprob_start_len=0``: ``meta_info["input_token_logprobs"]``, one
        ``(logprob, token_id, text)`` per input token, the first ``None``; ``log_softmax`` of the raw
        logits, ``LogitsProcessor``: temperature 1 and top-p 1 for a greedy request). A request that
        wants log-probs from position 0 matches no cached prefix; a greedy batch draws no random
        numbers; the cache is flushed before the next generation."""
        if self._released:
            raise RuntimeError(f"SGLangRollout.probe_logprobs: {sorted(self._released)} offloaded; call onload first")
        tokens = [int(t) for t in tokens]
        if self._stale_cache:
            self.engine.flush_cache()
        out = self.engine.generate(input_ids=[tokens], sampling_params=[{"max_new_tokens": 1, "temperature": 0.0}],
                                   return_logprob=True, logprob_start_len=0)[0]
        steps = out["meta_info"]["input_token_logprobs"]
        if [int(s[1]) for s in steps] != tokens:
            raise RuntimeError("SGLang probe: input_token_logprobs do not match the input ids")
        self._stale_cache = True  # the probe's prefix is cached
        return {"logprobs": np.asarray([float(s[0]) for s in steps[1:]], dtype=np.float32),
                "dtype": str(self.spec.dtype)}

    # -- weights ----------------------------------------------------------------------

    def begin_weight_update(self) -> None:
        """Start a streamed update (``chatlearn.runtime.weight_push.stream``); the weights must be on."""
        if Part.WEIGHTS in self._released:
            raise RuntimeError("SGLangRollout: weights are offloaded; onload them before a push")

    def load_weight_bucket(self, weights: list) -> None:
        """Load one bucket of ``(hf_name, tensor or array)`` pairs into the engine (see the module
        docstring); they are copied to every TP rank's device first, since the views are valid
        only during this call."""
        self._check_weights_on("load_weight_bucket")
        named = [(name, to_torch(value)) for name, value in weights
                 if not (self._tied and name == "lm_head.weight")]
        if named:
            self._send([[(name, stage(t, device)) for name, t in named] for device in self._rank_devices])

    def attach_weight_slots(self, handles: dict) -> None:
        """CUDA IPC slots of the trainer ranks, ``{GPU uuid: [handle per slot]}`` (transport
        ``cuda_ipc``, with several TP ranks: ``maps_weight_slots``): the slots of every rank's GPU
        are mapped into this process, once per push."""
        self._rank_slots = [[ipc_rebuild(h, device) for h in slots_for_device(handles, device)]
                            for device in self._rank_devices]

    def load_weight_slot(self, slot: int, entries: list) -> None:
        """Load the bucket the trainer wrote into slot ``slot`` of every rank's GPU (``entries``:
        ``[name, dtype, shape, offset, nbytes]`` rows): each rank gets a copy made within its own GPU.
        Returns once the slots have been read."""
        self._check_weights_on("load_weight_slot")
        rows = [row for row in entries if not (self._tied and row[0] == "lm_head.weight")]
        if rows:
            end = max(row[3] + row[4] for row in rows)
            self._send([entry_views(rows, stage(slots[slot][:end], device))
                        for slots, device in zip(self._rank_slots, self._rank_devices)])
        for device in self._rank_devices:
            device_stream(device).synchronize()  # the copies have read the slots: they may be refilled

    def detach_weight_slots(self) -> None:
        """Drop the mapped slots (after the push, before the trainer frees them)."""
        self._rank_slots = []
        gc.collect()

    def _check_weights_on(self, method: str) -> None:
        if Part.WEIGHTS in self._released:
            raise RuntimeError(f"SGLangRollout.{method}: weights are offloaded; onload them first")

    def _send(self, per_rank: list[list]) -> None:
        """``update_weights_from_tensor`` of ``per_rank[r]``, TP rank r's ``(name, tensor)`` pairs on
        its GPU (the same names in every list): the pairs themselves with one rank, else one
        ``LocalSerializedTensor`` per name whose ``values[r]`` is rank r's tensor, serialised."""
        if len(per_rank) == 1:
            named = per_rank[0]
        else:
            local_tensor, serializer = self._per_rank
            named = [(name, local_tensor(values=[serializer.serialize(rank[i][1]) for rank in per_rank]))
                     for i, (name, _) in enumerate(per_rank[0])]
        result = self.engine.update_weights_from_tensor(named_tensors=named, flush_cache=False)
        del named  # loaded by now: the call returns after the engine's load
        if isinstance(result, tuple) and result and not result[0]:
            raise RuntimeError(f"SGLang update_weights_from_tensor failed: {result[1:]}")
        self._stale_cache = True

    def finish_weight_update(self) -> None:
        """End a streamed update; the prefix cache is flushed before the next generation.
        The staged device copies of the buckets go back to the devices."""
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
