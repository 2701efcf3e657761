"""The Ray actor that hosts a backend object: a trainer rank, a rollout replica or a reward worker, and
with ``runtime_args.fuse_rollout`` a trainer rank and the rollout replica of its device together."""
from __future__ import annotations

import importlib
import inspect
import os
import resource
import socket
import sys
import time

from chatlearn.config.plugins import load_plugins
from chatlearn.logging.console import setup_worker
from chatlearn.logging.gpu_memory import device_memory
from chatlearn.logging.startup import process_start_time
from chatlearn.runtime.cluster.heartbeat import start_heartbeat
from chatlearn.runtime.cluster.leftovers import record_owned, release_owned, remove_stale_files, temp_files


class Worker:
    """Builds ``module:Class(cfg)`` in its own process and runs its methods on request. A fused rollout
    replica is a second object of the process (``setup(..., target="policy")``), reached by
    :meth:`call_on`; the process's own object stays ``obj``."""

    def __init__(self, threads: int, preload: str | None = None, uses_torch: bool = True, place: str = "ray"):
        """``preload``: the backend's module, imported now (and its ``prestart()`` run, if it has one),
        while the process waits for its ``setup`` (the other models are built meanwhile); nothing
        touches a device here.
        ``uses_torch``: False for the reward workers, which then never import torch or
        transformers (seconds of CPU at every start, taken from the models starting beside them).
        ``place``: ``ray`` (a Ray actor's process), ``process`` (a process of a run without Ray) or
        ``inline`` (the driver's own process: its output and environment stay as they are;
        chatlearn.runtime.cluster.local)."""
        self.place = place
        # this process's start-up (startup_times): its start, this actor's creation (Ray's worker has
        # started and connected), ready for setup, each object's build; inline: from its creation
        now = time.time()
        self.times: dict = {"started": now if place == "inline" else process_start_time(), "created": now,
                            "ready": None, "build": {}}
        if place != "inline":
            setup_worker()  # third-party output to the run's logs/ folder (before importing them)
        # the method running now and since when: what the heartbeat tells the driver's watchdog
        self.running: tuple[str, float] | None = None
        if place == "ray":
            start_heartbeat(self.doing)
        # The process environment was set by Ray before start (chatlearn.runtime.cluster.worker_env); it is
        # recorded as found, so that tests can check what the process started with.
        self.start_env = dict(os.environ)
        if uses_torch:
            import torch
            from transformers.utils import logging as hf_logging

            torch.set_num_threads(threads)
            hf_logging.disable_progress_bar()  # per-file loading bars would flood the run's log
        self.obj = None
        self.objs: dict = {}  # name -> a further object of this process (a fused rollout replica)
        if preload:  # a backend's module may also say what to do before its setup (``prestart()``)
            hook = getattr(importlib.import_module(preload), "prestart", None)
            if hook is not None:
                hook()
        self.times["ready"] = time.time()

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port (rank 0 hosts the process group's rendezvous); without Ray,
        the loopback address."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0) if self.place != "ray" else ("", 0))
            port = s.getsockname()[1]
        if self.place != "ray":
            return "127.0.0.1", port
        import ray

        return ray.util.get_node_ip_address(), port

    def setup(self, factory: str, spec, env: dict[str, str] | None = None, target: str | None = None) -> None:
        """Build the backend from its spec (a ``TrainerSpec``, ``RolloutSpec``, ``RewardModelSpec`` or ``RewardSpec`` of
        :mod:`chatlearn.models.specs`, its device settings resolved here); ``target``: as a further
        object of that name (a fused rollout replica)."""
        began = time.time()
        os.environ.update(env or {})  # torch.distributed rendezvous (rank, world, address)
        from chatlearn.models.specs import RewardModelSpec, RolloutSpec, TrainerSpec, resolve_for_device

        if isinstance(spec, TrainerSpec):  # its loss may use a plugged policy loss or KL estimator
            load_plugins(spec.plugins, base_dir=spec.plugins_dir)
        if isinstance(spec, (TrainerSpec, RolloutSpec, RewardModelSpec)):
            import torch

            spec = resolve_for_device(spec, "cuda" if torch.cuda.is_available() else "cpu")
        remove_stale_files()  # of killed runs on this node
        before = temp_files()
        module, name = factory.split(":")
        built = getattr(importlib.import_module(module), name)(spec)
        if target is None:
            self.obj = built
        else:
            self.objs[target] = built
        # the rendezvous files its backend created (vLLM's vllm_dist_*): removed when this run ends,
        # or by the next start on this node if this process is killed first
        record_owned(temp_files() - before)
        self.times["build"][target or "self"] = time.time() - began

    def startup_times(self, target: str | None = None) -> dict:
        """Seconds this process spent starting (``process``: from its start to ready for ``setup``, the
        interpreter and the backend's imports; ``ray_worker``: the part before this actor was created,
        Ray's worker starting and connecting) and building its object ``target`` (``build``; None:
        its own): :class:`chatlearn.logging.startup.StartupClock`."""
        return {"process": self.times["ready"] - self.times["started"],
                "ray_worker": self.times["created"] - self.times["started"],
                "build": self.times["build"][target or "self"] if (target or "self") in self.times["build"] else None}

    def close(self) -> None:
        """Stop this process's objects that hold engines (their ``shutdown()``, fused replicas first) and
        drop them: a worker in the driver's process (``place`` inline) ends so; a process of its own
        just ends."""
        for built in [*self.objs.values(), self.obj]:
            stop = getattr(built, "shutdown", None)
            if stop is not None:
                stop()
        self.objs.clear()
        self.obj = None

    def release_temp_files(self) -> int:
        """Remove the temporary files this process recorded (the run is ending normally)."""
        return release_owned()

    def environment(self) -> dict[str, str]:
        """The environment this process started with."""
        return self.start_env

    def sync(self, op: str, *args):
        """Run ``op`` of this actor's weight-sync endpoint (``chatlearn.runtime.weight_push.stream``)."""
        if getattr(self, "_sync", None) is None:
            from chatlearn.runtime.weight_push.stream import Endpoint

            self._sync = Endpoint(self.obj)
        return getattr(self._sync, op)(*args)

    def memory(self) -> dict:
        """Peak memory of this process in MiB: CUDA memory allocated by torch when this process uses
        CUDA, else the peak resident set size (RSS). Peaks are since the process started."""
        torch = sys.modules.get("torch")  # a process that never imported torch uses no CUDA
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return {"peak_mb": torch.cuda.max_memory_allocated() / 2**20, "device": "cuda"}
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return {"peak_mb": rss / (2**20 if sys.platform == "darwin" else 2**10), "device": "cpu"}

    def device_memory(self) -> list[dict]:
        """GPU memory of this worker and the processes it started, per device it sees
        (``chatlearn.logging.gpu_memory.device_memory``); ``[]`` without CUDA."""
        return device_memory()

    def call(self, method: str, *args, **kwargs):
        """Run ``method`` and return (result, seconds); generators are drained into a list."""
        return self._run(self.obj, method, args, kwargs)

    def call_on(self, target: str, method: str, *args, **kwargs):
        """:meth:`call` on the further object ``target`` (a fused rollout replica)."""
        return self._run(self.objs[target], method, args, kwargs)

    def _run(self, obj, method: str, args, kwargs):
        start = time.perf_counter()
        self.running = (method, start)
        try:
            out = getattr(obj, method)(*args, **kwargs)
            if inspect.isgenerator(out):
                out = list(out)
        finally:
            self.running = None
        return out, time.perf_counter() - start

    def doing(self) -> tuple[str | None, float]:
        """The method this process runs now and for how many seconds (None, 0: none)."""
        running = self.running
        return (running[0], round(time.perf_counter() - running[1], 1)) if running else (None, 0.0)

    def push_weights_local(self, target: str, bucket_bytes: int) -> int:
        """The weight push of a fused rollout: this trainer rank's weights into the replica ``target``
        of this process (:func:`chatlearn.runtime.weight_push.stream.local_push`; a collective of the
        trainer ranks). Returns the bytes loaded."""
        from chatlearn.runtime.weight_push.stream import local_push

        return local_push(self.obj, self.objs[target], bucket_bytes)
