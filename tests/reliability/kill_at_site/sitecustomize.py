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


def _patch_on_import(module_name: str, patch) -> None:
    """patch(module) once ``module_name`` is first imported (the hooks' shared part: ../site_hooks)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "site_hooks"))
    from patch_on_import import patch_on_import

    patch_on_import(module_name, patch)


if os.environ.get("CHATLEARN_TEST_KILL_AT"):
    _patch_on_import(MODULE, _patch)
