"""Test-only start-up hook: make the FSDP trainer's gradients nan from a given optimizer step on.

An end-to-end test puts this folder on ``PYTHONPATH`` and sets ``CHATLEARN_TEST_NAN_FROM_STEP=N``;
Python imports ``sitecustomize`` at start-up in every process that inherits that environment (the
driver, Ray's processes, its actors). Only when ``chatlearn.models.trainer.fsdp`` is imported (by the
trainer actors) is ``FSDPTrainer.compute_grads`` wrapped: from its N-th call on (1-based), every
gradient and the loss are multiplied by nan, as a loss that overflows would make them. The learning
rate plays no part. Without the variable this file does nothing.
"""
import os

MODULE = "chatlearn.models.trainer.fsdp"


def _patch_on_import(module_name: str, patch) -> None:
    """patch(module) once ``module_name`` is first imported (the hooks' shared part: ../site_hooks)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "site_hooks"))
    from patch_on_import import patch_on_import

    patch_on_import(module_name, patch)


def _install(first: int) -> None:
    def patch(module):
        original = module.FSDPTrainer.compute_grads
        calls = [0]

        def compute_grads(self, *args, **kwargs):
            metrics = original(self, *args, **kwargs)
            calls[0] += 1
            if calls[0] >= first:
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(float("nan"))
                metrics["loss"] = float("nan")
            return metrics

        module.FSDPTrainer.compute_grads = compute_grads

    _patch_on_import(MODULE, patch)


if os.environ.get("CHATLEARN_TEST_NAN_FROM_STEP"):
    _install(int(os.environ["CHATLEARN_TEST_NAN_FROM_STEP"]))
