"""vLLM 0.32's executor (``vllm/v1/executor/abstract.py``, ``uniproc_executor.py``) with its one
worker, built as ``WorkerWrapperBase.init_worker`` builds it (``v1/worker/worker_base.py``): the
``worker_extension_cls`` is added to the worker's bases after checking that none of its
attributes is already the worker's.

``collective_rpc(method, timeout, args, kwargs)`` runs ``method`` (a name, or a callable taking
the worker first) on the worker and returns ``[result]``; an unknown name raises
``NotImplementedError`` (``run_method``, ``v1/serial_utils.py``). With a multiprocess engine core
(``SyncMPClient``) the arguments and the results cross as msgpack: no tensors, tuples come back as
lists, and a callable needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.

Sleep state (``sleeping_tags``): ``sleep(level)`` puts the worker to sleep and marks ``weights``
and ``kv_cache`` sleeping, unless the weights already are ("Executor is already sleeping.",
nothing done). ``wake_up(tags)`` does nothing, with a warning, when nothing sleeps or when one of
``tags`` is not sleeping (a misspelt tag included): vLLM does not raise there.
"""
from __future__ import annotations

import importlib
import logging
import os

from vllm.v1.worker.gpu_worker import Worker

logger = logging.getLogger("vllm.v1.executor.abstract")
SLEEP_TAGS = frozenset(("weights", "kv_cache"))


def _msgpack_round_trip(value):
    import msgspec

    return msgspec.msgpack.decode(msgspec.msgpack.encode(value))


def resolve_obj_by_qualname(qualname: str):
    module_name, obj_name = qualname.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), obj_name)


def run_method(obj, method, args: tuple, kwargs: dict):
    if isinstance(method, str):
        try:
            func = getattr(obj, method)
        except AttributeError:
            raise NotImplementedError(f"Method {method!r} is not implemented.") from None
        return func(*args, **kwargs)
    return method(obj, *args, **kwargs)


class Executor:
    def __init__(self, vllm_config, multiprocess: bool):
        self.vllm_config = vllm_config
        self.multiprocess = multiprocess
        self.sleeping_tags: set[str] = set()
        worker_class = type("Worker", (Worker,), {})
        name = vllm_config.parallel_config.worker_extension_cls
        if name:
            extension = resolve_obj_by_qualname(name)
            for attr in dir(extension):
                if attr.startswith("__"):
                    continue
                assert not hasattr(worker_class, attr), (
                    f"Worker class {worker_class} already has an attribute {attr}, which conflicts with the "
                    f"worker extension class {extension}.")
            worker_class.__bases__ = worker_class.__bases__ + (extension,)
        self.driver_worker = worker_class(vllm_config)
        self.driver_worker.load_model()
        self.driver_worker.initialize_kv_cache()

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        if self.multiprocess:
            if not isinstance(method, str) and os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION") != "1":
                raise TypeError(f"Object of type {type(method)} is not serializableSet "
                                "VLLM_ALLOW_INSECURE_SERIALIZATION=1 to allow fallback to pickle-based serialization.")
            args, kwargs = tuple(_msgpack_round_trip(list(args))), _msgpack_round_trip(kwargs)
            return [_msgpack_round_trip(run_method(self.driver_worker, method, args, kwargs))]
        return [run_method(self.driver_worker, method, args, kwargs)]

    def sleep(self, level: int = 1) -> None:
        if "weights" in self.sleeping_tags:
            logger.warning("Executor is already sleeping.")
            return
        self.collective_rpc("sleep", kwargs=dict(level=level))
        self.sleeping_tags |= SLEEP_TAGS

    def wake_up(self, tags: list[str] | None = None) -> None:
        if not self.is_sleeping:
            logger.warning("Executor is not sleeping.")
            return
        if tags:
            for tag in tags:
                if tag not in self.sleeping_tags:
                    logger.warning("Tag %s is not in sleeping tags %s", tag, self.sleeping_tags)
                    return
        self.collective_rpc("wake_up", kwargs=dict(tags=tags))
        if tags:
            for tag in tags:
                self.sleeping_tags.remove(tag)
        else:
            self.sleeping_tags.clear()
