"""What the fault-injection start-up hooks of tests/reliability (``*_site/sitecustomize.py``) share: patch a
chatlearn module right after it is first imported in a process, before anything uses it."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable


def patch_on_import(module_name: str, patch: Callable) -> None:
    """Call ``patch(module)`` once ``module_name`` has been executed, the first time a process imports it."""

    class PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != module_name:
                return None
            sys.meta_path.remove(self)  # one module, once
            spec = importlib.util.find_spec(name)
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, PatchOnImport())
