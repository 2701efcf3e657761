"""The fake's model forward and sampler (no such module in vLLM): deterministic, and dependent on
everything a real engine's output depends on.

Logits: a standard normal draw (x3) over the vocabulary, seeded by the weights' fingerprint and
the sequence so far (prompt and tokens sampled), so the same weights and context give the same
logits, and new weights give new ones. The sampler then follows vLLM 0.32 (``v1/sample/``):

* penalties on the raw logits (``repetition_penalty`` over prompt and output tokens; frequency and
  presence over output tokens), EOS and stop ids masked while fewer than ``min_tokens`` tokens;
* greedy (temperature < 1e-5): the argmax; else temperature, then top-k, top-p and min-p masks,
  and a draw from the request's generator (``seed``, ``seed + i`` for the i-th of ``n``; an int,
  else the error ``torch.Generator.manual_seed`` gives) or from the engine's (seeded with
  ``LLM(seed=...)``);
* log-probs per ``logprobs_mode``: ``raw_logprobs`` (log-softmax of the raw logits),
  ``raw_logits``, ``processed_logprobs`` (log-softmax of the penalised, temperature-scaled and
  masked logits; temperature 1 when greedy), ``processed_logits``. With ``logprobs=k`` each step
  has the sampled token's entry and the top k (all with -1); ranks count the tokens above;
* stop (``check_stop``, ``v1/core/sched/utils.py``): EOS unless ``ignore_eos``, or a stop token id
  (the token is kept; ``finish_reason`` "stop", ``stop_reason`` the id for stop ids), else
  "length" at ``max_tokens`` or at ``max_model_len`` tokens in all.
"""
from __future__ import annotations

import hashlib

import numpy as np

from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput

_SAMPLING_EPS = 1e-5


def raw_logits(fingerprint: int, context: list[int], vocab: int) -> np.ndarray:
    digest = hashlib.blake2b(np.asarray(context, dtype=np.int64).tobytes(), digest_size=8,
                             key=fingerprint.to_bytes(8, "little")).digest()
    return np.random.default_rng(int.from_bytes(digest, "little")).standard_normal(vocab) * 3.0


def _log_softmax(x: np.ndarray) -> np.ndarray:
    finite = x[np.isfinite(x)]
    m = finite.max() if finite.size else 0.0
    return x - (m + np.log(np.exp(x - m).sum()))


def _penalised(logits: np.ndarray, sp, prompt: list[int], out: list[int], stop_ids: set[int]) -> np.ndarray:
    x = logits.copy()
    seen = np.unique(np.asarray(prompt + out, dtype=np.int64))
    if sp.repetition_penalty != 1.0 and seen.size:
        x[seen] = np.where(x[seen] > 0, x[seen] / sp.repetition_penalty, x[seen] * sp.repetition_penalty)
    if out:
        counts = np.bincount(np.asarray(out, dtype=np.int64), minlength=x.size)
        x -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0)
    if len(out) < sp.min_tokens and stop_ids:
        x[sorted(stop_ids)] = -np.inf
    return x


def _masked(x: np.ndarray, sp) -> np.ndarray:
    """Temperature-scaled logits with top-k, top-p and min-p applied (masked to -inf)."""
    x = x / sp.temperature
    if sp.top_k > 0 and sp.top_k < x.size:
        x = np.where(x < np.sort(x)[-sp.top_k], -np.inf, x)
    if sp.top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        probs = np.exp(_log_softmax(x))[order]
        keep = np.cumsum(probs) - probs < sp.top_p  # the smallest prefix whose mass reaches top_p
        cut = np.full(x.size, -np.inf)
        cut[order[keep]] = x[order[keep]]
        x = cut
    if sp.min_p > 0.0:
        probs = np.exp(_log_softmax(x))
        x = np.where(probs < sp.min_p * probs.max(), -np.inf, x)
    return x


def _generator(seed, engine_rng: np.random.Generator) -> np.random.Generator:
    if seed is None:
        return engine_rng
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise RuntimeError(f"manual_seed expected a long, but got {type(seed).__name__}")
    return np.random.default_rng(seed % 2**64)


def _step_logprobs(values: np.ndarray, token: int, k: int) -> dict[int, Logprob]:
    k = values.size if k == -1 else k
    entries = {token: Logprob(float(values[token]), rank=int((values > values[token]).sum()) + 1)}
    for rank, t in enumerate(np.argsort(-values, kind="stable")[:k], start=1):
        entries.setdefault(int(t), Logprob(float(values[t]), rank=rank))
    return entries


def routed_experts(tokens: list[int], fingerprint: int, model_config) -> np.ndarray:
    """The fake's routes of a finished request's ``tokens`` (prompt and output) as vLLM 0.32 returns them
    (``vllm/model_executor/layers/fused_moe/routed_experts_capturer.py``, ``aux_output_connector``): every
    token but the last, every decoder layer, uint8 (256 experts or fewer) or uint16. The decoder layers
    without a routed block (``mlp_only_layers``, ``decoder_sparse_step``) keep 0."""
    layers, experts = model_config.get_total_num_hidden_layers(), model_config.get_num_experts()
    k = model_config.get_num_experts_per_tok()
    step = int(model_config.hf_config.get("decoder_sparse_step") or 1)
    dense = set(model_config.hf_config.get("mlp_only_layers") or ())
    out = np.zeros((max(len(tokens) - 1, 0), layers, k), dtype=np.uint8 if experts <= 256 else np.uint16)
    for pos, tok in enumerate(tokens[:-1]):
        for layer in range(layers):
            if layer in dense or (layer + 1) % step:
                continue
            base = (tok * 7 + pos * 3 + layer * 5 + fingerprint) % experts
            out[pos, layer] = [(base + j) % experts for j in range(k)]
    return out


def sample(prompt: list[int], sp, index: int, fingerprint: int, model_config,
           engine_rng: np.random.Generator) -> CompletionOutput:
    """One completion (the ``index``-th of the request) of ``prompt`` under ``sp``, a clone the
    engine updated with its EOS (``update_from_generation_config``)."""
    vocab, max_model_len = model_config.get_vocab_size(), model_config.max_model_len
    max_tokens = sp.max_tokens if sp.max_tokens is not None else max_model_len - len(prompt)
    greedy = sp.temperature < _SAMPLING_EPS
    seed = sp.seed if sp.seed is None or sp.n == 1 else sp.seed + index  # ParentRequest's child seeds
    rng = None if greedy else _generator(seed, engine_rng)
    stop_ids = set(sp.stop_token_ids) | ({sp.eos_token_id} if sp.eos_token_id is not None else set())
    out: list[int] = []
    logprobs: list[dict[int, Logprob]] | None = None if sp.logprobs is None else []
    finish, stop_reason = None, None
    while finish is None:
        raw = raw_logits(fingerprint, prompt + out, vocab)
        processed = _penalised(raw, sp, prompt, out, stop_ids)
        if greedy:
            token = int(np.argmax(processed))
        else:
            processed = _masked(processed, sp)
            token = int(rng.choice(vocab, p=np.exp(_log_softmax(processed))))
        if logprobs is not None:
            values = {"raw_logprobs": _log_softmax(raw), "raw_logits": raw,
                      "processed_logprobs": _log_softmax(processed),
                      "processed_logits": processed}[model_config.logprobs_mode]
            logprobs.append(_step_logprobs(values, token, sp.logprobs))
        out.append(token)
        if token == sp.eos_token_id:
            finish = "stop"
        elif token in sp.stop_token_ids:
            finish, stop_reason = "stop", token
        elif len(prompt) + len(out) >= max_model_len or len(out) >= max_tokens:
            finish = "length"
    cumulative = None if logprobs is None else float(sum(step[t].logprob for step, t in zip(logprobs, out)))
    return CompletionOutput(index=index, text="", token_ids=out, cumulative_logprob=cumulative,
                            logprobs=logprobs, finish_reason=finish, stop_reason=stop_reason)
