"""An RL algorithm as the episode engine runs it.

The engine (:mod:`chatlearn.runtime.driver.engine`) runs every episode through the same stages and
knows no algorithm by name: generate, reward, the forward passes that add per-token columns to the
batch, advantages, the training of each trained model, checkpoint, weight push. What differs
between algorithms is what an :class:`Algorithm` declares:

- ``passes()``: the forward passes before the advantages, in the order they run (:class:`Pass`: the
  stage, the model, the batch column it writes and how it computes it);
- ``advantages(batch, scored)``: the per-sample columns the losses read (``advantages``,
  ``sample_weights``), from the rewards and the passes' columns;
- ``trained``: the models trained each episode, in order, and ``train(model, ...)``: one model's
  optimizer steps over the episode's batch (:class:`StepLoop` runs the steps);
- ``replay_columns``: what an earlier episode's samples keep to be trained on again.

An algorithm is composed of parts (:class:`ComposedAlgorithm`): the policy's update
(:class:`PolicyUpdate`: the reference and old-log-prob passes, the policy's optimizer steps), an
advantage estimate (:class:`GroupAdvantages`, :class:`GAEAdvantages`) and, for an actor-critic
method, the critic's update (:class:`CriticUpdate`). :func:`grpo` and :func:`ppo` compose the two
built-in algorithms; ``models.policy_trainer.algorithm`` names one, and its declaration
(:mod:`chatlearn.config.algorithms`) says which function builds it.
"""
from __future__ import annotations

import abc
import collections
import importlib
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from chatlearn.algorithms.advantages import ROLLOUT_MISMATCH, episode_advantages, token_kl
from chatlearn.algorithms.distill import distill_metrics, distill_token_advantages
from chatlearn.algorithms.gae import episode_gae
from chatlearn.algorithms.gkd_lambda import on_policy
from chatlearn.batch import columns, select_samples
from chatlearn.calls import put
from chatlearn.checkpoint.manager import CheckpointManager
from chatlearn.config.kinds import TEACHER
from chatlearn.config.registry import ALGORITHMS
from chatlearn.config.names import Part, Stage
from chatlearn.config.plan import Plan
from chatlearn.errors import UserError
from chatlearn.logging.console import warn
from chatlearn.runtime.driver.sampling import Scored
from chatlearn.runtime.driver.scheduler import Scheduler

# what a forward pass reads of a batch: the sequences, which of their tokens are the model's
# (loss_mask: only in multi-turn batches) and the experts the rollout routed them to (routed_experts: only
# with routing_replay: rollout; every trainer forward of the samples replays them, chatlearn/models/moe)
SEQUENCE_COLUMNS = ("tokens", "prompt_lens", "loss_mask", "routed_experts", "images")

# step metrics that are the largest over an episode's steps, not their mean
STEP_MAXIMA = ("is_weight_max",)


@dataclass(frozen=True)
class Pass:
    """A forward pass before the advantages: ``model`` writes the batch column ``column`` as stage
    ``stage``; ``compute(batch)`` returns it (making the model resident first). ``timed``: whether
    it runs a model (one that only fills or copies a column is no stage and is not timed)."""

    stage: Stage
    model: str
    column: str
    compute: Callable[[dict], np.ndarray]
    timed: bool = True


@dataclass
class Trained:
    """One trained model's optimizer steps of an episode: its ``train/`` metrics, and the values the
    first step set aside (what its own forward measured before any update)."""

    metrics: dict
    first_step: dict = field(default_factory=dict)


class ModelCalls:
    """The calls an algorithm makes on the run's models: each makes its model resident first
    (``sched.ensure``) and takes log-probs at ``temperature`` (the sampling distribution's)."""

    def __init__(self, sched: Scheduler, temperature: float):
        self.sched, self.temperature = sched, temperature

    def group(self, model: str):
        return self.sched.groups[model]

    def logprobs(self, model: str, batch: dict) -> np.ndarray:
        """Per-token log-probs of the batch's tokens under ``model`` (its weights made resident)."""
        self.sched.ensure(model, [Part.WEIGHTS])
        outs, _ = self.group(model).call("compute_logprobs", put(columns(batch, SEQUENCE_COLUMNS)),
                                         self.temperature)
        return outs[0]

    def base_logprobs(self, batch: dict) -> np.ndarray:
        """The reference log-probs from the policy trainer with its adapters disabled (LoRA: the base
        weights are the reference; ``plan.ref_from_trainer``)."""
        self.sched.ensure("policy_trainer", [Part.WEIGHTS])
        outs, _ = self.group("policy_trainer").call("ref_logprobs", put(columns(batch, SEQUENCE_COLUMNS)),
                                                    self.temperature)
        return outs[0]

    def teacher(self, model: str, batch: dict, topk: int = 0, temperature: float | None = None) -> np.ndarray:
        """The teacher ``model``'s log-probs of the batch's tokens (its weights made resident), float32 [T], at
        ``temperature`` (None: the sampling one); its agreement with the sampled tokens goes into
        ``batch["teacher_top1"]`` (the same forward) and, with ``topk`` (> 0, or -1: the vocabulary), its most
        likely tokens into ``teacher_topk_logprobs`` / ``teacher_topk_ids``."""
        self.sched.ensure(model, [Part.WEIGHTS])
        outs, _ = self.group(model).call("teacher_logprobs", put(columns(batch, SEQUENCE_COLUMNS)),
                                         self.temperature if temperature is None else temperature, topk)
        for name in ("teacher_top1", "teacher_topk_logprobs", "teacher_topk_ids"):
            if name in outs[0]:
                batch[name] = outs[0][name]
        return outs[0]["teacher_logprobs"]

    def values(self, model: str, batch: dict) -> np.ndarray:
        """Per-token values of the batch's response tokens under the critic ``model`` (its weights made
        resident): float32 [T], 0 at the prompt's and the observations' tokens."""
        self.sched.ensure(model, [Part.WEIGHTS])
        outs, _ = self.group(model).call("compute_values", put(columns(batch, SEQUENCE_COLUMNS)))
        return outs[0]


class StepLoop:
    """A trained model's optimizer steps over an episode's batch: ``samples_per_step`` samples a step,
    ``num_training_epoch`` times over; the means of the steps' metrics (``train/<metric>``, the maxima
    of :data:`STEP_MAXIMA`) and ``train/skipped_steps``: the steps the trainer skipped because their
    loss or gradient norm was not finite (left out of the means). ``optimizer.max_nonfinite_steps``
    skipped steps in a row (across episodes) stop the run with a UserError."""

    def __init__(self, cfg, plan: Plan, calls: ModelCalls, progress):
        self.cfg, self.plan, self.calls, self.progress = cfg, plan, calls, progress
        self.nonfinite_in_a_row: dict[str, int] = collections.defaultdict(int)

    def run(self, model: str, batch: dict, episode: int, step_columns: Callable[[int], tuple],
            aside: tuple = (), prefix: str = "train/") -> Trained:
        """``step_columns(s)``: the columns the step that starts at sample ``s`` reads; ``aside``: step
        outputs that are no means, popped from every step and kept from the first; ``prefix``: of the
        metric names (``train/`` for the policy, ``train/critic/`` for the critic)."""
        per_step, epochs = self.plan.samples_per_step, self.cfg.runtime_args.num_training_epoch
        samples = len(batch["prompt_lens"])  # with replay, earlier episodes' samples too
        total = samples // per_step * epochs
        sums: dict[str, float] = collections.defaultdict(float)
        steps = skipped = 0
        first: dict = {}
        for _ in range(epochs):
            for s in range(0, samples, per_step):
                sub = select_samples(columns(batch, step_columns(s)), range(s, s + per_step))
                self.progress.stage(Stage.TRAIN, f"step {steps + 1}/{total}")
                outs, _ = self.calls.group(model).call("train", put(sub), self.calls.temperature)
                step = dict(outs[0])
                kept = {k: step.pop(k) for k in aside if k in step}
                if steps == 0:
                    first = kept
                steps += 1
                if self.nonfinite(model, step, episode, steps):
                    skipped += 1
                    continue
                for k, v in step.items():
                    sums[k] = max(sums[k], float(v)) if k in STEP_MAXIMA else sums[k] + float(v)
        means = {k: v if k in STEP_MAXIMA else v / (steps - skipped) for k, v in sums.items()}
        means["skipped_steps"] = float(skipped)
        return Trained({f"{prefix}{k}": v for k, v in means.items()}, first)

    def last_good_checkpoint(self) -> str:
        """Where a rerun resumes from, in words: the checkpoint ``checkpoints/latest`` names (the newest
        complete one), or that none was saved yet."""
        root = os.path.join(self.cfg.runtime_args.output_dir, "checkpoints")
        try:
            found = CheckpointManager(root, keep=0).latest()
        except UserError:  # an unreadable pointer: the newest complete folder is not known
            found = None
        if found is None:
            return (f"no checkpoint was saved yet (none in {root}), so a rerun starts over (with --no-resume "
                    "or --overwrite if metrics were written)")
        episode, path = found
        return f"a rerun resumes from the last checkpoint saved, {path} (episode {episode})"

    def nonfinite(self, model: str, step: dict, episode: int, index: int) -> bool:
        """Whether the trainer skipped this step (``skipped_steps``: its loss or gradient norm was not
        finite); warns, counts the skipped steps in a row, and stops the run when they reach
        ``models.<model>.optimizer.max_nonfinite_steps``."""
        key = f"models.{model}.optimizer.max_nonfinite_steps"
        limit = getattr(self.cfg.models, model).optimizer.max_nonfinite_steps
        where = (f"{'' if model == 'policy_trainer' else model + ': '}episode {episode}, optimizer step "
                 f"{index}/{self.plan.steps_per_episode}")
        if not step["skipped_steps"]:
            self.nonfinite_in_a_row[model] = 0
            return False
        self.nonfinite_in_a_row[model] += 1
        in_a_row = self.nonfinite_in_a_row[model]
        values = f"loss {step['loss']}, gradient norm {step['grad_norm']}"
        if in_a_row >= limit:
            raise UserError(
                f"training diverged: the loss or the gradient norm was not finite in {in_a_row} "
                f"optimizer steps in a row (the last: {where}; {values}), so the run stops "
                f"({key}: {limit}). The skipped steps changed no "
                f"weight, so no checkpoint holds their gradients; {self.last_good_checkpoint()}. Lower "
                f"models.{model}.optimizer.lr, look for extreme rewards or data, or raise "
                "max_nonfinite_steps to ride out rarer ones.")
        warn(f"{where}: {values}: not finite, so the step was skipped (weights, optimizer "
             f"state and learning-rate schedule unchanged); {in_a_row} skipped in a row, the run "
             f"stops at {limit} ({key})")
        return True


class Algorithm(abc.ABC):
    """What the episode engine needs of an algorithm (see the module docstring)."""

    trained: tuple[str, ...]
    replay_columns: tuple[str, ...]

    def trains(self, episode: int) -> tuple[str, ...]:
        """The models episode ``episode`` trains, in order (every one of ``trained`` unless a warm-up
        leaves some out); the weight push follows only an episode that trains the policy."""
        return self.trained

    def data_responses(self, episode: int) -> bool:
        """Whether episode ``episode`` trains on the data's reference responses instead of sampling (``algorithm: gkd``
        with ``gkd_lambda`` < 1); no other algorithm does."""
        return False

    @abc.abstractmethod
    def passes(self) -> list[Pass]:
        """The forward passes before the advantages, in the order they run."""

    @abc.abstractmethod
    def advantages(self, batch: dict, scored: Scored) -> dict:
        """Write the columns the losses read from the rewards; return their ``train/`` metrics."""

    @abc.abstractmethod
    def train(self, model: str, batch: dict, episode: int) -> Trained:
        """One trained model's optimizer steps over ``batch`` (the episode's samples after the
        replayed ones)."""


class PolicyUpdate:
    """The policy's part of an algorithm: the reference pass (with a KL term), the old-log-prob pass and
    the policy's optimizer steps under the clipped loss of ``models.policy_trainer`` (KL, entropy,
    rollout correction). ``advantage_column``: the column its loss reads as the advantages (``advantages``
    per sample, ``token_advantages`` per token)."""

    model = "policy_trainer"

    def __init__(self, cfg, plan: Plan, calls: ModelCalls, steps: StepLoop, advantage_column: str):
        self.cfg, self.plan, self.calls, self.steps = cfg, plan, calls, steps
        self.advantage_column = advantage_column
        # the loss reads the rollout engine's log-probs at every step: they are its old log-probs
        # (old_logprobs: rollout) or the behaviour log-probs of a rollout correction
        self.reads_rollout_logprobs = plan.old_from_rollout or plan.rollout_correction != "none"
        # and the first step reads them to report the mismatch where its own forward gives its old
        # log-probs (old_logprob_pass_from > 0: never with replay, so no replayed episode keeps them)
        self.replay_columns = (*SEQUENCE_COLUMNS, "old_logprobs", "ref_logprobs", "sample_weights",
                               *(("rollout_logprobs",) if self.reads_rollout_logprobs or plan.old_logprob_pass_from
                                 else ()))

    def passes(self) -> list[Pass]:
        """The reference log-probs (with a KL term), then the old log-probs: the reference goes first,
        so that the trainer, once resident for its old log-probs, stays to train."""
        # (LoRA: the policy trainer with its adapters disabled gives them, plan.ref_from_trainer)
        model, compute = ((self.model, self.calls.base_logprobs) if self.plan.ref_from_trainer
                          else ("ref_policy", lambda batch: self.calls.logprobs("ref_policy", batch)))
        ref = ([Pass(Stage.REF_LOGPROBS, model, "ref_logprobs", compute)]
               if self.plan.uses_ref or self.plan.ref_from_trainer else [])
        return [*ref, Pass(Stage.OLD_LOGPROBS, self.model, "old_logprobs", self.old_logprobs,
                           timed=self.plan.old_logprob_pass)]

    def old_logprobs(self, batch: dict) -> np.ndarray:
        """The trainer's log-probs of the batch before the update, float32 [T]: NaN at the tokens of
        the samples before ``plan.old_logprob_pass_from`` (the first optimizer step's, whose own
        forward gives them: :class:`chatlearn.algorithms.grpo.GRPOLoss`), the pass's elsewhere."""
        cut, n = self.plan.old_logprob_pass_from, len(batch["prompt_lens"])
        if self.plan.old_from_rollout:  # the rollout engine's stand for them (KL in the reward, replay)
            return np.asarray(batch["rollout_logprobs"], np.float32).copy()
        if cut == 0:
            return self.calls.logprobs(self.model, batch)
        old = np.full(len(batch["tokens"]), np.nan, np.float32)
        if self.plan.old_logprob_pass:
            old[batch["offsets"][cut]:] = self.calls.logprobs(
                self.model, select_samples(columns(batch, SEQUENCE_COLUMNS), range(cut, n)))
        return old

    def train(self, batch: dict, episode: int) -> Trained:
        """The policy's optimizer steps; the first step's own forward (that of the weights that
        generated its samples, when ``plan.old_logprob_pass_from`` > 0) sets aside how far its
        log-probs are from the rollout engine's (:data:`ROLLOUT_MISMATCH`)."""
        return self.steps.run(self.model, batch, episode, self.step_columns, aside=ROLLOUT_MISMATCH)

    def step_columns(self, s: int) -> tuple:
        """The columns of the step starting at sample ``s``: the first step's own forward gives its old
        log-probs and reads the rollout engine's to report the mismatch."""
        keys = (*SEQUENCE_COLUMNS, "old_logprobs", "ref_logprobs", self.advantage_column, "sample_weights")
        wanted = (keys if s >= self.plan.old_logprob_pass_from
                  else (*(k for k in keys if k != "old_logprobs"), "rollout_logprobs"))
        if self.reads_rollout_logprobs:
            wanted = (*(k for k in wanted if k not in ("old_logprobs", "rollout_logprobs")
                        or (k == "old_logprobs" and not self.plan.old_from_rollout)), "rollout_logprobs")
        return wanted


class CriticUpdate:
    """The critic's part (``models.critic``): its values of the samples' tokens as a pass, and its optimizer
    steps on the returns under the clipped value loss (:class:`chatlearn.algorithms.value_loss.ValueLoss`).
    The first ``models.critic.warmup_episodes`` episodes train it alone."""

    model = "critic"
    replay_columns = ("values",)

    def __init__(self, cfg, calls: ModelCalls, steps: StepLoop):
        self.calls, self.steps = calls, steps
        self.warmup_episodes = cfg.models.critic.warmup_episodes

    def passes(self) -> list[Pass]:
        return [Pass(Stage.VALUES, self.model, "values", lambda batch: self.calls.values(self.model, batch))]

    def train(self, batch: dict, episode: int) -> Trained:
        return self.steps.run(self.model, batch, episode, lambda s: (*SEQUENCE_COLUMNS, "values", "returns",
                                                                     "sample_weights"), prefix="train/critic/")


def _overlong_metric(cfg, scored: Scored) -> dict:
    """``train/overlong_penalty_mean`` with DAPO's overlong shaping (``models.reward.overlong_buffer_len``)."""
    if cfg.models.reward.overlong_buffer_len > 0:
        return {"train/overlong_penalty_mean": float(np.mean(scored.shaped - scored.rewards))}
    return {}


class GroupAdvantages:
    """Group-relative advantages (``advantage_estimator``: grpo, dr_grpo, rloo, reinforce_plus_plus, or one a
    plugin registers; ``filter_equal_groups``, ``kl_in_reward``): per sample, with their weights."""

    columns = ("advantages", "sample_weights")
    column = "advantages"

    def __init__(self, cfg, plan: Plan):
        self.cfg, self.plan = cfg, plan

    def __call__(self, batch: dict, scored: Scored) -> dict:
        """Sets ``batch["advantages"]`` and ``batch["sample_weights"]`` from the shaped rewards (see
        :func:`chatlearn.algorithms.advantages.episode_advantages`); returns their ``train/`` metrics."""
        t = self.cfg.models.policy_trainer
        batch["advantages"], batch["sample_weights"], metrics = episode_advantages(
            batch, scored.shaped, self.plan.group_size, estimator=t.advantage_estimator,
            filter_equal_groups=t.filter_equal_groups, kl_in_reward=t.kl_in_reward,
            kl_coef=t.kl_coef, kl_estimator=t.kl_estimator)
        return {**{f"train/{k}": v for k, v in metrics.items()}, **_overlong_metric(self.cfg, scored)}


class GAEAdvantages:
    """Generalized Advantage Estimation (``advantage_estimator: gae``): per-token advantages and returns from
    the shaped rewards (on each sample's last token, less the per-token KL with ``kl_in_reward``) and the
    critic's ``values``, whitened with ``whiten_advantages``; every sample weighs 1."""

    columns = ("token_advantages", "returns", "sample_weights")
    column = "token_advantages"

    def __init__(self, cfg):
        self.cfg = cfg

    def __call__(self, batch: dict, scored: Scored) -> dict:
        t = self.cfg.models.policy_trainer
        kl = None
        if t.kl_in_reward and t.kl_coef > 0:
            kl = token_kl(batch["old_logprobs"], batch["ref_logprobs"], t.kl_estimator).astype(np.float32)
        batch["token_advantages"], batch["returns"], metrics = episode_gae(
            batch, scored.shaped, t.gamma, t.lam, whiten=t.whiten_advantages, kl=kl, kl_coef=t.kl_coef)
        batch["sample_weights"] = np.ones(len(batch["prompt_lens"]), np.float32)
        out = {f"train/{k}": v for k, v in metrics.items() if k in ("advantages_mean", "token_reward_mean")}
        if kl is not None:
            out["train/kl_in_reward_penalty"] = t.kl_coef * metrics["kl_in_reward"]
        # how well the values the critic had before this episode's update predict its returns
        out.update({f"train/critic/{k}": v for k, v in metrics.items()
                    if k in ("values_mean", "returns_mean", "explained_variance")})
        return {**out, **_overlong_metric(self.cfg, scored)}


class DistillAdvantages:
    """On-policy distillation's per-token advantages (``algorithm: opd``): the task reward's group advantage of
    each sample (:class:`GroupAdvantages`) minus ``distill_coef`` x the reverse KL estimate of each of its tokens,
    the student's (old) log-prob minus the teacher's (:func:`chatlearn.algorithms.distill.distill_token_advantages`);
    every sample weighs 1. Its metrics: ``train/distill/*``."""

    columns = ("token_advantages", "sample_weights")
    column = "token_advantages"

    def __init__(self, cfg, plan: Plan):
        self.cfg, self.group = cfg, GroupAdvantages(cfg, plan)

    def __call__(self, batch: dict, scored: Scored) -> dict:
        metrics = self.group(batch, scored)
        coef = self.cfg.models.policy_trainer.distill_coef
        student, teacher = batch["old_logprobs"], batch["teacher_logprobs"]
        batch["token_advantages"] = distill_token_advantages(batch, student, teacher, batch.pop("advantages"), coef)
        batch["sample_weights"] = np.ones(len(batch["prompt_lens"]), np.float32)
        metrics.update({f"train/distill/{k}": v for k, v in
                        distill_metrics(batch, student, teacher, batch["teacher_top1"]).items()})
        return metrics


class TeacherPass:
    """The teacher's part of a distillation algorithm: its log-probs of the samples' tokens as a pass (stage
    ``teacher_logprobs``), before the policy's passes so that the policy trainer, resident for its old log-probs,
    stays to train. ``topk`` (``algorithm: gkd``; -1: the vocabulary): its most likely tokens too, at
    ``temperature`` (None: the sampling one)."""

    replay_columns = ()

    def __init__(self, plan: Plan, calls: ModelCalls, topk: int = 0, temperature: float | None = None):
        self.model = plan.of_kind(TEACHER)[0]
        self.calls, self.topk, self.temperature = calls, topk, temperature

    def passes(self) -> list[Pass]:
        return [Pass(Stage.TEACHER_LOGPROBS, self.model, "teacher_logprobs",
                     lambda batch: self.calls.teacher(self.model, batch, self.topk, self.temperature))]


# what the GKD loss reads of a sample besides its sequence: the teacher's top-k
GKD_COLUMNS = ("teacher_topk_logprobs", "teacher_topk_ids")


class GKDUpdate(PolicyUpdate):
    """The policy's part of ``algorithm: gkd``: no pass of its own (the loss reads no old or reference log-probs:
    it is the generalized JSD to the teacher's top-k, :class:`chatlearn.algorithms.gkd.GKDLoss`), then the
    policy's optimizer steps on the samples and the teacher's top-k."""

    def __init__(self, cfg, plan: Plan, calls: ModelCalls, steps: StepLoop):
        super().__init__(cfg, plan, calls, steps, "sample_weights")
        self.replay_columns = (*SEQUENCE_COLUMNS, *GKD_COLUMNS, "sample_weights")

    def passes(self) -> list[Pass]:
        return []

    def train(self, batch: dict, episode: int) -> Trained:
        return self.steps.run(self.model, batch, episode, self.step_columns)

    def step_columns(self, s: int) -> tuple:
        return (*SEQUENCE_COLUMNS, *GKD_COLUMNS, "sample_weights")


class GKDMetrics:
    """``algorithm: gkd``'s advantages stage: no advantages (every sample weighs 1), the task reward's group
    metrics and ``train/distill/*`` of the rollout engine's log-probs of the samples against the teacher's."""

    columns = ("sample_weights",)
    column = "sample_weights"

    def __init__(self, cfg, plan: Plan):
        self.group = GroupAdvantages(cfg, plan)

    def __call__(self, batch: dict, scored: Scored) -> dict:
        metrics = self.group(batch, scored)
        batch.pop("advantages")
        batch["sample_weights"] = np.ones(len(batch["prompt_lens"]), np.float32)
        if "rollout_logprobs" in batch:
            metrics.update({f"train/distill/{k}": v for k, v in distill_metrics(
                batch, batch["rollout_logprobs"], batch["teacher_logprobs"], batch["teacher_top1"]).items()})
        return metrics


class ComposedAlgorithm(Algorithm):
    """An algorithm made of parts: the policy's (:class:`PolicyUpdate`), an advantage estimate
    (:class:`GroupAdvantages`, :class:`GAEAdvantages`) and, for actor-critic methods, the critic's
    (:class:`CriticUpdate`, trained before the policy and alone during its warm-up). The passes run
    the policy's (reference, old log-probs), then the critic's values: the policy trainer, resident for
    its old log-probs, hands the devices to the critic, which stays to train; then the policy trains
    and stays for the weight push."""

    def __init__(self, name: str, policy: PolicyUpdate, advantages, critic: CriticUpdate | None = None):
        self.name, self.policy, self.estimate, self.critic = name, policy, advantages, critic
        self.updates = {u.model: u for u in (critic, policy) if u is not None}
        self.trained = tuple(self.updates)
        self.replay_columns = (*policy.replay_columns, *(c for c in advantages.columns if c != "sample_weights"),
                               *(critic.replay_columns if critic is not None else ()))

    def trains(self, episode: int) -> tuple[str, ...]:
        if self.critic is not None and episode <= self.critic.warmup_episodes:
            return (self.critic.model,)
        return self.trained

    def passes(self) -> list[Pass]:
        return [*self.policy.passes(), *(self.critic.passes() if self.critic is not None else ())]

    def advantages(self, batch: dict, scored: Scored) -> dict:
        return self.estimate(batch, scored)

    def train(self, model: str, batch: dict, episode: int) -> Trained:
        return self.updates[model].train(batch, episode)


def grpo(cfg, plan: Plan, calls: ModelCalls, steps: StepLoop) -> Algorithm:
    """The group-relative family (``algorithm: grpo``): a reference pass when there is a KL term, the
    old-log-prob pass, group-relative advantages, one trained model (the policy)."""
    return ComposedAlgorithm("grpo", PolicyUpdate(cfg, plan, calls, steps, GroupAdvantages.column),
                             GroupAdvantages(cfg, plan))


def ppo(cfg, plan: Plan, calls: ModelCalls, steps: StepLoop) -> Algorithm:
    """PPO with a critic (``algorithm: ppo``): the policy's loss is GRPO's with per-token GAE advantages; the
    critic learns the returns before the policy steps."""
    return ComposedAlgorithm("ppo", PolicyUpdate(cfg, plan, calls, steps, GAEAdvantages.column),
                             GAEAdvantages(cfg), CriticUpdate(cfg, calls, steps))


class DistillAlgorithm(ComposedAlgorithm):
    """:class:`ComposedAlgorithm` with a teacher's pass first."""

    def __init__(self, name: str, teacher: TeacherPass, policy: PolicyUpdate, advantages):
        super().__init__(name, policy, advantages)
        self.teacher = teacher

    def passes(self) -> list[Pass]:
        return [*self.teacher.passes(), *super().passes()]


def opd(cfg, plan: Plan, calls: ModelCalls, steps: StepLoop) -> Algorithm:
    """On-policy distillation (``algorithm: opd``): the teacher's log-probs of the student's samples, the old
    log-probs of every sample, per-token advantages from the reverse KL and the task reward
    (:class:`DistillAdvantages`), the policy's clipped loss."""
    return DistillAlgorithm("opd", TeacherPass(plan, calls),
                            PolicyUpdate(cfg, plan, calls, steps, DistillAdvantages.column),
                            DistillAdvantages(cfg, plan))


class GKDAlgorithm(DistillAlgorithm):
    """``algorithm: gkd``: a :class:`DistillAlgorithm` whose episodes train on the data's reference responses with
    probability ``1 - gkd_lambda`` (:func:`chatlearn.algorithms.gkd_lambda.on_policy`, drawn from ``runtime_args.seed`` and
    the episode); its policy metrics say which (``train/gkd_offpolicy_frac``: 1 for an episode of the data's
    responses, 0 for one of the student's samples)."""

    def __init__(self, cfg, teacher: TeacherPass, policy: PolicyUpdate, advantages):
        super().__init__("gkd", teacher, policy, advantages)
        self.seed, self.lam = int(cfg.runtime_args.seed), float(cfg.models.policy_trainer.gkd_lambda)

    def data_responses(self, episode: int) -> bool:
        return not on_policy(self.seed, episode, self.lam)

    def train(self, model: str, batch: dict, episode: int) -> Trained:
        trained = super().train(model, batch, episode)
        trained.metrics["train/gkd_offpolicy_frac"] = float(self.data_responses(episode))
        return trained


def gkd(cfg, plan: Plan, calls: ModelCalls, steps: StepLoop) -> Algorithm:
    """Generalized knowledge distillation (``algorithm: gkd``, TRL's GKD): the teacher's top-k (``distill_topk``;
    null: the vocabulary) at ``gkd_temperature`` of the student's samples, or with probability ``1 - gkd_lambda``
    of the data's responses (:class:`GKDAlgorithm`), then the policy's steps on the generalized JSD
    (:class:`chatlearn.algorithms.gkd.GKDLoss`, ``gkd_beta``); no old-log-prob pass."""
    t = cfg.models.policy_trainer
    topk = -1 if t.distill_topk is None else int(t.distill_topk)
    return GKDAlgorithm(cfg, TeacherPass(plan, calls, topk, float(t.gkd_temperature)),
                        GKDUpdate(cfg, plan, calls, steps), GKDMetrics(cfg, plan))


def make_algorithm(cfg, plan: Plan, calls: ModelCalls, steps: StepLoop) -> Algorithm:
    """The run's algorithm (``plan.algorithm``), built by what its declaration names
    (:data:`chatlearn.config.algorithms.ALGORITHMS`: a ``"module:function"`` or, from a plugin, the function)."""
    build = ALGORITHMS.get(plan.algorithm).build
    if isinstance(build, str):
        module, _, attr = build.partition(":")
        build = getattr(importlib.import_module(module), attr)
    return build(cfg, plan, calls, steps)
