"""The algorithms a run can train with, each declared once: ``models.policy_trainer.algorithm``.

An algorithm's declaration (``AlgorithmDecl`` in ``ALGORITHMS``, chatlearn/config/registry.py; a plugin
adds one with ``chatlearn.plugins.register_algorithm``) says which kinds of model it needs besides the rollout engine, the
policy trainer and the reward (``critic`` for PPO), which advantage estimators it takes, and the
``"module:function"`` that builds it in the driver (:mod:`chatlearn.runtime.driver.algorithm`
composes GRPO and PPO from shared parts). Validation, the plan and the comparison of a resumed
run's config read the declaration; nothing else names an algorithm's estimator.

``algorithm: null`` (the default, and every ChatLearn config) infers it from
``advantage_estimator``: the algorithm that claims the estimator as its own (PPO claims ``gae``),
else ``grpo``. An algorithm set without an estimator gets its own first one (``algorithm: ppo``
trains with ``gae``).
"""
from __future__ import annotations

from chatlearn.config.registry import ADVANTAGE_ESTIMATORS, ALGORITHMS, AlgorithmDecl
from chatlearn.errors import ConfigError

KEY = "models.policy_trainer.algorithm"
ESTIMATOR_KEY = "models.policy_trainer.advantage_estimator"


def takes(decl: AlgorithmDecl, estimator: str) -> bool:
    """Whether algorithm ``decl`` trains with advantage estimator ``estimator``: one it claims, or (claiming
    none) one that no other algorithm claims."""
    if decl.estimators is not None:
        return estimator in decl.estimators
    return claimant(estimator) is None


DEFAULT = "grpo"


def claimant(estimator: str) -> AlgorithmDecl | None:
    """The algorithm that claims ``estimator`` as its own (PPO: gae), or None."""
    for name in ALGORITHMS:
        decl = ALGORITHMS.get(name)
        if decl.estimators is not None and estimator in decl.estimators:
            return decl
    return None


def declared(algorithm: str | None, estimator: str | None) -> AlgorithmDecl:
    """The declaration of ``algorithm``, or (None) of the one ``estimator`` infers; for a config tree
    as written (a key absent: None), so an unknown name falls back to the default."""
    if algorithm in ALGORITHMS:
        return ALGORITHMS.get(algorithm)
    found = claimant(estimator) if estimator is not None else None
    return found or ALGORITHMS.get(DEFAULT)


def uses_kind(tree_algorithm: str | None, estimator: str | None, kind: str) -> bool:
    """Whether the algorithm of a config tree needs a model of ``kind`` (e.g. a critic)."""
    return kind in declared(tree_algorithm, estimator).needs


def resolve_algorithm(cfg, user_keys: frozenset) -> AlgorithmDecl:
    """Set ``algorithm`` and ``advantage_estimator`` in ``cfg`` to what the run trains with (see the module
    docstring); ``user_keys``: the keys the user set. A ConfigError for an unknown algorithm (with the
    nearest name) or an estimator the algorithm does not take."""
    t = cfg.models.policy_trainer
    if t.algorithm is None:
        decl = declared(None, t.advantage_estimator)
        t.algorithm = decl.name
        return decl
    try:
        decl = ALGORITHMS.get(t.algorithm)
    except ValueError as err:
        raise ConfigError(f"{err} (null: inferred from advantage_estimator).", key=KEY) from None
    if not takes(decl, t.advantage_estimator):
        if ESTIMATOR_KEY not in user_keys and decl.estimators is not None:
            t.advantage_estimator = decl.estimators[0]
            return decl
        own = (f"its estimator is {' or '.join(decl.estimators)}" if decl.estimators is not None
               else f"{t.advantage_estimator} is {claimant(t.advantage_estimator).name}'s")
        others = [n for n in ADVANTAGE_ESTIMATORS if takes(decl, n)]
        raise ConfigError(f"is {t.algorithm!r}, but advantage_estimator is {t.advantage_estimator!r}: {own}. Set "
                          f"advantage_estimator to one of {', '.join(others)}, or remove algorithm (null: inferred "
                          "from the estimator).", key=ESTIMATOR_KEY)
    return decl
