"""The shape the architecture promises (docs/architecture.md): the episode reads like the algorithm
in one short function, and no function grows past what a reader can hold."""
from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "chatlearn"
MAX_FUNCTION_LINES = 80
MAX_EPISODE_LINES = 60
MAX_ENGINE_LINES = 250  # the Engine class: the loop and its stages; checkpoints, reward models, parts live beside it


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


def _method(path: pathlib.Path, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _stages_named(node: ast.AST) -> list[str]:
    return [n.attr for n in sorted((n for n in ast.walk(node) if isinstance(n, ast.Attribute)
                                    and isinstance(n.value, ast.Name) and n.value.id == "Stage"),
                                   key=lambda n: (n.lineno, n.col_offset))]


def test_the_episode_is_one_short_function_with_a_call_per_stage():
    """The engine's episode names every stage it runs itself, in order; the reward models' turns are
    :class:`RewardModels`' (one reward_model stage per model), the forward passes between reward and
    train are the algorithm's parts' (the policy's: the reference, then the old log-probs; the critic's:
    its values)."""
    driver = PACKAGE / "runtime" / "driver"
    episode = _method(driver / "engine.py", "Engine", "episode")
    assert episode.end_lineno - episode.lineno + 1 <= MAX_EPISODE_LINES
    assert [s for s in _stages_named(episode) if s != "EVAL"] == ["GENERATE", "REWARD", "TRAIN", "CHECKPOINT",
                                                                  "WEIGHT_PUSH"]
    assert "score_all" in ast.unparse(episode)  # the reward models' turns, beside the reward workers
    assert _stages_named(_method(driver / "reward_models.py", "RewardModels", "score_all")) == ["REWARD_MODEL"]
    assert _stages_named(_method(driver / "algorithm.py", "PolicyUpdate", "passes")) == ["REF_LOGPROBS",
                                                                                        "OLD_LOGPROBS"]
    # PPO's: the policy's, then the critic's values (the critic, resident for them, stays to train)
    assert _stages_named(_method(driver / "algorithm.py", "CriticUpdate", "passes")) == ["VALUES"]
    assert _stages_named(_method(driver / "judges.py", "Judges", "score_all")) == ["JUDGE"]  # each judge's turn
    # distillation's: the teacher's log-probs, before the policy's
    assert _stages_named(_method(driver / "algorithm.py", "TeacherPass", "passes")) == ["TEACHER_LOGPROBS"]
    from chatlearn.config.names import Stage

    covered = {"GENERATE", "REWARD", "REWARD_MODEL", "JUDGE", "TRAIN", "CHECKPOINT", "WEIGHT_PUSH", "REF_LOGPROBS",
               "OLD_LOGPROBS", "VALUES", "TEACHER_LOGPROBS", "EVAL"}
    assert {s.name for s in Stage} == covered


def test_the_engine_class_stays_small():
    tree = ast.parse((PACKAGE / "runtime" / "driver" / "engine.py").read_text(encoding="utf-8"))
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    assert engine.end_lineno - engine.lineno + 1 <= MAX_ENGINE_LINES


def test_the_engine_names_no_algorithm():
    """The engine runs whatever algorithm chatlearn.runtime.driver.algorithm makes: no algorithm's
    name, loss option or estimator appears in its code (names, attributes or strings)."""
    engine = PACKAGE / "runtime" / "driver" / "engine.py"
    tree = ast.parse(engine.read_text(encoding="utf-8"))
    words = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Name):
            words.add(n.id)
        elif isinstance(n, ast.Attribute):
            words.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and not n.value.count(" "):
            words.add(n.value)
        elif isinstance(n, ast.ImportFrom):
            words.update(a.name for a in n.names)
    forbidden = {"GRPO", "grpo", "PPO", "ppo", "advantage_estimator", "kl_coef", "old_logprobs", "ref_logprobs",
                 "sample_weights", "old_logprob_pass", "uses_ref"}
    assert not words & forbidden, sorted(words & forbidden)


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
