"""The kinds of model a run can hold, each declared once.

A *kind* says what a model of that kind is to the engine: the parts it holds on its devices, the
stage it runs, the batch columns it writes, whether it trains and where its state goes in a
checkpoint, the backend family its workers build, how the console names it, and how many models
of the kind a run may have. The plan, ``--dry-run``, the residency scheduler, checkpoint and
resume, the cluster, the watchdog and the preflight checks ask :func:`kind_of` (or the plan's
``kinds``) and read these declarations; none of them lists model names.

A *model* is a section ``models.<name>`` of the config. Today's names are the defaults, each of a
fixed kind (:data:`DEFAULT_MODELS`): ``policy`` (rollout), ``policy_trainer`` (trainer),
``ref_policy`` (reference), ``critic`` (critic) and ``reward`` (the reward functions' CPU workers).
``models.reward.load`` adds the reward model ``reward_model`` of kind ``reward_model``, configured by
``models.reward``'s ``model_*`` keys and named ``reward`` in ``runtime_args.colocation`` (as in
ChatLearn's configs). Any other section names a model of its own and says its ``kind``; only kinds
with a :attr:`Kind.schema` allow that (``reward_model``: ``models.rm_math: {kind:
reward_model, load: ..., weight: 0.5}``; ``teacher``: ``models.teacher: {kind: teacher, load: ...}``, one per
run and no default model), and a kind with ``max_count`` 1 allows its default model alone.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

from chatlearn.config.names import Part, Stage
from chatlearn.config.schema import Judge, RewardModel, Teacher
from chatlearn.errors import ConfigError


@dataclass(frozen=True)
class Kind:
    name: str
    label: str  # how the console, the plan and the plots name a model of this kind
    parts: tuple[Part, ...]  # what it holds on its devices and moves off and back; () on CPUs only
    stage: Stage | None  # the stage its turn is timed as
    columns: tuple[str, ...]  # the batch columns it writes (chatlearn/batch.py declares them)
    trains: bool  # it has an optimizer and steps (its state goes into every checkpoint)
    checkpoint_folder: str | None  # the folder of its sharded state inside a checkpoint; None: no state
    backend: str  # the backend family its workers build: rollout | train | reward_model | reward
    worker: str  # the worker environment's role (chatlearn.runtime.cluster.worker_env): rollout | trainer | reward
    distributed: bool  # its ranks form a torch.distributed group
    build_rank: int  # models are built in this order (the rollout engine last: it sizes its cache from what is left)
    default_model: str | None  # the name of this kind's model in today's configs
    max_count: int | None = 1  # models of this kind a run may have (None: any number)
    schema: type | None = None  # the section of a model named by the user (None: only the default name)
    role: str | None = None  # on the training backend: what the trainer builds (TrainerSpec.role)
    own_deadline: bool = False  # its calls have a time limit of their own (the watchdog leaves them be)
    # it runs elsewhere (an HTTP endpoint): no devices, no processes, no turns; the driver calls it. Such a model
    # is in the plan's kinds but has no placement
    served: bool = False

    @property
    def on_devices(self) -> bool:
        return bool(self.parts)


ROLLOUT = Kind("rollout", "rollout engine", (Part.WEIGHTS, Part.KV_CACHE), Stage.GENERATE,
               ("tokens", "offsets", "prompt_lens", "rollout_logprobs", "finish_reasons", "routed_experts"),
               trains=False,
               checkpoint_folder=None, backend="rollout", worker="rollout", distributed=False, build_rank=5,
               default_model="policy")
TRAINER = Kind("trainer", "policy trainer", (Part.WEIGHTS, Part.OPTIMIZER, Part.GRADS), Stage.OLD_LOGPROBS,
               ("old_logprobs",), trains=True, checkpoint_folder="trainer", backend="train", worker="trainer",
               distributed=True, build_rank=0, default_model="policy_trainer", role="policy")
REFERENCE = Kind("reference", "reference model", (Part.WEIGHTS,), Stage.REF_LOGPROBS, ("ref_logprobs",),
                 trains=False, checkpoint_folder=None, backend="train", worker="trainer", distributed=True,
                 build_rank=2, default_model="ref_policy", role="reference")
CRITIC = Kind("critic", "critic", (Part.WEIGHTS, Part.OPTIMIZER, Part.GRADS), Stage.VALUES, ("values",),
              trains=True, checkpoint_folder="critic", backend="train", worker="trainer", distributed=True,
              build_rank=1, default_model="critic", role="critic")
REWARD_MODEL = Kind("reward_model", "reward model", (Part.WEIGHTS,), Stage.REWARD_MODEL, ("reward_model_scores",),
                    trains=False, checkpoint_folder=None, backend="reward_model", worker="trainer", distributed=True,
                    build_rank=3, default_model="reward_model", max_count=None, schema=RewardModel)
# an LLM judge: a causal LM on a rollout backend (chatlearn/models/reward/judge.py); its verdicts join the reward.
# Built after the reward workers, before the policy's rollout engine (which sizes its cache from what is left)
JUDGE = Kind("judge", "judge", (Part.WEIGHTS, Part.KV_CACHE), Stage.JUDGE, (), trains=False, checkpoint_folder=None,
             backend="judge", worker="rollout", distributed=False, build_rank=4.5, default_model=None, max_count=None,
             schema=Judge)
# a judge served over HTTP (models.<name>: {kind: judge, endpoint: ...}): of kind judge to the user, with no devices
# (chatlearn/models/reward/served_judge.py, called from the driver; its requests have their own time limits)
SERVED_JUDGE = dataclasses.replace(JUDGE, label="served judge", parts=(), backend="served_judge", worker="reward",
                                   own_deadline=True, served=True)
# a distillation teacher (models.<name>: {kind: teacher, ...}): the training backend's inference path, as the
# reference; built first (frozen weights alone: it leaves the devices before the others are built)
TEACHER = Kind("teacher", "teacher", (Part.WEIGHTS,), Stage.TEACHER_LOGPROBS,
               ("teacher_logprobs", "teacher_top1", "teacher_topk_logprobs", "teacher_topk_ids"),
               trains=False, checkpoint_folder=None, backend="train", worker="trainer", distributed=True,
               build_rank=-1, default_model=None, max_count=1, schema=Teacher, role="teacher")
REWARD = Kind("reward", "reward functions", (), Stage.REWARD, (), trains=False, checkpoint_folder=None,
              backend="reward", worker="reward", distributed=False, build_rank=4, default_model="reward",
              own_deadline=True)

KINDS: dict[str, Kind] = {k.name: k for k in (ROLLOUT, TRAINER, REFERENCE, CRITIC, REWARD_MODEL, JUDGE, TEACHER,
                                               REWARD)}
# the models of today's configs and the kind of each (models.reward.load adds reward_model)
DEFAULT_MODELS: dict[str, Kind] = {"policy": ROLLOUT, "policy_trainer": TRAINER, "ref_policy": REFERENCE,
                                   "critic": CRITIC, "reward": REWARD}
# the config section of a placed model whose name is not its section's: the reward model of models.reward.load
SECTIONS = {"reward_model": "reward"}


def section(name: str) -> str:
    """The ``models.<section>`` of model ``name``."""
    return SECTIONS.get(name, name)


@dataclass(frozen=True)
class RewardModelSettings:
    """What the driver and the worker read of a reward model, whichever section spells it (``models.reward``'s
    ``model_*`` keys for ``reward_model``, a section of kind reward_model otherwise)."""

    name: str
    key: str  # its section, dotted: models.reward or models.<name>
    load: str
    trust_remote_code: bool
    seed: int
    num_gpu: int
    weight: float
    normalize: str
    micro_batch_size: int
    bf16: bool | None
    weight_key: str  # the dotted key of its weight (for messages)


def reward_model_settings(cfg, name: str) -> RewardModelSettings:
    """The settings of reward model ``name``."""
    if name == REWARD_MODEL.default_model:
        r = cfg.models.reward
        return RewardModelSettings(name, "models.reward", r.load, r.trust_remote_code, r.seed, r.num_gpu,
                                   r.model_weight, r.model_normalize, r.model_micro_batch_size,
                                   r.bf16, "models.reward.model_weight")
    r = cfg.models[name]
    return RewardModelSettings(name, f"models.{name}", r.load, r.trust_remote_code, r.seed, r.num_gpu,
                               r.weight, r.normalize, r.micro_batch_size, r.bf16,
                               f"models.{name}.weight")


def kind_named(kind: str, key: str) -> Kind:
    """The kind called ``kind``; a ConfigError at ``key`` with the known kinds (and the nearest) otherwise."""
    if kind in KINDS:
        return KINDS[kind]
    guess = difflib.get_close_matches(str(kind), list(KINDS), n=1)
    hint = f" Did you mean {guess[0]!r}?" if guess else ""
    named = ", ".join(k.name for k in KINDS.values() if k.schema is not None)
    raise ConfigError(f"{kind!r} is not a kind of model; the kinds are {', '.join(KINDS)}.{hint} A model of your "
                      f"own naming may be of kind {named}.", key=key)


def user_models(models) -> dict[str, Kind]:
    """The models the user named beside the defaults (``models.<name>`` with a ``kind``), in config order; a judge
    with an ``endpoint`` is a :data:`SERVED_JUDGE`."""
    found = {str(name): KINDS[str(models[name].kind)] for name in models if name not in DEFAULT_MODELS}
    return {name: SERVED_JUDGE if kind is JUDGE and models[name].endpoint is not None else kind
            for name, kind in found.items()}


def model_kinds(cfg) -> dict[str, Kind]:
    """Every model the config declares and the kind of each (whether the run uses it or not: an unused
    reference or critic is left out by the plan): the defaults, ``reward_model`` with
    ``models.reward.load``, then the models the user named."""
    found = dict(DEFAULT_MODELS)
    if cfg.models.reward.load is not None:
        found["reward_model"] = REWARD_MODEL
    found.update(user_models(cfg.models))
    return found


def kind_of(cfg, name: str) -> Kind:
    """The kind of model ``name`` of ``cfg``."""
    return model_kinds(cfg)[name]


def models_of(cfg, kind: Kind) -> list[str]:
    """The models of ``kind`` that ``cfg`` declares, in config order (by the kind's name: a served judge is a judge)."""
    return [name for name, k in model_kinds(cfg).items() if k.name == kind.name]


def check_kinds(cfg) -> None:
    """Each default model keeps its kind; each model the user named has a kind that allows models of the
    user's naming, and no kind has more models than it allows."""
    for name, kind in DEFAULT_MODELS.items():
        declared = cfg.models[name].kind
        if declared != kind.name:
            raise ConfigError(f"is {declared!r}, but models.{name} is the run's {kind.label} (kind {kind.name}): "
                              f"its kind is fixed. Remove the key, or name a new model for a model of kind "
                              f"{declared} (e.g. models.my_{declared}: {{kind: {declared}, ...}}).",
                              key=f"models.{name}.kind")
    if cfg.models.reward.load is not None and REWARD_MODEL.default_model in user_models(cfg.models):
        raise ConfigError(f"names the reward model that models.reward.load starts ({REWARD_MODEL.default_model}). "
                          "Give your model another name, or move its keys to models.reward.",
                          key=f"models.{REWARD_MODEL.default_model}")
    counts: dict[str, list[str]] = {}
    for name, kind in model_kinds(cfg).items():
        counts.setdefault(kind.name, []).append(name)
    for kind_name, names in counts.items():
        kind = KINDS[kind_name]
        if kind.max_count is not None and len(names) > kind.max_count:
            extra = [n for n in names if n not in DEFAULT_MODELS][-1 if kind.default_model is None else 0]
            keep = kind.default_model or names[0]
            raise ConfigError(f"is a second model of kind {kind.name} ({', '.join(names)}): a run has one "
                              f"{kind.label}. Remove models.{extra}, or configure models.{keep}.",
                              key=f"models.{extra}.kind")
