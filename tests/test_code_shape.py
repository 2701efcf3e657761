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
