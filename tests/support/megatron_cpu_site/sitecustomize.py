"""Test-only start-up hook: run the Megatron trainer under the CPU device shim in the Ray
actors of an end-to-end run.

An end-to-end test puts this folder on ``PYTHONPATH`` and sets
``CHATLEARN_TEST_MEGATRON_CPU_SHIM=1``; Python imports ``sitecustomize`` at start-up in every
process that inherits that environment (the driver, Ray's processes, its actors). Nothing
else is imported here: only when ``chatlearn.models.trainer.megatron.trainer`` is imported
(by the trainer actors) is every public method of ``MegatronTrainer`` wrapped to run inside
``megatron_shim.cpu_device_shim`` (tests/support/megatron_shim.py). Without the variable this
file does nothing.
"""
import os

TRAINER_MODULE = "chatlearn.models.trainer.megatron.trainer"


def _install() -> None:
    import importlib.abc
    import importlib.util
    import sys

    support = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    class PatchOnImport(importlib.abc.MetaPathFinder):
        """Finds nothing itself: when TRAINER_MODULE is about to be imported, wraps its
        loader so that MegatronTrainer is shimmed right after the module has run."""

        def find_spec(self, name, path, target=None):
            if name != TRAINER_MODULE:
                return None
            sys.meta_path.remove(self)  # one module, once
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_and_shim(module):
                exec_module(module)
                sys.path.insert(0, support)
                from megatron_shim import shim_trainer_class

                shim_trainer_class(module.MegatronTrainer)

            spec.loader.exec_module = exec_and_shim
            return spec

    sys.meta_path.insert(0, PatchOnImport())


if os.environ.get("CHATLEARN_TEST_MEGATRON_CPU_SHIM") == "1":
    _install()
