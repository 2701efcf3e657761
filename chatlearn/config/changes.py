"""What a resumed run may change of the config its checkpoint was trained with.

Every checkpoint records the resolved config it was trained with (``checkpoints/episode_N/config.yaml``,
secrets shown as ``***``). A run that resumes compares its own resolved config with it, key by key
(dotted keys; a list is one value): :func:`config_changes`. A difference is *harmless* when its key
matches :data:`HARMLESS_KEYS`, an explicit allow-list of keys that change how long the run goes on,
what it evaluates, where and how it logs and saves, its timeouts, and memory settings that do not
change what is computed. Any other difference alters training (the optimizer, the learning-rate
schedule, the models loaded, the data, group and batch sizes, the algorithm's keys, the seeds, the
sampling parameters...) and the resume is refused unless the user accepts it on purpose
(``chatlearn run --accept-config-changes``, see :mod:`chatlearn.runtime.rundir.config_history`).
A key this file does not know is never harmless.

Two keys are harmless only where they leave the math as it was:

* ``runtime_args.num_episode``: unless a trained model's learning-rate schedule is measured in the
  run's optimizer steps (``lr_decay_style`` other than constant with ``lr_decay_iters`` null, or a
  warmup given as ``lr_warmup_fraction``): more episodes would then stretch the schedule;
* ``train_micro_batch_size`` (of ``runtime_args`` and of a model): harmless always, since the
  losses are aggregated over the whole optimizer step's samples whatever the micro-batches
  (``chatlearn.algorithms.grpo.sample_loss_coefficients``): a micro-batch of another size changes
  the memory used and float rounding, not the update.

A key the checkpoint's config lacks (written by an older chatlearn) whose new value is its default
counts as no change.
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass

from chatlearn.config.algorithms import uses_kind
from chatlearn.config.schema import COMPAT_ONLY_KEYS

# the checkpoint's config lacks the key, or the new config does
ABSENT = "<absent>"
ESTIMATOR = "models.policy_trainer.advantage_estimator"
ALGORITHM = "models.policy_trainer.algorithm"

# Keys whose change leaves what training computes as it was. ``*`` matches any part of a key.
HARMLESS_KEYS = (
    # how long the run goes on (see the module docstring)
    "runtime_args.num_episode",
    # checkpoints and resume
    "runtime_args.save_episode_interval", "runtime_args.keep_last_checkpoints",
    "runtime_args.enable_resume_training", "models.*.save_hf",
    # evaluation
    "runtime_args.eval_episode_interval", "runtime_args.enable_eval_before_training", "runtime_args.eval_data_path",
    "runtime_args.eval_data_subset", "runtime_args.eval_data_split", "models.policy.eval_*",
    # output, logging, W&B, TensorBoard, console, profiling
    "runtime_args.output_dir", "runtime_args.exp_name", "runtime_args.log_args_dict.*", "runtime_args.debug",
    "models.policy.logprob_mismatch_warn", "runtime_args.weight_push_check", "runtime_args.weight_push_check_tolerance",
    "runtime_args.max_constant_reward_episodes",  # a warning's threshold
    # timeouts
    "runtime_args.ray_connect_timeout_s", "runtime_args.stage_timeout_s", "models.reward.timeout_s",
    "models.policy.multi_turn.step_timeout_s",
    # memory: where the parts of a model live between stages, how the micro-batches are cut
    "models.*.free_gpu_memory.*", "runtime_args.offload_without_gpu", "models.*.use_expandable_segments",
    "models.*.gradient_checkpointing", "models.*.recompute_granularity", "runtime_args.train_micro_batch_size", "models.*.train_micro_batch_size",
    "models.*.packing", "models.*.max_token_in_packing",
    # how the weight push carries LoRA's update (the adapters or the merged weights: the same rollout weights)
    "models.policy_trainer.lora.push",
)


@dataclass(frozen=True)
class Change:
    """One key whose value differs between the checkpoint's config (``old``) and the new one."""

    key: str
    old: object
    new: object
    harmless: bool

    def line(self) -> str:
        return f"{self.key}: {show(self.old)} -> {show(self.new)}"


def show(value) -> str:
    """A value as it reads in the diff: YAML-like scalars, JSON for lists and dicts."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value == ABSENT else repr(value)
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def flatten(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and empty dicts are values."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def config_changes(old: dict, new: dict, non_default: set[str]) -> list[Change]:
    """The differences between the checkpoint's config ``old`` and the new ``new`` (plain nested
    containers, secrets masked alike), each classified; ``non_default``: the dotted keys of ``new``
    whose value is not the schema's default (a key ``old`` lacks at its default is no change). The
    critic's keys count only where one of the configs trains a critic (PPO)."""
    before, after = flatten(old), flatten(new)
    # models.critic exists only for an algorithm with a critic (PPO); its keys follow the policy trainer's otherwise
    unused = () if _trains_critic(old) or _trains_critic(new) else ("models.critic.",)
    changes = []
    for key in sorted(set(before) | set(after)):
        was, now = before.get(key, ABSENT), after.get(key, ABSENT)
        if was == now or was == ABSENT and key not in non_default or key.startswith(unused):
            continue
        changes.append(Change(key, was, now, is_harmless(key, old, new)))
    return changes


def is_harmless(key: str, old: dict, new: dict) -> bool:
    """Whether a change of ``key`` between the configs ``old`` and ``new`` leaves training as it was."""
    if key in COMPAT_ONLY_KEYS:  # accepted for compatibility, acting on nothing
        return True
    if not any(fnmatch.fnmatchcase(key, pattern) for pattern in HARMLESS_KEYS):
        return False
    if key == "runtime_args.num_episode":
        return not (schedule_follows_num_episode(old) or schedule_follows_num_episode(new))
    return True


def schedule_follows_num_episode(tree: dict) -> bool:
    """Whether a trained model's learning-rate schedule in the config ``tree`` is measured in the run's
    optimizer steps (num_episode x steps per episode): a decay without ``lr_decay_iters``, or a warmup
    given as a fraction. A key the config lacks counts as not set."""
    trained = ["policy_trainer"] + (["critic"] if _trains_critic(tree) else [])
    for name in trained:
        opt = f"models.{name}.optimizer."
        if _at(tree, opt + "lr_decay_style") not in (None, "constant") and _at(tree, opt + "lr_decay_iters") is None:
            return True
        if not _at(tree, opt + "lr_warmup_iters") and _at(tree, opt + "lr_warmup_fraction"):
            return True
    return False


def _trains_critic(tree: dict) -> bool:
    """Whether the algorithm of config ``tree`` trains a critic (as written; an older config has no algorithm key)."""
    return uses_kind(_at(tree, ALGORITHM), _at(tree, ESTIMATOR), "critic")


def _at(tree: dict, dotted: str):
    """The value at the dotted key of the nested dict ``tree``; None where a part is missing."""
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
