"""What the rollout adapters share, whatever their engine (transformers, vLLM, SGLang): the
sampling dict (:func:`parse_sampling`), the length checks and response budgets of a ``generate`` call
against the engine's context (:func:`check_lengths`, :func:`context_length`, :func:`response_budgets`),
the rollout batch built from the sampled tokens (:func:`pack_samples`), the model's end-of-sequence
ids, and a few process helpers (tensors viewing pushed weights, CUDA cache release, CPU threads).

Nothing here imports an engine; each adapter (``hf.py``, ``vllm.py``, ``sglang.py``) imports from here.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

from chatlearn.batch import Batch
from chatlearn.models.stash import release_device_memory

# A sampling dict may leave out the filters: absent means "off" (no nucleus, no top-k cut) and
# no seed. temperature and max_tokens are required. The run's values come from the config
# (chatlearn/runtime/driver/sampling.py), which always sets all five.
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
    """Pack prompts and their responses into a rollout batch (see ``chatlearn.batch``).

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
    """Give the CUDA memory this process no longer uses back to the device (on CUDA only): freed
    tensors stay reserved by torch's caching allocator, invisible to other processes (the trainer
    sharing the GPU), and so do the cuBLAS workspaces (:func:`chatlearn.models.stash.release_device_memory`)."""
    release_device_memory(device)


def set_cpu_threads(threads) -> None:
    """Set torch's intra-op (OpenMP) thread count for this process, when given.

    Where other busy processes share the cores (a trainer next to the rollout), spinning
    OpenMP workers slow a CPU engine down several times over; one thread avoids that.
    """
    if threads:
        torch.set_num_threads(int(threads))
