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


def _install() -> None:
    import importlib.abc
    import importlib.util
    import sys

    class PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != MODULE:
                return None
            sys.meta_path.remove(self)  # one module, once
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                module.HFRollout.load_weight_bucket = lambda self, weights: None

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, PatchOnImport())


if os.environ.get("CHATLEARN_TEST_STALE_PUSH"):
    _install()
