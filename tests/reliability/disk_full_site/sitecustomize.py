"""Test-only start-up hook: the FSDP trainer's N-th checkpoint save meets a real file-size limit.

An end-to-end test puts this folder on ``PYTHONPATH`` and sets ``CHATLEARN_TEST_FSIZE=N:BYTES``; Python
imports ``sitecustomize`` at start-up in every process that inherits that environment. Only when
``chatlearn.models.trainer.fsdp`` is imported (by the trainer actors) is ``FSDPTrainer.save_checkpoint``
wrapped: during its N-th call (1-based) the process's ``RLIMIT_FSIZE`` is BYTES (SIGXFSZ is ignored), so
the kernel refuses every write past BYTES in a file with EFBIG ("File too large"), as a full disk refuses
one with ENOSPC. The limit is lifted when the call returns. Without the variable this file does nothing.
"""
import os

MODULE = "chatlearn.models.trainer.fsdp"


def _patch_on_import(module_name: str, patch) -> None:
    """patch(module) once ``module_name`` is first imported (the hooks' shared part: ../site_hooks)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "site_hooks"))
    from patch_on_import import patch_on_import

    patch_on_import(module_name, patch)


def _install(nth: int, limit: int) -> None:
    import resource
    import signal

    def patch(module):
        original = module.FSDPTrainer.save_checkpoint
        calls = [0]

        def save_checkpoint(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] != nth:
                return original(self, *args, **kwargs)
            before = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, before[1]))
            try:
                return original(self, *args, **kwargs)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, before)

        module.FSDPTrainer.save_checkpoint = save_checkpoint

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing
    _patch_on_import(MODULE, patch)


if os.environ.get("CHATLEARN_TEST_FSIZE"):
    _nth, _, _limit = os.environ["CHATLEARN_TEST_FSIZE"].partition(":")
    _install(int(_nth), int(_limit))
