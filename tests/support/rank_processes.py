"""Where the multi-rank tests' processes come from: a fork server (multiprocessing's ``forkserver``) that
imports torch, transformers, the trainers and megatron-core once per test process, so that each rank
of a job starts in a few milliseconds instead of importing them again for seconds, as a spawned
process would (33 jobs of 1 to 4 ranks in the suite).

A rank forked from it is a fresh process as a spawned one is: the server has only imported modules (no
thread, no process group, no CUDA context; forking a process that has is what ``fork`` gets wrong),
and each rank gets the environment of the test that starts it (``rank_env``), applied before the job's
function runs. The server starts with the environment the suite started with and the test folders on
``PYTHONPATH`` (Python 3.11's fork server does not take the parent's ``sys.path``): the test modules
that define the jobs import in it as in the tests.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys

from conftest import REPO, START_ENV

PRELOAD = ["numpy", "torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "transformers", "transformers.models.qwen2.modeling_qwen2", "safetensors.torch",
           "chatlearn.models.trainer.fsdp", "megatron.core", "chatlearn.models.trainer.megatron"]
_started = False


def context():
    """The multiprocessing context the rank jobs start their processes from (the fork server, started on
    first use); on a machine with CUDA, ``spawn``: importing the preloaded modules there initialises CUDA
    in the server, and a process forked from it then cannot use CUDA ("Cannot re-initialize CUDA in
    forked subprocess", seen on an H200)."""
    global _started
    import torch

    if torch.cuda.is_available():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    if not _started:
        ctx.set_forkserver_preload(PRELOAD)
        paths = [p for p in sys.path if p and os.path.abspath(p).startswith(REPO)]
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(START_ENV)
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [START_ENV.get("PYTHONPATH")])])
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _started = True
    return ctx


def rank_env() -> dict:
    """The environment a rank started now gets: the starting test's."""
    return dict(os.environ)


def enter(env: dict) -> None:
    """In the rank's process, before its job runs: the starting test's environment."""
    os.environ.clear()
    os.environ.update(env)
