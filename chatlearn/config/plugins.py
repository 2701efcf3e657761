"""``runtime_args.plugins``: the user's modules that register advantage estimators, policy losses and KL
estimators of their own, with the decorators of :mod:`chatlearn.plugins` (``Registry.plug`` of the registries
:func:`chatlearn.config.registry.pluggable` lists).

:func:`load_plugins` imports them wherever a registry is read: in the driver, by validation before it checks
the keys that name a registered function (so ``advantage_estimator: my_est`` validates, and the driver's
advantages find it), and in every trainer worker before it builds its backend (``TrainerSpec.plugins``,
``chatlearn.runtime.cluster.worker``), where the policy loss and the KL estimator run. A run without Ray builds
its trainer in the driver's process, where the modules are imported already.

An entry is a module name (``my_pkg.my_rl``, imported with the directory chatlearn runs from on ``sys.path``, as a
reward function's ``package.module:function``) or a file (``path/to/my_rl.py``, relative to that directory).
Importing is idempotent per process: a module imported before (by an earlier call, or by the user's own code) is
not run again. Every problem is a ConfigError naming ``runtime_args.plugins[i]`` and its fix, raised before
anything starts: a module or file that is not found, a module that raises while it is imported, one that
registers a built-in name or a name another module registered, one that registers nothing.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
import traceback
from types import ModuleType
from typing import Iterable

from chatlearn.config import registry
from chatlearn.config.registry import NameClash
from chatlearn.errors import ConfigError

KEY = "runtime_args.plugins"
MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
DECORATORS = ("chatlearn.plugins.register_advantage_estimator, register_policy_loss, register_kl_estimator or "
              "register_algorithm")


def load_plugins(entries: Iterable[str], base_dir: str, key: str = KEY) -> None:
    """Import each entry of ``runtime_args.plugins`` (see the module docstring); ``base_dir``: the directory
    relative files start from and module names are also found from (the driver's working directory)."""
    for i, entry in enumerate(entries):
        load_plugin(str(entry), base_dir, f"{key}[{i}]")


def load_plugin(entry: str, base_dir: str, key: str) -> ModuleType:
    """The module ``entry`` names, imported (once per process); a ConfigError naming ``key`` when it cannot be."""
    is_file = entry.endswith(".py") or "/" in entry or os.sep in entry
    if is_file:
        file = os.path.abspath(os.path.join(base_dir, entry))
        if not os.path.isfile(file):
            raise ConfigError(f"the plugin file {entry!r} does not exist ({file}; relative paths start from the "
                              f"directory chatlearn runs from, {base_dir}). Fix the path, or give the module's "
                              "name (my_pkg.my_rl) if it is importable.", key=key)
        digest = hashlib.sha1(file.encode()).hexdigest()[:12]
        name = f"chatlearn_plugin_{re.sub(r'[^0-9A-Za-z_]', '_', os.path.basename(file)[:-3])}_{digest}"
    elif MODULE_RE.match(entry):
        file, name = None, entry
        if base_dir not in sys.path:
            sys.path.append(base_dir)
    else:
        raise ConfigError(f"{entry!r} is neither a module name (my_pkg.my_rl) nor a Python file "
                          "(path/to/my_rl.py). Fix the entry.", key=key)
    if name in sys.modules:
        return sys.modules[name]
    before = _plugged()
    try:
        module = _import_file(file, name) if file else importlib.import_module(name)
    except NameClash as err:
        raise ConfigError(_clash(entry, err), key=key) from err
    except ModuleNotFoundError as err:
        if file or not (err.name == name or name.startswith(f"{err.name}.")):
            raise ConfigError(_failed(entry, err), key=key) from err
        raise ConfigError(
            f"cannot import the plugin module {entry!r}: no module {err.name!r} on the Python path (the directory "
            f"chatlearn runs from, {base_dir}, and PYTHONPATH: {os.environ.get('PYTHONPATH') or 'not set'}). "
            "Install its package, run chatlearn from the directory that holds it or add that directory to "
            "PYTHONPATH, or give the file instead (path/to/my_rl.py).", key=key) from err
    except (Exception, SystemExit) as err:  # the user's module: any error while it runs is theirs
        raise ConfigError(_failed(entry, err), key=key) from err
    if not _plugged() - before:
        raise ConfigError(f"the plugin {entry!r} imports, but registers nothing: no advantage estimator, policy "
                          f"loss, KL estimator or algorithm. Register its functions with {DECORATORS} (docs/architecture.md, "
                          "\"Plugins\"), or remove it from the list.", key=key)
    return module


def _import_file(file: str, name: str) -> ModuleType:
    """Run ``file`` as the module ``name`` (kept in ``sys.modules``: a second load finds it)."""
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _plugged() -> set[tuple[str, str]]:
    """``(kind, name)`` of every plugged name of this process."""
    return {(r.kind, n) for r in registry.pluggable() for n in r.plugged()}


def _clash(entry: str, err: NameClash) -> str:
    if err.first is None:
        where = f" (chatlearn's {err.implemented_in})" if err.implemented_in else ""
        return (f"the plugin {entry!r} registers the {err.kind} {err.name!r} ({err.second}), but {err.name!r} is "
                f"built in{where}. Register yours under a name of its own and set the config's key to that name.")
    return (f"the plugin {entry!r} registers the {err.kind} {err.name!r} ({err.second}), which {err.first} "
            "registered already. Give one of the two a name of its own, or list only one of their modules in "
            f"{KEY}.")


def _failed(entry: str, err: BaseException) -> str:
    """The message of a plugin that raised ``err`` while it was imported: its type, the first line of its
    text and where it was raised."""
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith("<frozen")]
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return (f"importing the plugin {entry!r} failed with {text}{where}. Fix the module so that it imports (it "
            "runs in the driver and in every trainer process; --debug shows the whole traceback).")
