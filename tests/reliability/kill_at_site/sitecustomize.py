"""Test-only start-up hook: SIGKILL a run at a chosen point between an episode's checkpoint and its metrics row.

An end-to-end test puts this folder on ``PYTHONPATH`` and sets ``CHATLEARN_TEST_KILL_AT=<point>@<episode>``;
Python imports ``sitecustomize`` at start-up in every process that inherits that environment. Only the
process that imports ``chatlearn.runtime.driver.engine`` (the driver) is patched: once episode ``<episode>``
has passed ``<point>``, its whole process group is killed with SIGKILL (nothing runs after it). The points,
in the order an episode meets them: ``saved`` (its checkpoint written), ``pushed`` (the weight push after
it), ``evaluated`` (its evaluation), ``logged`` (its metrics row written). Without the variable this file
does nothing.
"""
import os

MODULE = "chatlearn.runtime.driver.engine"


def _patch(module) -> None:
    import signal

    point, _, at = os.environ["CHATLEARN_TEST_KILL_AT"].partition("@")
    at = int(at)
    now = {"episode": 0}

    def kill_after(owner, name, where, which=lambda self, args: now["episode"]):
        original = getattr(owner, name)

        def wrapper(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            if point == where and which(self, args) == at:
                os.killpg(os.getpgid(0), signal.SIGKILL)
            return result

        setattr(owner, name, wrapper)

    episode = module.Engine.episode

    def tracked(self, number):
        now["episode"] = number
        return episode(self, number)

    module.Engine.episode = tracked
    kill_after(module.RunCheckpoints, "save", "saved", lambda self, args: args[0])
    kill_after(module.Engine, "push_weights", "pushed")
    kill_after(module.Engine, "evaluate", "evaluated")
    kill_after(module.Engine, "log", "logged", lambda self, args: args[0])


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
                _patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, PatchOnImport())


if os.environ.get("CHATLEARN_TEST_KILL_AT"):
    _install()
