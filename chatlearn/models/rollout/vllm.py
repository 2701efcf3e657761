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

Weights. ``update_weights`` stages buckets on the host; they are committed in one call to
each worker's ``reload_weights(weights_iterator=...)`` (vLLM's in-place reload: it reruns
the loader's post-processing, so it also works where the CPU backend has repacked linear
weights and ``model.load_weights`` alone fails). One call per update matters: each call
restores every layer it receives no weights for, and a layer whose weights straddle two
calls (q/k/v fused into one parameter) would be processed half-loaded. The commit happens
when the engine next needs the weights (``onload(["kv_cache"])`` or ``generate``), and the
prefix cache is reset after it so that no KV block computed with old weights is reused.
``collective_rpc`` with a method name is the one path that works both for the in-process
engine and for multiprocess engines (CUDA, tensor parallel).

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

import logging
import os
from typing import Iterable

import numpy as np
import torch

from chatlearn.models.base import Batch, Bucket, Rollout
from chatlearn.models.rollout.hf import (check_lengths, pack_samples, parse_sampling,
                                         set_cpu_threads, to_torch)

SLEEP_PARTS = ("weights", "kv_cache")
FINISH_REASONS = {"stop": 1, "length": 0}


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
    # KV cache size in GiB. Unset, vLLM sizes it from the machine's free memory, which
    # leaves nothing for the trainer next to it.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


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
            import inspect

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

    def chatlearn_reload_weights(self, weights: list) -> None:
        """``reload_weights`` of the weights (see ``unpack_weights``), then refresh tied layers.

        A layer that shares its weight with another one (``lm_head`` tied to the
        embedding) receives no weights of its own in a reload, so vLLM never re-runs its
        post-load processing: on the CPU backend it would keep computing with a packed
        copy of the old weights. Re-running the processing rebuilds it from the shared,
        updated tensor. Only unquantized methods are re-run: their processing derives
        everything from the current weights (elsewhere than on CPU it does nothing), where
        a quantized method's would quantize twice.
        """
        self.reload_weights(weights_iterator=unpack_weights(weights), is_checkpoint_format=True)
        _reprocess_shared(self.model_runner.get_model())

    # -- streamed reload: one reload fed bucket by bucket (chatlearn.runtime.weight_sync) ---

    def chatlearn_begin_reload(self) -> None:
        """Start an in-place reload: vLLM's ``reload_weights`` split into its three steps
        (``initialize_layerwise_reload``; ``model.load_weights`` per bucket; one
        ``finalize_layerwise_reload``), so that buckets need no staging: a layer is
        processed as soon as all of its weights have arrived, and layers split over buckets
        (q/k/v fused into one parameter) are processed once, whole."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def chatlearn_load_bucket(self, weights: list) -> None:
        """Feed one bucket (see ``unpack_weights``) to the open reload.

        The tensors may view a buffer that is reused once this returns: a layer still
        waiting for the rest of its weights keeps references to the ones it got, so those
        (and only those) are copied.
        """
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
        """Close the reload (layers with missing weights get their old tensors back), then
        refresh the layers that share a parameter (tied ``lm_head``)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        _reprocess_shared(model)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(self.model_runner, reset):
                getattr(self.model_runner, reset)()

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
        """Give the released storage back; weights still need a reload. The memory is not
        cleared (the reload overwrites the weights; KV blocks are written before read)."""
        state = self.__dict__.setdefault("_chatlearn_released", {})
        restored = 0
        for tag in ("weights", "kv_cache"):
            if tag in tags and tag in state:
                for st, nbytes in state.pop(tag):
                    st.resize_(nbytes)
                    restored += nbytes
        return restored

    def chatlearn_reload_from_folder(self) -> None:
        """Reload the weights from the model folder the engine was started with."""
        self.reload_weights(weights_iterator=None, is_checkpoint_format=True)
        _reprocess_shared(self.model_runner.get_model())


def _reprocess_shared(model: torch.nn.Module) -> None:
    """Re-run the post-load processing of the unquantized layers that share a parameter
    (see ``WorkerExtension.chatlearn_reload_weights``)."""
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


class VLLMRollout(Rollout):
    """Rollout with ``vllm.LLM``.

    cfg keys: ``load``, ``trust_remote_code`` (False), ``seed`` (0), ``generation_batch_size``
    (-> ``max_num_seqs``, 64), ``max_prompt_tokens_length``, ``max_response_tokens_length``
    (their sum -> ``max_model_len``), ``dtype`` ("float32" | "bfloat16"),
    ``gpu_memory_utilization`` (0.9), ``enforce_eager`` (False),
    ``tensor_model_parallel_size`` (1), and on CPU an optional ``cpu_threads``. ``device``
    is not passed on: vLLM picks its platform (CUDA where present, else CPU).

    With the in-process CPU engine, vLLM seeds the process's global RNGs and replaces
    ``torch.set_num_threads`` with a no-op: ``cpu_threads`` is applied before that.
    """

    def __init__(self, cfg: dict):
        set_cpu_env_defaults()
        if not torch.cuda.is_available():
            set_cpu_threads(cfg.get("cpu_threads"))
        import vllm
        from vllm.platforms import current_platform

        self.cfg = dict(cfg)
        self.max_prompt_len = int(cfg["max_prompt_tokens_length"])
        self.max_response_len = int(cfg["max_response_tokens_length"])
        self._rng = np.random.default_rng(int(cfg.get("seed", 0)))
        self._sleep_mode = bool(current_platform.is_sleep_mode_available())
        if not self._sleep_mode:
            # Every offload/onload would log "sleep mode is not supported on CPU" (twice per
            # episode): the engine only pauses there, which is what we want.
            logging.getLogger("vllm.v1.worker.cpu_worker").setLevel(logging.ERROR)
        max_num_seqs = int(cfg.get("generation_batch_size", 64))
        max_model_len = self.max_prompt_len + self.max_response_len
        batched_tokens = cfg.get("max_num_batched_tokens")
        if current_platform.is_cpu():
            # vLLM's CPU sampler cannot rewind a seeded generator ("CPU Generator does not use
            # offset"), which it does when a prompt's prefill is split over steps (chunked
            # prefill). A step budget that fits every sequence whole never splits one.
            batched_tokens = max(int(batched_tokens or 0), max_num_seqs * max_model_len)
        self.llm = vllm.LLM(
            model=cfg["load"],
            trust_remote_code=bool(cfg.get("trust_remote_code", False)),
            dtype=cfg.get("dtype", "float32"),
            seed=int(cfg.get("seed", 0)),
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=int(batched_tokens) if batched_tokens else None,
            gpu_memory_utilization=float(cfg.get("gpu_memory_utilization", 0.9)),
            enforce_eager=bool(cfg.get("enforce_eager", False)),
            tensor_parallel_size=int(cfg.get("tensor_model_parallel_size", 1)),
            enable_sleep_mode=self._sleep_mode,
            logprobs_mode="processed_logprobs",  # see the module docstring
            worker_extension_cls=f"{__name__}.WorkerExtension",
        )
        # An in-process engine core takes the tensors as they are; otherwise they are
        # serialised (see ``pack_weights``).
        from vllm.v1.engine.core_client import InprocClient

        self._in_process = isinstance(self.llm.llm_engine.engine_core, InprocClient)
        self._untruncated = all(self.llm.collective_rpc("chatlearn_untruncated_logprobs"))
        sizes = self.llm.collective_rpc("chatlearn_memory_bytes")
        self._part_bytes = {part: sum(s[part] for s in sizes) for part in SLEEP_PARTS}
        self._asleep: set[str] = set()
        self._pushed = False  # weights received since start (else they are the folder's)
        self._awaiting_push = False  # CPU: weights woken empty, the next push refills them
        # Staged weights by name: a name pushed twice before a commit keeps its last value
        # (loading a layer twice in one reload fails).
        self._pending: dict[str, torch.Tensor] = {}

    # -- generation -----------------------------------------------------------------

    def generate(self, prompts: list[list[int]], sampling: dict) -> Batch:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._asleep:
            raise RuntimeError(f"VLLMRollout.generate: {sorted(self._asleep)} offloaded; "
                               "call onload first")
        self._commit_weights()
        if self._awaiting_push:
            raise RuntimeError("VLLMRollout.generate: the weights were offloaded on the CPU (no "
                               "host copy is kept); push weights before generating")
        sp = parse_sampling(sampling)
        prompts = [[int(t) for t in p] for p in prompts]
        check_lengths(prompts, sp["max_tokens"], self.max_prompt_len, self.max_response_len)
        truncated = not sp["greedy"] and (sp["top_k"] > 0 or sp["top_p"] < 1.0)
        if not prompts:
            return pack_samples([], [], [], [])
        if truncated and not self._untruncated:
            raise NotImplementedError(
                "top-k/top-p sampling: this vLLM build only reports log-probs of the "
                "truncated distribution (try VLLM_USE_V2_MODEL_RUNNER=0)")

        base = sp["seed"] if sp["seed"] is not None else int(self._rng.integers(2**31))
        params = [
            SamplingParams(
                n=1,
                temperature=0.0 if sp["greedy"] else sp["temperature"],
                top_p=1.0 if sp["greedy"] else sp["top_p"],
                top_k=-1 if sp["greedy"] else sp["top_k"],
                max_tokens=sp["max_tokens"],
                seed=(base + i) % 2**31,  # one stream per request: reproducible
                logprobs=0,  # the sampled token's log-prob only
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

        responses, logprobs, finished = [], [], []
        for out in outputs:
            comp = out.outputs[0]
            if comp.finish_reason not in FINISH_REASONS:
                raise RuntimeError(f"request {out.request_id} ended with {comp.finish_reason!r}")
            ids = list(comp.token_ids)
            responses.append(ids)
            logprobs.append([step[t].logprob for step, t in zip(comp.logprobs, ids)])
            finished.append(FINISH_REASONS[comp.finish_reason])
        return pack_samples(prompts, responses, logprobs, finished)

    # -- weights ----------------------------------------------------------------------

    def update_weights(self, bucket: Bucket) -> None:
        """Stage one bucket of (hf_name, array); committed before the next use (see above).

        A tied ``lm_head.weight`` may be absent (vLLM's loaders skip it when tied).
        """
        for name, value in bucket:
            tensor = to_torch(value)
            # Read-only arrays (as Ray hands them out) cannot change under us; anything
            # else is copied, so that the caller may reuse its buffers right away.
            if not (isinstance(value, np.ndarray) and not value.flags.writeable):
                tensor = tensor.detach().to("cpu", copy=True)
            self._pending[name] = tensor

    def begin_weight_update(self) -> None:
        """Start a streamed update (``chatlearn.runtime.weight_sync``): weights staged with
        ``update_weights`` are committed first, then one reload is opened in every worker."""
        if "weights" in self._asleep:
            raise RuntimeError("VLLMRollout: weights are offloaded; onload them before a push")
        self._commit_weights()
        self.llm.collective_rpc("chatlearn_begin_reload")

    def load_weight_bucket(self, weights: list) -> None:
        """Load one bucket of ``(hf_name, tensor)`` views into the open reload. In-process
        the views go straight to the worker (only tensors of a layer left incomplete by the
        bucket are copied); a multiprocess engine gets them as safetensors blobs."""
        if not self._in_process:
            weights = pack_weights(weights)
        self.llm.collective_rpc("chatlearn_load_bucket", args=(weights,))

    def finish_weight_update(self) -> None:
        """Close the reload in every worker; the prefix cache is reset (old-weight blocks)."""
        self.llm.collective_rpc("chatlearn_finish_reload")
        self.llm.reset_prefix_cache()
        self._pushed, self._awaiting_push = True, False

    def _commit_weights(self) -> None:
        if not self._pending:
            return
        if "weights" in self._asleep:
            raise RuntimeError("VLLMRollout: weights are offloaded; onload them first")
        pending, self._pending = list(self._pending.items()), {}
        if not self._in_process:
            pending = pack_weights(pending)
        self.llm.collective_rpc("chatlearn_reload_weights", args=(pending,))
        self.llm.reset_prefix_cache()
        self._pushed, self._awaiting_push = True, False

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
            freed = sum(self.llm.collective_rpc("chatlearn_cpu_release", args=(sorted(want),)))
            self._asleep |= want
            return {"bytes": int(freed)}
        if "weights" in want:
            if self._asleep:  # the KV cache alone is off: the engine sleeps as a whole
                self.llm.wake_up(tags=["kv_cache"])
                self._asleep.clear()
            self.llm.sleep(level=1)
            self._asleep = set(SLEEP_PARTS)
            return {"bytes": self._bytes(SLEEP_PARTS)}
        self.llm.sleep(level=1)
        self.llm.wake_up(tags=["weights"])
        self._asleep = {"kv_cache"}
        return {"bytes": self._bytes(["kv_cache"])}

    def onload(self, parts: Iterable[str]) -> dict:
        """Wake ``weights`` and/or ``kv_cache``; staged weights are committed in between,
        before the KV cache takes its memory back. The engine generates again once both
        are on.

        On the CPU, woken weights must be reloaded: by the next weight push when the engine
        has received one since it started (generating before that push is an error), else
        from the model folder, so that an engine that never received weights comes back
        bit for bit on its own.
        """
        parts = set(parts)
        woken = []
        moved = 0
        if "weights" in parts and "weights" in self._asleep:
            if self._sleep_mode:
                self.llm.wake_up(tags=["weights"])
            else:
                moved += sum(self.llm.collective_rpc("chatlearn_cpu_resume", args=(["weights"],)))
                if self._pushed:
                    self._awaiting_push = True
                else:
                    self.llm.collective_rpc("chatlearn_reload_from_folder")
            self._asleep.discard("weights")
            woken.append("weights")
        if "kv_cache" in parts and "kv_cache" in self._asleep:
            if "weights" not in self._asleep:
                self._commit_weights()
            if self._sleep_mode:
                self.llm.wake_up(tags=["kv_cache"])
            else:
                moved += sum(self.llm.collective_rpc("chatlearn_cpu_resume", args=(["kv_cache"],)))
                self.llm.reset_prefix_cache()  # the cached blocks' contents are gone
            self._asleep.discard("kv_cache")
            woken.append("kv_cache")
        return {"bytes": self._bytes(woken) if self._sleep_mode else int(moved)}

    def _bytes(self, parts) -> int:
        return sum(self._part_bytes[p] for p in parts)
