"""Sizes that cannot run: refused when the config is validated, before anything starts, when one
buffer the run is certain to allocate needs more memory than the machine has.

Each estimate is a lower bound of one buffer (not the run's whole footprint), from the policy's
``config.json`` (``hidden_size``, ``num_hidden_layers``, the KV heads, ``vocab_size``, ``dtype``):

- the episodes the driver holds: ``sample_per_episode`` samples of up to the policy's sequence length
  (at least :data:`DRIVER_BYTES_PER_TOKEN` bytes a token: the token ids, the log-probs, the mask and
  the advantages), times the episodes held at once (``max_replay_episode``, ``max_staleness``).
  The driver's memory is the memory of this machine wherever the workers run, so this is always checked;
- on a run whose workers run on this machine's CPUs (no GPU here, no ``RAY_ADDRESS`` cluster), the
  workers' buffers too: the rollout engine's KV cache (``kv_cache: fit`` with vLLM: all
  ``generation_batch_size`` sequences of the engine's context; the ``transformers`` engine's cache of
  one generation batch), and one training micro-batch of each trainer rank (the decoder's layer inputs
  kept for the backward pass and one chunk of float32 logits).

A size the model's context cannot take (``max_position_embeddings``) is refused by the context-length
check of :mod:`chatlearn.config.load`. An episode that only repeats the data's prompts is a warning
at start, not a refusal. On GPUs the device memory is not known here: only the driver's is checked.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import psutil
from omegaconf import DictConfig

from chatlearn.config.plan import Plan
from chatlearn.errors import ConfigError

# bytes a token of a sample takes in the driver at least: int64 token id, float32 rollout log-prob, a mask
# byte... and the float32 advantage, return or reference log-prob that the episode's batch adds (measured:
# about 100 with the tiny model)
DRIVER_BYTES_PER_TOKEN = 32
# bytes of an activation value a trainer rank keeps (float32 on the CPU); of a logit (float32, with its
# log-softmax beside it)
TRAIN_VALUE_BYTES = 4
LOGIT_BYTES = 2 * 4
KV_BLOCK = 128  # the largest block the engines use: a sequence's cache rounds up to it
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Need:
    """One buffer: the key whose value sizes it, that value, the bytes it needs and what it is; ``fits(room)``
    the largest value of the key whose buffer takes at most ``room`` bytes (default: linear in the value)."""

    key: str
    value: int
    bytes: int
    what: str
    per_unit: int = 0  # bytes per unit of the value beyond ``base`` (0: bytes / value)
    base: int = 0

    def fits(self, room: int) -> int:
        per_unit = self.per_unit or max(1, self.bytes // max(self.value, 1))
        return max(0, (room - self.base) // per_unit)


def check_sizes(cfg: DictConfig, plan: Plan, room: int | None = None) -> None:
    """Refuse (a ConfigError naming the key) a size whose buffer alone needs more than ``room`` bytes
    (default: the memory this machine has available, see :func:`available_memory`)."""
    conf = _text_config(cfg.models.policy.load)
    room = available_memory() if room is None else room
    needs = [driver_need(cfg, plan, room)]
    if local_cpu_run(plan):
        needs += [n for n in (rollout_need(cfg, plan, conf), trainer_need(cfg, plan, conf)) if n is not None]
    for need in needs:
        if need.bytes > room:
            fits = need.fits(room)
            raise ConfigError(
                f"is {need.value}: {need.what} need about {_size(need.bytes)}, but this machine has "
                f"{_size(room)} of memory available: the run would be killed for lack of memory, or swap without "
                f"end. Lower {need.key} (this estimate, a lower bound, allows at most about {fits}), shorten the "
                "sequences (models.policy.max_prompt_tokens_length, max_response_tokens_length), or run where "
                "there is more memory.", key=need.key)


def driver_need(cfg: DictConfig, plan: Plan, room: int) -> Need:
    """The episodes' samples the driver holds at once: named by ``max_replay_episode`` (or ``max_staleness``)
    when one episode fits ``room`` and the episodes held together do not, else by ``sample_per_episode``."""
    rt = cfg.runtime_args
    length = sequence_length(cfg.models.policy)
    replay = rt.num_episode if rt.max_replay_episode < 0 else min(rt.num_episode, 1 + rt.max_replay_episode)
    held = replay + rt.max_staleness
    per_sample = length * DRIVER_BYTES_PER_TOKEN
    per_episode = plan.samples_per_episode * per_sample
    samples = (f"{plan.samples_per_episode} samples of up to {length} tokens each (at least "
               f"{DRIVER_BYTES_PER_TOKEN} bytes a token)")
    if held > 1 and per_episode <= room < per_episode * held:
        key, value = (("runtime_args.max_replay_episode", rt.max_replay_episode) if replay > 1
                      else ("runtime_args.max_staleness", rt.max_staleness))
        # max_replay_episode N holds N + 1 episodes (+ max_staleness); max_staleness N holds N more
        base = per_episode * (1 + rt.max_staleness if replay > 1 else replay)
        return Need(key, value, per_episode * held,
                    f"the {held} episodes the driver holds at once, each {samples},", per_unit=per_episode,
                    base=base)
    return Need("runtime_args.sample_per_episode", rt.sample_per_episode, per_episode * held,
                f"{samples}, held by the driver ({held} episode(s) at once),",
                per_unit=per_sample * held * plan.samples_per_episode // max(rt.sample_per_episode, 1))


def rollout_need(cfg: DictConfig, plan: Plan, conf: dict) -> Need | None:
    """The rollout engines' KV caches: vLLM's, sized for ``generation_batch_size`` sequences with
    ``kv_cache: fit``; the ``transformers`` engine's for one generation batch."""
    p, backend = cfg.models.policy, cfg.runtime_args.rollout_backend
    per_token = kv_bytes_per_token(conf, _dtype_bytes(p.dtype, conf))
    length = sequence_length(p)
    if per_token is None:
        return None
    if backend == "vllm" and p.kv_cache == "fit" and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        tokens = p.generation_batch_size * math.ceil(length / KV_BLOCK) * KV_BLOCK
        what = (f"the KV cache of vLLM (models.policy.kv_cache fit: {p.generation_batch_size} sequences of "
                f"{length} tokens at {per_token} bytes a token, on each of {p.num_gpu} rank(s))")
    elif backend == "hf":
        batch = min(p.generation_batch_size, -(-plan.samples_per_episode // max(plan.rollout_replicas, 1)))
        tokens = batch * length
        what = (f"the KV cache of a generation batch ({batch} sequences of {length} tokens at {per_token} bytes a "
                f"token, on each of {p.num_gpu} rank(s))")
    else:
        return None
    return Need("models.policy.generation_batch_size", p.generation_batch_size, tokens * per_token * p.num_gpu,
                what)


def trainer_need(cfg: DictConfig, plan: Plan, conf: dict) -> Need | None:
    """One training micro-batch of every policy_trainer rank: the decoder's layer inputs kept for the
    backward pass and one chunk of float32 logits (``logprob_chunk_tokens``)."""
    t, rt = cfg.models.policy_trainer, cfg.runtime_args
    hidden, layers, vocab = (conf.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
    if not all(isinstance(v, int) and v > 0 for v in (hidden, layers, vocab)):
        return None
    longest = sequence_length(cfg.models.policy)
    share = plan.samples_per_rank_per_step
    if t.packing:
        key, value = "models.policy_trainer.max_token_in_packing", t.max_token_in_packing
        tokens = min(t.max_token_in_packing, share * longest)
        shape = f"a packed micro-batch of {tokens} tokens"
    else:
        width = t.seq_length if t.seq_length is not None else longest
        rows = min(rt.train_micro_batch_size, share)
        key, value, tokens = "runtime_args.train_micro_batch_size", rt.train_micro_batch_size, rows * width
        shape = f"a micro-batch of {rows} samples x {width} tokens"
    chunk = min(t.logprob_chunk_tokens, tokens)
    per_rank = tokens * layers * hidden * TRAIN_VALUE_BYTES + chunk * vocab * LOGIT_BYTES
    return Need(key, value, per_rank * t.num_gpu,
                f"the activations of {shape} ({layers} layers x hidden size {hidden} kept for the backward pass, "
                f"and {chunk} tokens' logits over a vocabulary of {vocab}) on each of {t.num_gpu} trainer rank(s)")


def sequence_length(p: DictConfig) -> int:
    """The longest prompt + response of the rollout engine (``seq_length`` when set)."""
    total = p.max_prompt_tokens_length + p.max_response_tokens_length
    return total if p.seq_length is None else min(p.seq_length, total)


def kv_bytes_per_token(conf: dict, dtype_bytes: int) -> int | None:
    """KV-cache bytes of one token (K and V of every layer), or None when ``conf`` does not give the
    standard attention's sizes."""
    layers, heads, hidden = (conf.get(k) for k in ("num_hidden_layers", "num_attention_heads", "hidden_size"))
    if not all(isinstance(v, int) and v > 0 for v in (layers, heads, hidden)) or "kv_lora_rank" in conf:
        return None
    kv_heads = conf.get("num_key_value_heads") or heads
    head_dim = conf.get("head_dim") or hidden // heads
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def local_cpu_run(plan: Plan) -> bool:
    """The workers run on this machine's CPUs: no GPU driver here, and no Ray cluster elsewhere
    (``RAY_ADDRESS``) unless the run goes without Ray."""
    if os.environ.get("RAY_ADDRESS") and not plan.single_process:
        return False
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return True
    nvidia = "/proc/driver/nvidia/gpus"
    return not (os.path.isdir(nvidia) and os.listdir(nvidia)) and not os.path.exists("/dev/kfd")


def available_memory() -> int:
    """Bytes of memory this process can still take: the machine's available memory, within the room its
    cgroup (a container's limit) leaves."""
    room = psutil.virtual_memory().available
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
            used = int(f.read().strip())
    except (OSError, ValueError):
        return room
    return room if limit == "max" else max(0, min(room, int(limit) - used))


def _text_config(folder: str) -> dict:
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            conf = json.load(f)
    except (OSError, ValueError):
        return {}
    return conf.get("text_config") if isinstance(conf.get("text_config"), dict) else conf


def _dtype_bytes(dtype: str, conf: dict) -> int:
    if dtype == "auto":
        dtype = str(conf.get("torch_dtype") or conf.get("dtype") or "float32").replace("torch.", "")
    return DTYPE_BYTES.get(dtype, 4)


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "bytes" else f"{n} bytes"
        n /= 1024
    return f"{n} bytes"
