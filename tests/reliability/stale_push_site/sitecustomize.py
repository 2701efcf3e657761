"""Test-only start-up hook: a weight push that does not land in the transformers rollout engine.

An end-to-end test puts this folder on ``PYTHONPATH`` and sets ``CHATLEARN_TEST_STALE_PUSH=1``; Python
imports ``sitecustomize`` at start-up in every process that inherits that environment (the driver,
Ray's processes, its actors). Only when ``chatlearn.models.rollout.hf`` is imported (by the rollout
replicas, fused into the trainer's processes or not) is ``HFRollout.load_weight_bucket`` made a no-op:
every push goes through its motions and the engine keeps the weights it has. Without the variable
this file does nothing.
"""
import os

MODULE = "chatlearn.models.rollout.hf"


def _patch_on_import(module_name: str, patch) -> None:
    """patch(module) once ``module_name`` is first imported (the hooks' shared part: ../site_hooks)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "site_hooks"))
    from patch_on_import import patch_on_import

    patch_on_import(module_name, patch)


def _patch(module) -> None:
    module.HFRollout.load_weight_bucket = lambda self, weights: None


if os.environ.get("CHATLEARN_TEST_STALE_PUSH"):
    _patch_on_import(MODULE, _patch)
