"""The names the config accepts, declared once, at the bottom of the layers.

Validation (``chatlearn.config``) asks these registries which values a key takes; the layers
above attach the implementations: ``chatlearn.algorithms.advantages``, ``.kl``, ``.grpo`` and ``.lr_schedule`` register
their functions with :meth:`Registry.register`, and the backends and the built-in reward
functions are declared here with their ``"module:attribute"`` factory strings (imported only by
whoever builds them: the runtime, a reward worker). Registering a name that is not declared
here fails when the registering module is imported, so the config and the code cannot
disagree on a name.

A registry made ``pluggable`` also takes new names from the user's own modules (``runtime_args.plugins``):
they register with :meth:`Registry.plug` (the decorators of :mod:`chatlearn.plugins`), and their names
are then among the registry's ``names``, as the declared ones, in every process that imported the module
(:mod:`chatlearn.config.plugins`). A name is defined once: plugging a declared name, or one that another
definition plugged, raises :class:`NameClash` naming both.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
import inspect
from typing import Callable, Iterable, Mapping, TypeVar

T = TypeVar("T")

HERE = "chatlearn/config/registry.py"


class NameClash(ValueError):
    """A name defined twice: plugged into a registry that declares it (a built-in name), or plugged by
    two definitions. ``first`` and ``second`` describe them (:func:`definition`); ``first`` is None for a
    declared name."""

    def __init__(self, kind: str, name: str, first: str | None, second: str, implemented_in: str | None):
        self.kind, self.name, self.first, self.second, self.implemented_in = kind, name, first, second, implemented_in
        if first is None:
            where = f" (chatlearn's {implemented_in})" if implemented_in else ""
            message = (f"{kind} {name!r} is built in{where}, and {second} registers it again. Register yours "
                       f"under a name of its own and give the config that name.")
        else:
            message = (f"{kind} {name!r} is registered twice: by {first} and by {second}. Give one of them "
                       "another name, or import only one of the two modules.")
        super().__init__(message)


def definition(obj) -> str:
    """Where ``obj`` is defined, for messages: ``qualname (file:line)`` of a function or class, its repr
    otherwise."""
    obj = obj.build if isinstance(obj, AlgorithmDecl) else obj
    name = getattr(obj, "__qualname__", None) or repr(obj)
    try:
        file, line = inspect.getsourcefile(obj), inspect.getsourcelines(obj)[1]
    except (TypeError, OSError):
        return name
    return f"{name} ({file}:{line})"


class Registry:
    """The declared ``names`` of one ``kind`` of thing (``"advantage estimator"``), each with
    an optional implementation: given at declaration (``names`` a mapping of name to
    implementation) or attached later with the :meth:`register` decorator by the module
    ``implemented_in``. A ``pluggable`` registry also takes names of the user's own with
    :meth:`plug`; :attr:`names` then holds them after the declared ones."""

    def __init__(self, kind: str, names: Iterable[str] | Mapping[str, object], *, declared_as: str,
                 implemented_in: str | None = None, pluggable: bool = False):
        self.kind, self.declared_as, self.implemented_in = kind, declared_as, implemented_in
        self.pluggable = pluggable
        self._declared = tuple(names)
        self._impl: dict[str, object] = dict(names) if isinstance(names, Mapping) else {}
        self._plugged: dict[str, str] = {}  # plugged name -> its definition (definition())

    @property
    def names(self) -> tuple[str, ...]:
        """The names the config accepts: the declared ones in declaration order (the order error
        messages list them in), then the plugged ones in the order they were plugged."""
        return self._declared + tuple(self._plugged)

    @property
    def declared(self) -> tuple[str, ...]:
        """The declared (built-in) names alone."""
        return self._declared

    def plugged(self) -> dict[str, str]:
        """``{plugged name: where it is defined}``."""
        return dict(self._plugged)

    def __contains__(self, name: object) -> bool:
        return name in self._declared or name in self._plugged

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names})"

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``obj`` implements the declared ``name``."""
        if name not in self._declared:
            raise ValueError(f"cannot register {self.kind} {name!r}: it is not declared. Add it to "
                             f"{self.declared_as} in {HERE} (the names the config accepts: "
                             f"{', '.join(self._declared)}), then register its implementation.")

        def attach(obj: T) -> T:
            if self._impl.get(name, obj) is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice ({self._impl[name]!r} and {obj!r}).")
            self._impl[name] = obj
            return obj

        return attach

    def plug(self, name: str) -> Callable[[T], T]:
        """Decorator: ``obj`` is the user's own ``name``, which the config then accepts. A declared name, or
        one plugged by another definition, raises :class:`NameClash` (when ``obj`` is given). The same
        definition again (the same object, or the same function of the same file: a module imported or run
        a second time) is no clash: the newest object is kept."""
        if not self.pluggable:
            raise ValueError(f"{self.kind} names are chatlearn's own: a plugin cannot add one (it can add "
                             "advantage estimators, policy losses, KL estimators and algorithms: chatlearn.plugins).")
        if not isinstance(name, str) or not name:
            raise ValueError(f"a plugged {self.kind} needs a name (a non-empty string), got {name!r}.")

        def attach(obj: T) -> T:
            where = definition(obj)
            if name in self._declared:
                raise NameClash(self.kind, name, None, where, self.implemented_in)
            old = self._impl.get(name, obj)
            if old is not obj and (_site(old) is None or _site(old) != _site(obj)):
                raise NameClash(self.kind, name, self._plugged[name], where, self.implemented_in)
            self._impl[name], self._plugged[name] = obj, where
            return obj

        return attach

    def get(self, name: str):
        """The implementation of ``name``; a ValueError naming the accepted names (and the
        nearest one) for an unknown name, a LookupError for a declared name without one."""
        if name not in self:
            guess = difflib.get_close_matches(str(name), self.names, n=1)
            hint = f" Did you mean {guess[0]!r}?" if guess else ""
            raise ValueError(f"unknown {self.kind} {name!r}; one of {self.names}.{hint}")
        if name not in self._impl:
            where = f": import {self.implemented_in}, which registers it" if self.implemented_in else ""
            raise LookupError(f"{self.kind} {name!r} is declared in {HERE} but has no implementation "
                              f"registered{where}.")
        return self._impl[name]

    def implemented(self) -> tuple[str, ...]:
        """The accepted names that have an implementation."""
        return tuple(n for n in self.names if n in self._impl)


def _site(obj) -> tuple | None:
    """What makes two objects the same definition: the file and qualified name of a function or class
    (a module run twice defines new objects at the same place), an algorithm's by its build function's;
    None for other objects."""
    obj = obj.build if isinstance(obj, AlgorithmDecl) else obj
    try:
        return inspect.getsourcefile(obj), obj.__qualname__
    except (TypeError, AttributeError):
        return None


def pluggable() -> tuple[Registry, ...]:
    """Every registry that takes the user's own names (``pluggable``), in declaration order."""
    return tuple(r for r in globals().values() if isinstance(r, Registry) and r.pluggable)


# --------------------------------------------------------------------------- algorithms
# The pluggable ones take names of the user's own too (runtime_args.plugins; chatlearn.plugins states each contract).
# models.policy_trainer.advantage_estimator (chatlearn.algorithms.advantages.compute_advantages)
ADVANTAGE_ESTIMATORS = Registry("advantage estimator", ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "gae"),
                                declared_as="ADVANTAGE_ESTIMATORS", implemented_in="chatlearn.algorithms.advantages",
                                pluggable=True)
# those whose every advantage is 0 with one sample per prompt (models.policy.num_inference_per_prompt 1):
# refused then by chatlearn.config.algorithm_keys (reinforce_plus_plus and gae learn without groups)
GROUP_BASELINE_ESTIMATORS = ("grpo", "dr_grpo", "rloo")
# models.policy_trainer.kl_estimator (chatlearn.algorithms.kl.kl_penalty)
KL_ESTIMATORS = Registry("KL estimator", ("k1", "k2", "k3", "low_var_kl"),
                         declared_as="KL_ESTIMATORS", implemented_in="chatlearn.algorithms.kl", pluggable=True)
# models.policy_trainer.policy_loss (chatlearn.algorithms.grpo.grpo_token_losses): PPO's clipped surrogate with the
# token ratio (vanilla) or GSPO's sequence ratio (gspo); null resolves to gspo with use_group_sequence_policy
POLICY_LOSSES = Registry("policy loss", ("vanilla", "gspo"), declared_as="POLICY_LOSSES",
                         implemented_in="chatlearn.algorithms.grpo", pluggable=True)
# models.policy_trainer.loss_agg_mode (chatlearn.algorithms.grpo.sample_loss_coefficients)
LOSS_AGG_MODES = Registry("loss_agg_mode", ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                                            "seq-mean-token-sum-norm"),
                          declared_as="LOSS_AGG_MODES", implemented_in="chatlearn.algorithms.grpo")
# models.policy_trainer.optimizer.lr_decay_style (chatlearn.algorithms.lr_schedule.learning_rate)
LR_DECAY_STYLES = Registry("lr_decay_style", ("constant", "linear", "cosine"),
                           declared_as="LR_DECAY_STYLES", implemented_in="chatlearn.algorithms.lr_schedule")

# the registries of the algorithms' parts (tests/config/test_registry.py: each declared name is implemented)
ALGORITHM_PARTS = (ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, LOSS_AGG_MODES, LR_DECAY_STYLES)


@dataclass(frozen=True)
class AlgorithmDecl:
    """What an algorithm is to validation and the plan (chatlearn/config/algorithms.py reads it)."""

    name: str
    # the kinds of model it needs beside the rollout engine, the policy trainer, the reference (with a KL
    # term) and the reward (chatlearn/config/kinds.py), e.g. ("critic",)
    needs: tuple[str, ...]
    # the advantage estimators it claims as its own (its first is its default); None: any estimator that no
    # other algorithm claims (the group-relative ones, and those a plugin registers)
    estimators: tuple[str, ...] | None
    # what builds the driver's Algorithm, called (cfg, plan, calls, steps): a "module:function" string (the
    # built-ins, imported in the driver only) or, from a plugin, the function
    build: object
    doc: str  # one line: what it is


# models.policy_trainer.algorithm (chatlearn.runtime.driver.algorithm composes the built-ins); a plugin adds one
# with chatlearn.plugins.register_algorithm
ALGORITHMS = Registry("algorithm", {
    "grpo": AlgorithmDecl("grpo", (), None, "chatlearn.runtime.driver.algorithm:grpo",
                          "group-relative policy optimization and its family (Dr. GRPO, RLOO, REINFORCE++, DAPO, GSPO)"),
    "ppo": AlgorithmDecl("ppo", ("critic",), ("gae",), "chatlearn.runtime.driver.algorithm:ppo",
                         "PPO with a critic (models.critic) and GAE advantages"),
    "opd": AlgorithmDecl("opd", ("teacher",), None, "chatlearn.runtime.driver.algorithm:opd",
                         "on-policy distillation from a model of kind teacher: per-token reverse-KL advantages "
                         "(distill_coef) beside the task reward's group advantages"),
    "gkd": AlgorithmDecl("gkd", ("teacher",), None, "chatlearn.runtime.driver.algorithm:gkd",
                         "generalized knowledge distillation (TRL's GKD) on the student's samples: the generalized "
                         "JSD (gkd_beta, gkd_temperature) to the teacher's top-k (distill_topk) or full distribution"),
}, declared_as="ALGORITHMS", pluggable=True)

# --------------------------------------------------------------------------- backends
# runtime_args.train_backend / rollout_backend: the worker class each builds, as "module:Class"
TRAIN_BACKENDS = Registry("train backend", {
    "fsdp": "chatlearn.models.trainer.fsdp:FSDPTrainer",
    "megatron": "chatlearn.models.trainer.megatron:MegatronTrainer",
}, declared_as="TRAIN_BACKENDS")
ROLLOUT_BACKENDS = Registry("rollout backend", {
    "vllm": "chatlearn.models.rollout.vllm:VLLMRollout",
    "sglang": "chatlearn.models.rollout.sglang:SGLangRollout",
    "hf": "chatlearn.models.rollout.hf:HFRollout",
}, declared_as="ROLLOUT_BACKENDS")
# the reward workers' class (models.reward: no choice of backend)
REWARD_BACKEND = "chatlearn.models.reward.functions:RewardManager"
# the reward model's class (models.reward.load: a sequence-classification model, FSDP2 inference)
REWARD_MODEL_BACKEND = "chatlearn.models.reward.model:RewardModel"
# an LLM judge's class (a model of kind judge: a causal LM on a rollout engine)
JUDGE_BACKEND = "chatlearn.models.reward.judge:JudgeModel"


def backend_factories() -> dict[str, str]:
    """``{backend name: "module:Class"}`` of every worker backend, ``"reward"`` included."""
    return {**{n: TRAIN_BACKENDS.get(n) for n in TRAIN_BACKENDS},
            **{n: ROLLOUT_BACKENDS.get(n) for n in ROLLOUT_BACKENDS}, "reward": REWARD_BACKEND,
            "reward_model": REWARD_MODEL_BACKEND, "judge": JUDGE_BACKEND}


# --------------------------------------------------------------------------- reward functions
# models.reward.functions[i].path values that name a built-in function, and the function
BUILTIN_REWARDS = Registry("built-in reward function", {
    "builtin:math": "chatlearn.models.reward.math_reward:math_reward",
}, declared_as="BUILTIN_REWARDS")

# --------------------------------------------------------------------------- multi-turn rollouts
# models.policy.multi_turn.environment values that name a built-in environment, and its class
BUILTIN_ENVIRONMENTS = Registry("built-in environment", {
    "builtin:tools": "chatlearn.env.tools:ToolEnvironment",
}, declared_as="BUILTIN_ENVIRONMENTS")
# models.policy.multi_turn.tools[i].path values that name a built-in tool, and the function
BUILTIN_TOOLS = Registry("built-in tool", {
    "builtin:calculator": "chatlearn.env.calculator:calculator",
}, declared_as="BUILTIN_TOOLS")
# models.policy.multi_turn.tool_parser values that name a built-in parser of the model's tool calls
TOOL_PARSERS = Registry("tool-call parser", {
    "hermes": "chatlearn.env.tools:parse_hermes",
}, declared_as="TOOL_PARSERS")
