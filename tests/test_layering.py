"""Imports inside chatlearn go downward only.

Every ``chatlearn/**/*.py`` is parsed (no module is imported) and every import of a chatlearn
module is checked against :data:`MAY_IMPORT`: module-level imports and those inside functions
alike, ``import x`` and ``from x import y``, relative imports resolved against the module's
package. Strings such as the registry's ``"module:Class"`` factories are no imports: they are
resolved where the object is built (``runtime``).

Each module belongs to one *layer* (:func:`layer_of`): ``chatlearn/errors.py``,
``chatlearn/hub.py`` and ``chatlearn/__init__.py`` are ``base``, ``chatlearn/cli.py`` is
``cli``, and any other module is the layer of its top-level subpackage (``chatlearn.models.rollout.vllm``
is in ``models``). A second test checks that the import graph between the layers (chatlearn's
subpackages) has no cycle, whatever the table allows.
"""
from __future__ import annotations

import ast
import os
from collections import defaultdict

from conftest import REPO

PACKAGE = os.path.join(REPO, "chatlearn")

BASE = "base"
# The contract: the layers each layer's modules may import (besides its own modules). Bottom to top.
MAY_IMPORT: dict[str, set[str]] = {
    # errors.py (UserError, ConfigError), hub.py (Hugging Face Hub ids and snapshots), calls.py
    # (waiting on workers' calls, Ray's and a run without Ray's alike),
    # __init__.py (the version): plain Python and third-party code, nothing of chatlearn above
    BASE: set(),
    # the config schema, its loading and validation, the plan (sizes and placement), the names the
    # config accepts (registry.py) and the checks validation runs on files it names (data paths,
    # model folders, checkpoint manifests, reward functions)
    "config": {BASE},
    # chatlearn/plugins.py: the decorators users' plugin modules import (registry.py's pluggable registries)
    "plugins": {"config", BASE},
    # GRPO's math (advantages, losses, KL), the learning-rate schedule: registers its
    # implementations under the names config/registry.py declares
    "algorithms": {"config", BASE},
    # prompt data: reading rows, chat templates, tokenization, the sampler
    "data": {"config", BASE},
    # checkpoint files: the sharded trainer state, the Megatron checkpoint format and the
    # HF <-> Megatron weight mapping (file formats, torch only), the checkpoint manager, merge
    "checkpoint": {"config", BASE},
    # console, metric files and sinks, plots, progress
    "logging": {"config", BASE},
    # multi-turn environments and tools: the interface users implement, the built-in tool
    # environment, its parser and tools (run on the driver by the runtime's rollout loop)
    "env": {"config", BASE},
    # the backends a worker builds (trainers, rollout engines, reward functions) and what they
    # share (specs, weight buckets): use the layers above, never the runtime that drives them
    "models": {"algorithms", "data", "checkpoint", "logging", "config", BASE},
    # the driver: Ray start-up and placement, the engine, the scheduler, weight sync, eval
    "runtime": {"models", "env", "algorithms", "data", "checkpoint", "logging", "config", BASE},
    # the command line
    "cli": {"runtime", "models", "env", "algorithms", "data", "checkpoint", "logging", "config", BASE},
}


def module_name(path: str) -> str:
    rel = os.path.relpath(path, REPO)[:-len(".py")].split(os.sep)
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("errors", "hub", "batch", "calls"):
        return BASE
    if parts[1] == "cli":
        return "cli"
    return parts[1]


def modules() -> dict[str, str]:
    """{module name: file} of every chatlearn module."""
    out = {}
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                out[module_name(os.path.join(root, f))] = os.path.join(root, f)
    return out


def chatlearn_imports(module: str, file: str) -> list[tuple[str, int]]:
    """``(imported chatlearn module, line)`` of every import in ``file``, at any depth. For
    ``from m import n``, ``m.n`` when that is a module, else ``m``."""
    with open(file, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=file)
    known = modules_cache()
    package = module if file.endswith("__init__.py") else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub if sub in known else target, node.lineno))
    return sorted({(t, line) for t, line in out if t == "chatlearn" or t.startswith("chatlearn.")})


_MODULES: dict[str, str] = {}


def modules_cache() -> dict[str, str]:
    if not _MODULES:
        _MODULES.update(modules())
    return _MODULES


def test_the_table_names_every_layer():
    layers = {layer_of(m) for m in modules_cache()}
    assert layers <= set(MAY_IMPORT), f"modules in layers the table does not name: {layers - set(MAY_IMPORT)}"
    for layer, allowed in MAY_IMPORT.items():
        assert allowed <= set(MAY_IMPORT) and layer not in allowed, layer


def test_imports_go_downward_only():
    wrong = []
    for module, file in modules_cache().items():
        src = layer_of(module)
        for target, line in chatlearn_imports(module, file):
            dst = layer_of(target)
            if dst != src and dst not in MAY_IMPORT[src]:
                wrong.append(f"{os.path.relpath(file, REPO)}:{line}: {module} ({src}) imports {target} ({dst})")
    assert not wrong, ("imports against the layer table of tests/test_layering.py (a layer imports only the "
                       "layers below it):\n" + "\n".join(sorted(wrong)))


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph ``edges`` as its path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:  # depth first
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def import_edges(group_of) -> dict[str, set[str]]:
    """The imports between groups of modules (``group_of(module)``: its layer, its folder), as edges."""
    edges: dict[str, set[str]] = defaultdict(set)
    for module, file in modules_cache().items():
        for target, _ in chatlearn_imports(module, file):
            if group_of(target) != group_of(module):
                edges[group_of(module)].add(group_of(target))
    return edges


def test_no_import_cycle_between_subpackages():
    """The graph of the imports between the layers (chatlearn's subpackages, the base modules and
    the cli) has no cycle: a layer pair the table lets import each other must not do it both ways."""
    cycle = find_cycle(import_edges(layer_of))
    assert cycle is None, f"import cycle between chatlearn's subpackages: {' -> '.join(cycle)}"


def package_of(module: str) -> str:
    """The folder a module is in (``chatlearn.models.trainer`` for ``chatlearn.models.trainer.fsdp``);
    the modules directly in ``chatlearn/`` (errors, hub, cli) stand for themselves."""
    files = modules_cache()
    if files[module].endswith("__init__.py") or module.count(".") == 1:
        return module
    return module.rpartition(".")[0]


def test_no_import_cycle_between_folders_at_any_depth():
    """Inside a layer too, folders do not import each other both ways (``chatlearn.models`` and
    ``chatlearn.models.trainer``: the shared pieces sit in the parent, the backends use them)."""
    cycle = find_cycle(import_edges(package_of))
    assert cycle is None, f"import cycle between chatlearn's folders: {' -> '.join(cycle)}"
