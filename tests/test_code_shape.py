"""The shape the architecture promises (docs/architecture.md): the episode reads like the algorithm
in one short function, and no function grows past what a reader can hold."""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "chatlearn"
MAX_FUNCTION_LINES = 80
MAX_EPISODE_LINES = 60


def functions():
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(PACKAGE.parent), node


def test_no_function_is_longer_than_a_screen_and_a_half():
    long = [f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path, node in functions() if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them): {long}"


def test_the_episode_is_one_short_function_with_a_call_per_stage():
    engine = PACKAGE / "runtime" / "engine.py"
    tree = ast.parse(engine.read_text(encoding="utf-8"))
    grpo = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GRPO")
    episode = next(n for n in grpo.body if isinstance(n, ast.FunctionDef) and n.name == "episode")
    assert episode.end_lineno - episode.lineno + 1 <= MAX_EPISODE_LINES
    # every stage of chatlearn.config.names.Stage but evaluation is named in it, in the order it runs
    from chatlearn.config.names import Stage

    named = [n.attr for n in sorted((n for n in ast.walk(episode) if isinstance(n, ast.Attribute)
                                     and isinstance(n.value, ast.Name) and n.value.id == "Stage"),
                                    key=lambda n: (n.lineno, n.col_offset))]
    order = [s.name for s in Stage if s is not Stage.EVAL]
    assert [s for s in named if s in order] == [s for s in order if s != "REF_LOGPROBS"], named


# folders of whole-run tests and shared test code: not tied to one package
NOT_MIRRORED = {"e2e", "reliability", "bench", "support"}


def test_the_test_tree_mirrors_the_package():
    """tests/<package>/... holds the tests of chatlearn/<package>/..., so a module's tests are found
    by its path; every package folder has a test folder (a subpackage's tests may sit in its parent's)."""
    tests = PACKAGE.parent / "tests"
    folders = {p.relative_to(tests) for p in tests.rglob("*") if p.is_dir() and "__pycache__" not in p.parts
               and any(p.glob("test_*.py"))}
    stray = sorted(str(f) for f in folders
                   if f.parts[0] not in NOT_MIRRORED and not (PACKAGE / f).is_dir())
    assert not stray, f"test folders with no package folder of the same path in chatlearn/: {stray}"
    packages = {p.relative_to(PACKAGE) for p in PACKAGE.rglob("*") if p.is_dir() and "__pycache__" not in p.parts}
    untested = sorted(str(p) for p in packages if not any(p == f or p.is_relative_to(f) for f in folders))
    assert not untested, f"package folders whose tests have no folder of their own or a parent's: {untested}"


def test_the_architecture_doc_names_every_part_and_stage():
    from chatlearn.config.names import Part, Stage

    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = [str(n) for n in (*Part, *Stage) if f"`{n}`" not in doc]
    assert not missing, f"docs/architecture.md does not name {missing}"
