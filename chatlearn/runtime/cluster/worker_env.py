"""The environment of every worker process, decided in one place and set before the process starts.

CUDA, NCCL and the allocator read their variables once, when CUDA is initialised or a communicator
is created: a variable set from inside a worker after ``import torch`` and a first CUDA call comes
too late, and one set differently in two processes that share a communicator breaks it. So every
variable below reaches the worker through Ray's ``runtime_env`` (``env_vars``): Ray starts the
actor's process with them. Without Ray (``runtime_args.single_process``) a reward worker's process is
started with them, and the models' are set in the driver's process before the models' modules are
imported into it (``chatlearn.runtime.cluster.group.start_actors``).

* ``OMP_NUM_THREADS``, ``TOKENIZERS_PARALLELISM``: CPU threads of this worker.
* ``HF_HUB_DISABLE_PROGRESS_BARS=1``: per-file download bars would flood the run's log.
* ``VLLM_LOGGING_LEVEL``: the engine's start-up chatter would bury the run's progress lines
  (``WARNING`` unless the user set it).
* ``NCCL_CUMEM_ENABLE``: ``import vllm`` sets it to 0 in the engine's processes
  (``vllm/env_override.py``) unless it is already set; the trainer ranks that broadcast weights to
  the engine over NCCL must use the same value, or the broadcast can hang. Every device worker gets
  the user's value, else 0, so trainer and engine always agree.
* ``CUDA_DEVICE_MAX_CONNECTIONS=1``: Megatron trainers. Megatron-core relies on one hardware queue
  so that its tensor-/sequence-parallel communication is issued in program order (it warns or
  asserts otherwise); it must be in the environment before CUDA starts.
* ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: trainers whose
  ``use_expandable_segments`` is set (less fragmentation over offload/onload turns). Not for the
  rollout engines: vLLM's sleep-mode allocator refuses expandable segments. The weight push's
  CUDA IPC slots are allocated with it switched off for the moment
  (``chatlearn.runtime.weight_push.stream.outside_expandable_segments``): expandable memory is
  shared through ``pidfd_getfd``, which unprivileged containers refuse.
* Passed through when the user set them: Hub and debugging variables; ``CHATLEARN_LOG_DIR`` and
  ``CHATLEARN_VERBOSE`` (set by the driver): where the worker writes its third-party output
  (``chatlearn.logging.console``).
"""
from __future__ import annotations

import os

PASS_THROUGH = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "CHATLEARN_DEBUG",
                "CHATLEARN_LOG_DIR", "CHATLEARN_VERBOSE",
                "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "CUDA_LAUNCH_BLOCKING")


def _user_or(name: str, value: str) -> str:
    """The user's value of ``name`` if set, else ``value``."""
    return os.environ[name] if name in os.environ else value


def worker_env(role: str, backend: str, threads: int, expandable_segments: bool = False) -> dict[str, str]:
    """Environment variables of one model's workers.

    ``role``: "trainer", "rollout" or "reward"; ``backend``: the backend's name in
    ``chatlearn.config.registry.backend_factories()`` ("fsdp", "megatron", "vllm", "sglang", "hf", "reward").
    """
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "VLLM_LOGGING_LEVEL": _user_or("VLLM_LOGGING_LEVEL", "WARNING")}
    if role in ("trainer", "rollout"):
        env["NCCL_CUMEM_ENABLE"] = _user_or("NCCL_CUMEM_ENABLE", "0")
    if role == "trainer" and backend == "megatron":
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    if role == "trainer" and expandable_segments:
        conf = _user_or("PYTORCH_CUDA_ALLOC_CONF", "")
        if "expandable_segments" not in conf:
            conf = ",".join(x for x in (conf, "expandable_segments:True") if x)
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    for name in PASS_THROUGH:
        if name in os.environ:
            env[name] = os.environ[name]
    return env
