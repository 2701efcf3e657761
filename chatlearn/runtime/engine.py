"""The GRPO episode loop.

One episode, in the order the code runs it:

1. rollout: the policy engine samples ``num_inference_per_prompt`` responses per prompt;
2. reward: CPU workers score them, while
3. the reference log-probs (ref_policy) and
4. the old log-probs (policy_trainer) are computed; then advantages and optimizer steps;
5. weight push: the rollout engine wakes its weights, receives the new ones, then its KV cache.

The order is chosen to minimise turns on shared devices: the reference model runs before the
trainer so that the trainer, once resident for its old log-probs, stays resident to train; and the
rollout engine, resident after the push, stays resident for evaluation and the next rollout.
With full colocation that is nine transitions per episode (policy out, ref in, ref out, trainer
weights in, trainer optimizer in, trainer optimizer out, policy weights in, the push, trainer
weights out, policy KV cache in), seven without a reference model (no KL term); models on
disjoint devices make no turns and run concurrently.
Every episode reports the time spent in model compute and the overhead share (everything else:
turns, the weight push, Ray dispatch and transfers, the driver's own work).

With ``runtime_args.max_staleness`` = k > 0 (the rollout on devices of its own) steps 1-2 of the
next k episodes run on a rollout thread while the driver runs steps 3-5 of the current one
(:mod:`chatlearn.runtime.overlap`): the push waits for the generate call in flight, and episode n
trains on samples of weight version n-1-k.
"""
from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import ray
from omegaconf import DictConfig

from chatlearn.algorithms.advantages import (ROLLOUT_MISMATCH, episode_advantages, fill_groups, loss_token_counts,
                                             overlong_penalty, varied_groups)
from chatlearn.checkpoint.manager import CheckpointManager
from chatlearn.config.names import MODEL_PARTS, Part, Stage
from chatlearn.config.plan import Plan
from chatlearn.data.dataset import PromptSampler, PromptSet, load_prompts, load_tokenizer
from chatlearn.errors import UserError
from chatlearn.logging.console import attach_logs
from chatlearn.logging.metrics import summary_line
from chatlearn.logging.metrics import run_summary
from chatlearn.logging.perf import peak_memory
from chatlearn.logging.plots import plot_after_run
from chatlearn.logging.progress import RunProgress
from chatlearn.logging.sinks import MetricSinks, write_config_yaml
from chatlearn.models.base import concat_batches, response_mask, select_samples
from chatlearn.runtime.cluster import Cluster
from chatlearn.runtime.instrument import EpisodeRun, Instrument
from chatlearn.runtime.multiturn import MultiTurnRollout, env_metrics, trajectory_fields
from chatlearn.runtime.overlap import RolloutPipeline, kept_rollouts
from chatlearn.runtime.output_dir import check_start, move_aside, previous_run, reconcile_logs
from chatlearn.runtime.output_dir import refusal as output_refusal
from chatlearn.runtime.replay import ReplayBuffer
from chatlearn.runtime.rollouts import Prompts, Rollouts
from chatlearn.runtime.run_lock import RunLock
from chatlearn.runtime.scheduler import Scheduler, Timeline, movable_parts
from chatlearn.runtime.weight_push import WeightSync


class GRPO(Rollouts):
    """Holds the models and data of a run; ``train()`` runs the episodes."""

    def __init__(self, cfg: DictConfig, plan: Plan, cluster: Cluster, tokenizer, train_set: PromptSet,
                 eval_set: PromptSet | None, multi_turn: MultiTurnRollout | None = None):
        self.cfg, self.plan, self.tokenizer, self.multi_turn = cfg, plan, tokenizer, multi_turn
        self.train_set, self.eval_set = train_set, eval_set
        rt, m = cfg.runtime_args, cfg.models
        self.out = rt.output_dir
        self.timeline = Timeline(os.path.join(self.out, "timeline.jsonl"))
        self.sched = Scheduler(plan, self.timeline, offload_without_gpu=rt.offload_without_gpu)
        # Each model is built once the models before it have left the devices they share with it.
        # The rollout engine comes last: it sizes its KV cache from the memory left free.
        order = [n for n in ("policy_trainer", "ref_policy", "reward", "policy") if n in plan.placements]
        cluster.prestart(order)  # every process starts now; the models are built in turn below
        for name in order:  # (ref_policy is not placed without a KL term)
            movable = movable_parts(name, m[name].free_gpu_memory) if name in MODEL_PARTS else ()
            self.sched.add(name, lambda name=name: cluster.create(name), movable)
        self.policy, self.trainer = self.sched.groups["policy"], self.sched.groups["policy_trainer"]
        self.ref, self.reward = self.sched.groups.get("ref_policy"), self.sched.groups["reward"]
        self.reward_spec = cluster.specs["reward"]
        self.progress = RunProgress(rt.num_episode)
        self.instrument = Instrument(self.sched, self.progress, rt.num_training_epoch)
        self.sampler = PromptSampler(len(train_set), shuffle=rt.data_shuffle, seed=rt.seed)
        # earlier episodes' samples to train on again (with their rollout log-probs where the loss reads them)
        self.replay = ReplayBuffer(rt.max_replay_episode, with_rollout_logprobs=self.loss_reads_rollout_logprobs)
        self.ckpt = CheckpointManager(os.path.join(self.out, "checkpoints"), rt.keep_last_checkpoints)
        self.metrics = MetricSinks(cfg)
        self.nonfinite_in_a_row = 0  # optimizer steps skipped in a row (non-finite loss or gradient norm)
        # runtime_args.max_staleness > 0: the rollouts of the next episodes run beside training
        self.pipeline = (RolloutPipeline(plan.max_staleness, self.draw_prompts, self.produce_rollout,
                                          lambda rows: Prompts.of(self.train_set, rows, self.plan.group_size))
                         if plan.max_staleness > 0 else None)

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict:
        rt = self.cfg.runtime_args
        last: dict = {}
        start = self.resume() + 1 if rt.enable_resume_training else 1
        if start == 1 and rt.enable_eval_before_training and self.eval_set is not None:
            self.progress.begin(0)
            last = self.evaluate()
            self.log(0, last)
        for episode in range(start, rt.num_episode + 1):
            metrics = self.episode(episode)
            final = episode == rt.num_episode
            if self.eval_set is not None and rt.eval_episode_interval > 0 and (
                    episode % rt.eval_episode_interval == 0 or final):
                metrics.update(self.evaluate())
            self.log(episode, metrics)
            last = metrics
        return last

    def episode(self, episode: int) -> dict:
        """One GRPO episode, stage by stage in the order it runs (see the module docstring); ``run``
        measures the stages, ``self.sched`` makes each model resident before it runs."""
        run = self.instrument.begin(episode)
        dynamic = self.cfg.runtime_args.dynamic_sampling
        ahead = self.pipeline is not None  # generated and scored on the rollout thread (max_staleness)
        with run.stage(Stage.GENERATE, "policy") if not ahead else contextlib.nullcontext():
            prompts, batch, scored, metrics = self.rollout(episode)
        if dynamic:  # scored now: the rewards choose the groups that fill the batch
            batch, prompts, scored, metrics = self.dynamic_sampling(run, episode, batch, prompts)

        # The reward workers (CPU) score while the log-prob passes run. The reference runs beside the
        # trainer when they do not share devices; when they do it goes first, so that the trainer,
        # once resident for its old log-probs, stays to train.
        with _closing(ThreadPoolExecutor(max_workers=2)) as pool:
            scoring = None if dynamic or ahead else run.background(
                pool, Stage.REWARD, "reward", self.score, batch, prompts.truths, prompts.sources, prompts.extra,
                None, f"the rollouts of episode {episode}")
            reference = self.start_ref_logprobs(batch, run, pool)
            with (run.stage(Stage.OLD_LOGPROBS, "policy_trainer") if self.plan.old_logprob_pass
                  else contextlib.nullcontext()):  # no pass: nothing to time
                batch["old_logprobs"] = self.old_logprobs(batch)
            if reference is not None:
                batch["ref_logprobs"] = reference.result()
            if scoring is not None:
                scored = self.shaped(batch, *scoring.result())
        rewards, reward_parts, shaped_rewards = scored

        metrics.update(self.advantages(batch, shaped_rewards))
        if self.cfg.models.reward.overlong_buffer_len > 0:
            metrics["train/overlong_penalty_mean"] = float(np.mean(shaped_rewards - rewards))
        self.log_samples(episode, batch, rewards, prompts)  # before the checkpoint, which keeps them
        with run.stage(Stage.TRAIN, "policy_trainer"):
            self.sched.ensure("policy_trainer", MODEL_PARTS["policy_trainer"])
            train_batch = self.replay.training_batch(batch)
            if self.plan.old_logprob_pass_from and not self.loss_reads_rollout_logprobs:
                # (no replay then) the first step reports the mismatch
                train_batch["rollout_logprobs"] = batch["rollout_logprobs"]
            metrics.update(self.optimize(train_batch, episode))
        self.replay.add(batch)  # before the checkpoint, which keeps it for the episodes that follow
        if self.should_save(episode):  # the trainer is still resident with its optimizer state
            with run.stage(Stage.CHECKPOINT, "policy_trainer"):
                self.save_checkpoint(episode)

        # new weights into the rollout engine: its weights first, the push, then its KV cache
        with run.stage(Stage.WEIGHT_PUSH, "policy"):
            metrics.update(self.push_weights())
        self.sched.ensure("policy", [Part.KV_CACHE])
        metrics.update(self.episode_metrics(episode, batch, rewards, reward_parts))
        return run.finish(metrics, batch, self.generated_tokens if dynamic else None)

    @property
    def loss_reads_rollout_logprobs(self) -> bool:
        """Whether every optimizer step reads the rollout engine's log-probs: they are its old
        log-probs (``old_logprobs: rollout``) or the behaviour log-probs of a rollout correction."""
        return self.plan.old_from_rollout or self.plan.rollout_correction != "none"

    def shaped(self, batch: dict, rewards: np.ndarray, reward_parts: dict) -> tuple:
        """``(rewards, reward_parts, shaped rewards)``: the shaped ones (what the advantages and dynamic
        sampling read) add DAPO's overlong penalty (``models.reward.overlong_buffer_len``,
        :func:`chatlearn.algorithms.advantages.overlong_penalty`) to the reward functions' total; the
        same array without it."""
        r = self.cfg.models.reward
        if r.overlong_buffer_len <= 0:
            return rewards, reward_parts, rewards
        lens = np.diff(batch["offsets"]) - np.asarray(batch["prompt_lens"])
        penalty = overlong_penalty(lens, self.cfg.models.policy.max_response_tokens_length,
                                   r.overlong_buffer_len, r.overlong_penalty_factor)
        return rewards, reward_parts, rewards.astype(np.float64) + penalty

    def dynamic_sampling(self, run: EpisodeRun, episode: int, batch: dict, prompts: Prompts) -> tuple:
        """DAPO's dynamic sampling (``runtime_args.dynamic_sampling``): score the episode's groups, and
        while fewer than ``prompts_per_episode`` of the groups drawn have unequal (shaped) rewards, draw
        that many prompts more from the sampler and sample them, for at most
        ``dynamic_sampling_max_rounds`` rounds; the batch is the kept groups in the order they were
        drawn, filled with the earliest equal-reward groups when the rounds ran out
        (:func:`chatlearn.algorithms.advantages.fill_groups`). Round k samples with seed
        ``seed + episode + k * DYNAMIC_SAMPLING_SEED_STRIDE``; the sampler's position, saved with each
        checkpoint, includes every prompt drawn, so a resumed run draws what the uninterrupted one did.
        Returns ``(batch, prompts, (rewards, reward_parts, shaped), metrics)``."""
        rt, g = self.cfg.runtime_args, self.plan.group_size
        needed = self.plan.prompts_per_episode
        rounds: list[tuple] = []
        kept = 0
        while True:
            with run.stage(Stage.REWARD, "reward"):
                scored = self.shaped(batch, *self.score(batch, prompts.truths, prompts.sources, prompts.extra, None,
                                                        f"the rollouts of episode {episode}"))
            varied = varied_groups(scored[2], g)
            rounds.append((batch, prompts, scored, varied))
            kept += int(varied.sum())
            if kept >= needed or len(rounds) >= rt.dynamic_sampling_max_rounds:
                break
            prompts = self.next_prompts()
            seed = self.cfg.models.policy.seed + episode + len(rounds) * DYNAMIC_SAMPLING_SEED_STRIDE
            with run.stage(Stage.GENERATE, "policy"):
                batch = self.sample(prompts, self.sampling(eval_mode=False, seed=seed),
                                    f"the rollouts of episode {episode} (dynamic sampling round {len(rounds) + 1})")
        chosen = fill_groups([r[3] for r in rounds], needed)
        parts_b, parts_p, parts_r = [], [], []
        for k, (b, p, sc, _) in enumerate(rounds):
            groups = [grp for kk, grp in chosen if kk == k]
            if not groups:
                continue
            idx = [grp * g + j for grp in groups for j in range(g)]
            parts_b.append(select_samples(b, idx))
            parts_p.append(p.select(idx))
            parts_r.append((sc[0][idx], {key: v[idx] for key, v in sc[1].items()}, sc[2][idx]))
        batch = concat_batches(parts_b) if len(parts_b) > 1 else parts_b[0]
        prompts = Prompts.join(parts_p)
        scored = (np.concatenate([r[0] for r in parts_r]),
                  {key: np.concatenate([r[1][key] for r in parts_r]) for key in parts_r[0][1]},
                  np.concatenate([r[2] for r in parts_r]))
        drawn = len(rounds) * needed
        self.generated_tokens = sum(int(loss_token_counts(r[0]).sum()) for r in rounds)  # the model's tokens
        metrics = {"train/dynamic_sampling_rounds": float(len(rounds)),
                   "train/dynamic_sampling_prompts_drawn": float(drawn),
                   "train/dynamic_sampling_kept_frac": kept / drawn,
                   "train/dynamic_sampling_filled_groups": float(max(needed - kept, 0))}
        return batch, prompts, scored, metrics

    def rollout(self, episode: int) -> tuple:
        """``(prompts, batch, scored, metrics)`` of the episode: sampled now (``scored`` None: scoring
        runs beside the log-prob passes), or with ``max_staleness`` taken from the rollout pipeline,
        scored, with the staleness and overlap metrics (launching the rollouts ahead first)."""
        if self.pipeline is None:
            prompts = self.next_prompts()
            self.sched.ensure("policy", [Part.WEIGHTS, Part.KV_CACHE])
            seed = self.cfg.models.policy.seed + episode
            batch = self.sample(prompts, self.sampling(eval_mode=False, seed=seed), f"the rollouts of episode {episode}")
            return prompts, batch, None, {}
        self.pipeline.fill(episode, self.cfg.runtime_args.num_episode)
        self.progress.stage(Stage.GENERATE)
        rollout, metrics = self.pipeline.take(episode, trainer_version=episode - 1)
        for stage, model in ((Stage.GENERATE, "policy"), (Stage.REWARD, "reward")):
            if f"time/{stage}" in metrics:  # timed on the rollout thread
                self.sched.stage(model, stage, metrics[f"time/{stage}"])
        return rollout.prompts, rollout.batch, rollout.scored, metrics

    def draw_prompts(self, episode: int) -> Prompts:
        """The prompts of ``episode`` for the rollout pipeline, drawn on the driver in episode order."""
        return self.next_prompts()

    def produce_rollout(self, episode: int, prompts: Prompts) -> tuple:
        """Episode ``episode``'s samples and their (shaped) rewards, on the rollout thread: the
        generate call of the on-policy run (its seed), then scoring. Returns ``(batch, scored, seconds)``."""
        start = time.perf_counter()
        self.sched.ensure("policy", [Part.WEIGHTS, Part.KV_CACHE])
        batch = self.sample(prompts, self.sampling(eval_mode=False, seed=self.cfg.models.policy.seed + episode),
                            f"the rollouts of episode {episode}")
        mid = time.perf_counter()
        scored = self.shaped(batch, *self.score(batch, prompts.truths, prompts.sources, prompts.extra, None,
                                                f"the rollouts of episode {episode}"))
        return batch, scored, {"time/generate": mid - start, "time/reward": time.perf_counter() - mid}

    def next_prompts(self) -> Prompts:
        """The episode's prompts from the sampler, each repeated for its group of responses."""
        return Prompts.of(self.train_set, self.sampler.next(self.plan.prompts_per_episode), self.plan.group_size)

    def start_ref_logprobs(self, batch: dict, run: EpisodeRun, pool: ThreadPoolExecutor):
        """The reference log-probs (None without a KL term): computed now when the reference shares
        the trainer's devices, else started on ``pool`` to run beside the trainer's pass. Returns
        something whose ``result()`` gives them."""
        if not self.plan.uses_ref:
            return None
        if "policy_trainer" in self.plan.colocated_with("ref_policy"):
            with run.stage(Stage.REF_LOGPROBS, "ref_policy"):
                done: Future = Future()
                done.set_result(self.ref_logprobs(batch))
                return done
        return pool.submit(run.timed, "ref_policy", Stage.REF_LOGPROBS, self.ref_logprobs, batch)

    def log_samples(self, episode: int, batch: dict, rewards: np.ndarray, prompts: Prompts) -> None:
        """Every ``log_samples_interval`` episodes, ``log_samples_num`` decoded rows to the sinks
        (samples.jsonl, TensorBoard, W&B); decoding only, no random number drawn."""
        la = self.cfg.runtime_args.log_args_dict
        if la.log_samples_interval > 0 and episode % la.log_samples_interval == 0:
            self.metrics.write_samples(episode, self.sample_rows(batch, rewards, prompts.truths, prompts.sources,
                                                                 la.log_samples_num))

    def episode_metrics(self, episode: int, batch: dict, rewards: np.ndarray, reward_parts: dict) -> dict:
        """The rollouts' and rewards' ``train/`` metrics, the trainer's log-prob pass statistics, and
        how far the rollout engine's log-probs are from the trainer's (warned past
        ``models.policy.logprob_mismatch_warn``)."""
        metrics = {f"perf/logprob_{k}": v for k, v in self.trainer.call("logprob_stats")[0][0].items()}
        metrics.update(self.rollout_metrics(batch, rewards, prefix="train"))
        metrics.update(self.reward_metrics(reward_parts, prefix="train"))
        metrics.update(self.mismatch_metrics(batch))
        metrics.update(env_metrics(batch, prefix="train"))
        warn_at = self.cfg.models.policy.logprob_mismatch_warn
        if warn_at > 0 and metrics["train/logprob_diff_rollout_vs_trainer_mean"] > warn_at:
            print(f"[chatlearn] warning: episode {episode}: rollout and trainer log-probs differ by "
                  f"{metrics['train/logprob_diff_rollout_vs_trainer_mean']:.4f} nats per token on average "
                  f"(models.policy.logprob_mismatch_warn: {warn_at:g}; mismatch KL "
                  f"{metrics['train/mismatch_kl']:.2e}): the rollout engine samples from a different "
                  "distribution than the trainer (dtype, kernels, or a failed weight push)", flush=True)
        return metrics

    def mismatch_metrics(self, batch: dict) -> dict:
        """How far the rollout engine's log-probs are from the trainer's before the update, over every
        response token: the old-log-prob pass's tokens, and the first optimizer step's as its own
        forward reported them (``plan.old_logprob_pass_from``)."""
        mask = response_mask(batch)
        cut = min(self.plan.old_logprob_pass_from, len(batch["prompt_lens"]))
        mask[:batch["offsets"][cut]] = False
        d = batch["old_logprobs"][mask].astype(np.float64) - batch["rollout_logprobs"][mask].astype(np.float64)
        own = dict.fromkeys(ROLLOUT_MISMATCH, 0.0)  # the first step's sums (none without it)
        if cut:
            own.update(self.own_old_mismatch)
        count = d.size + own["rollout_tokens"]
        total = float(np.abs(d).sum()) + own["rollout_diff_sum"]
        kl = (mismatch_kl(batch["old_logprobs"][mask], batch["rollout_logprobs"][mask]) * d.size
              + own["rollout_kl_sum"])
        top = max(float(np.abs(d).max()) if d.size else 0.0, own["rollout_diff_max"])
        return {"train/logprob_diff_rollout_vs_trainer_mean": total / count if count else 0.0,
                "train/logprob_diff_rollout_vs_trainer_max": top,
                "train/mismatch_kl": kl / count if count else 0.0}

    def sample_rows(self, batch: dict, rewards: np.ndarray, truths: list, sources: list[str], k: int) -> list[dict]:
        """``k`` of the episode's samples as rows (decoded prompt and response, reward, ...): one
        response of each of the first prompts, then second responses, so the rows spread over the
        groups. Only reads the batch; no random number is drawn."""
        n = self.plan.group_size
        groups = len(rewards) // n
        picks = [g * n + j for j in range(n) for g in range(groups)][:k]
        chosen = select_samples({key: batch[key] for key in batch if key in SAMPLE_ROW_KEYS or key.startswith("env/")},
                                picks)
        lens = np.diff(chosen["offsets"]) - chosen["prompt_lens"]
        return [{"sample": i, "prompt": p, "response": r, "reward": float(rewards[i]),
                 "ground_truth": truths[i] if isinstance(truths[i], (str, int, float, bool)) or truths[i] is None
                 else str(truths[i]),
                 "data_source": sources[i], "response_tokens": int(n_tok), "finished": bool(done),
                 **trajectory_fields(self.tokenizer, chosen, j)}
                for j, (i, p, r, n_tok, done) in enumerate(zip(picks, self.prompts_text(chosen), self.responses_text(chosen),
                                                               lens, chosen["finish_reasons"]))]

    # ------------------------------------------------------------------ stages
    @property
    def train_temperature(self) -> float:
        """Log-probs are taken under the sampling distribution's temperature (1 for greedy)."""
        t = self.cfg.models.policy.temperature
        return t if t > 0 else 1.0

    def old_logprobs(self, batch: dict) -> np.ndarray:
        """The trainer's log-probs of the batch before the update, float32 [T]: NaN at the tokens of
        the samples before ``plan.old_logprob_pass_from`` (the first optimizer step's, whose own
        forward gives them: :class:`chatlearn.algorithms.grpo.GRPOLoss`), the pass's elsewhere."""
        cut, n = self.plan.old_logprob_pass_from, len(batch["prompt_lens"])
        if self.plan.old_from_rollout:  # the rollout engine's stand for them (KL in the reward, replay)
            return np.asarray(batch["rollout_logprobs"], np.float32).copy()
        if cut == 0:
            self.sched.ensure("policy_trainer", [Part.WEIGHTS])
            return self.logprobs(self.trainer, batch)
        old = np.full(len(batch["tokens"]), np.nan, np.float32)
        if self.plan.old_logprob_pass:
            self.sched.ensure("policy_trainer", [Part.WEIGHTS])
            old[batch["offsets"][cut]:] = self.logprobs(self.trainer, select_samples(
                {k: batch[k] for k in SEQUENCE_KEYS if k in batch}, range(cut, n)))
        return old

    def ref_logprobs(self, batch: dict) -> np.ndarray:
        self.sched.ensure("ref_policy", [Part.WEIGHTS])
        return self.logprobs(self.ref, batch)

    def logprobs(self, group, batch: dict) -> np.ndarray:
        """Log-probs of the batch's tokens under ``group``'s model, at the sampling temperature."""
        ref = ray.put({k: batch[k] for k in SEQUENCE_KEYS if k in batch})
        outs, _ = group.call("compute_logprobs", ref, self.train_temperature)
        return outs[0]

    def advantages(self, batch: dict, rewards: np.ndarray) -> dict:
        """Sets ``batch["advantages"]`` and ``batch["sample_weights"]`` from the rewards
        (``advantage_estimator``, ``filter_equal_groups``, ``kl_in_reward``: see
        :func:`chatlearn.algorithms.grpo.episode_advantages`); returns their ``train/`` metrics."""
        t = self.cfg.models.policy_trainer
        batch["advantages"], batch["sample_weights"], metrics = episode_advantages(
            batch, rewards, self.plan.group_size, estimator=t.advantage_estimator,
            filter_equal_groups=t.filter_equal_groups, kl_in_reward=t.kl_in_reward,
            kl_coef=t.kl_coef, kl_estimator=t.kl_estimator)
        return {f"train/{k}": v for k, v in metrics.items()}

    def optimize(self, batch: dict, episode: int = 0) -> dict:
        """``sample_per_episode / train_global_batch_size`` optimizer steps (times num_training_epoch).

        Returns the means over the steps taken as ``train/<metric>``, and ``train/skipped_steps``: the
        steps the trainer skipped because their loss or gradient norm was not finite (their metrics are
        left out of the means).
        ``optimizer.max_nonfinite_steps`` skipped steps in a row (across episodes) stop the run with a
        UserError, before the episode's checkpoint."""
        plan = self.plan
        keys = (*SEQUENCE_KEYS, "old_logprobs", "ref_logprobs", "advantages", "sample_weights")
        sums: dict[str, float] = collections.defaultdict(float)
        steps = skipped = 0
        samples = len(batch["prompt_lens"])  # with replay, earlier episodes' samples too
        epochs = self.cfg.runtime_args.num_training_epoch
        total = samples // plan.samples_per_step * epochs
        self.own_old_mismatch = {}
        for _ in range(epochs):
            for s in range(0, samples, plan.samples_per_step):
                # the first step's own forward gives its old log-probs; it reports the rollout mismatch
                wanted = (keys if s >= plan.old_logprob_pass_from
                          else (*(k for k in keys if k != "old_logprobs"), "rollout_logprobs"))
                if self.loss_reads_rollout_logprobs:
                    wanted = (*(k for k in wanted if k not in ("old_logprobs", "rollout_logprobs")
                                or (k == "old_logprobs" and not plan.old_from_rollout)), "rollout_logprobs")
                sub = select_samples({k: batch[k] for k in wanted if k in batch}, range(s, s + plan.samples_per_step))
                self.progress.stage(Stage.TRAIN, f"step {steps + 1}/{total}")
                outs, _ = self.trainer.call("train", ray.put(sub), self.train_temperature)
                step = dict(outs[0])
                mismatch = {k: step.pop(k) for k in ROLLOUT_MISMATCH if k in step}
                if steps == 0:  # the first step's forward is that of the weights that generated its samples
                    self.own_old_mismatch.update(mismatch)
                steps += 1
                if self.nonfinite_step(step, episode, steps):
                    skipped += 1
                    continue
                for k, v in step.items():
                    sums[k] = max(sums[k], float(v)) if k in STEP_MAXIMA else sums[k] + float(v)
        means = {k: v if k in STEP_MAXIMA else v / (steps - skipped) for k, v in sums.items()}
        means["skipped_steps"] = float(skipped)
        return {f"train/{k}": v for k, v in means.items()}

    def nonfinite_step(self, step: dict, episode: int, index: int) -> bool:
        """Whether the trainer skipped this step (``skipped_steps``: its loss or gradient norm was not
        finite); warns, counts the skipped steps in a row, and stops the run when they reach
        ``models.policy_trainer.optimizer.max_nonfinite_steps``."""
        limit = self.cfg.models.policy_trainer.optimizer.max_nonfinite_steps
        where = f"episode {episode}, optimizer step {index}/{self.plan.steps_per_episode}"
        if not step["skipped_steps"]:
            self.nonfinite_in_a_row = 0
            return False
        self.nonfinite_in_a_row += 1
        values = f"loss {step['loss']}, gradient norm {step['grad_norm']}"
        if self.nonfinite_in_a_row >= limit:
            raise UserError(
                f"training diverged: the loss or the gradient norm was not finite in {self.nonfinite_in_a_row} "
                f"optimizer steps in a row (the last: {where}; {values}), so the run stops "
                f"(models.policy_trainer.optimizer.max_nonfinite_steps: {limit}). The skipped steps changed no "
                f"weight, so no checkpoint holds their gradients; the newest in "
                f"{os.path.join(self.out, 'checkpoints')} resumes the run. Lower "
                "models.policy_trainer.optimizer.lr, look for extreme rewards or data, or raise "
                "max_nonfinite_steps to ride out rarer ones.")
        print(f"[chatlearn] warning: {where}: {values}: not finite, so the step was skipped (weights, optimizer "
              f"state and learning-rate schedule unchanged); {self.nonfinite_in_a_row} skipped in a row, the run "
              f"stops at {limit} (models.policy_trainer.optimizer.max_nonfinite_steps)", flush=True)
        return True

    def push_weights(self) -> dict:
        """Wake the rollout engine's weights (the trainer's stay beside them) and stream the trainer's
        weights into every rollout replica (``WeightSync``: buckets, transport chosen by placement,
        set up on the first push); returns ``sync/*`` metrics. The KV cache is woken after it."""
        if self.pipeline is not None:  # the rollout engine changes weights between generate calls, never in one
            self.pipeline.drain()
        self.sched.ensure("policy", [Part.WEIGHTS], keep={"policy_trainer": [Part.WEIGHTS]})
        if getattr(self, "weight_sync", None) is None:
            self.weight_sync = WeightSync(self.trainer, self.policy, self.plan, self.cfg)
        pushed = self.weight_sync.push()
        if self.pipeline is not None:
            self.pipeline.pushed()
        return pushed

    def should_save(self, episode: int) -> bool:
        rt = self.cfg.runtime_args
        return episode == rt.num_episode or (rt.save_episode_interval > 0 and episode % rt.save_episode_interval == 0)

    def save_checkpoint(self, episode: int) -> None:
        """The trainer's sharded state, the data sampler and the episode, under one step counter,
        plus a Hugging Face folder of the policy when ``save_hf`` (see CheckpointManager)."""
        def write(tmp: str) -> None:
            self.trainer.call("save_checkpoint", os.path.abspath(os.path.join(tmp, "trainer")))
            self.replay.save(tmp)
            if self.pipeline is not None:  # the finished rollouts of the episodes after this one
                self.pipeline.save(tmp)
            if self.cfg.models.policy_trainer.save_hf:
                self.trainer.call("save_hf", os.path.abspath(os.path.join(tmp, "hf")))

        self.ckpt.save(episode, write, {"sampler": self.sampler.state_dict()})

    def resume(self) -> int:
        """Continue from the newest complete checkpoint; returns its episode (0: none)."""
        found = self.ckpt.latest_usable(warn=lambda msg: print(f"[chatlearn] warning: {msg}", flush=True))
        if found is None:
            return 0
        episode, path = found
        state = self.ckpt.read_state(path)
        self.ckpt.adopt(state)  # keep-last-N goes on counting this run's checkpoints
        print(f"[chatlearn] resuming from {path} (episode {episode})", flush=True)
        kept_rollouts(path, self.plan.max_staleness)  # refused before anything loads when the bound changed
        self.sched.ensure("policy_trainer", MODEL_PARTS["policy_trainer"])
        try:
            self.trainer.call("load_checkpoint", os.path.abspath(os.path.join(path, "trainer")))
        except UserError as err:  # from the trainer ranks, wrapped by Ray
            cause = getattr(err, "cause", None) or err
            raise UserError(
                f"cannot resume from the newest checkpoint {path!r}: {cause.message} To resume from the "
                f"checkpoint before it, delete or move that folder; to start "
                "over, run with --no-resume or set runtime_args.enable_resume_training=false.") from err
        self.sampler.load_state_dict(state["sampler"])
        self.replay.load(path)
        # the rollout engine still holds the initial weights: give it the checkpoint's
        self.push_weights()
        if self.pipeline is not None:
            self.pipeline.load(path)
            self.pipeline.pushed(version=episode)
        self.sched.ensure("policy", [Part.KV_CACHE])
        # rows a crashed run wrote past the checkpoint (also dropped before the run started, see
        # reconcile_logs; atomic, and a torn last row goes with them)
        self.metrics.truncate_after(episode)
        return episode

    def evaluate(self) -> dict:
        p = self.cfg.models.policy
        prompts = Prompts.of(self.eval_set, range(len(self.eval_set)), p.eval_num_inference_per_prompt)
        start = time.perf_counter()
        self.progress.stage(Stage.EVAL)
        self.sched.ensure("policy", [Part.WEIGHTS, Part.KV_CACHE])
        batch = self.sample(prompts, self.sampling(eval_mode=True, seed=p.seed), "the evaluation set")
        rewards, reward_parts = self.score(batch, prompts.truths, prompts.sources, prompts.extra,
                                           what="the evaluation set")
        metrics = self.rollout_metrics(batch, rewards, prefix="eval")
        metrics.update(self.reward_metrics(reward_parts, prefix="eval"))
        metrics.update(env_metrics(batch, prefix="eval"))
        for src in sorted(set(prompts.sources)):
            sel = np.array([s == src for s in prompts.sources])
            metrics[f"eval/{src}/reward_mean"] = float(rewards[sel].mean())
        metrics["time/eval"] = time.perf_counter() - start
        self.instrument.stage(Stage.EVAL, "policy", metrics["time/eval"])
        return metrics

    @staticmethod
    def rollout_metrics(batch: dict, rewards: np.ndarray, prefix: str) -> dict:
        resp = (batch["offsets"][1:] - batch["offsets"][:-1]) - batch["prompt_lens"]
        return {f"{prefix}/reward_mean": float(rewards.mean()), f"{prefix}/reward_std": float(rewards.std()),
                f"{prefix}/response_len_mean": float(resp.mean()),
                f"{prefix}/truncated_frac": float(1.0 - batch["finish_reasons"].mean())}

    def log(self, episode: int, metrics: dict) -> None:
        metrics = {**metrics, **peak_memory(self.sched.groups), **self.sched.take_gpu_peaks()}
        self.metrics.write(episode, metrics)
        self.progress.finish(episode, summary_line(episode, self.cfg.runtime_args.num_episode, metrics))


@contextlib.contextmanager
def _closing(pool: ThreadPoolExecutor):
    """``with pool``, except that on an error or Ctrl-C the pool is left without waiting for its
    threads: one may be blocked on a stuck Ray call (a reward function that never returns) until the
    run's actors are killed on the way out, which ends it; waiting here would swallow the first Ctrl-C."""
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


# what a log-prob pass reads of a batch: the sequences, and which of their tokens are the model's
# (loss_mask: only in multi-turn batches)
SEQUENCE_KEYS = ("tokens", "offsets", "prompt_lens", "loss_mask")
# what a logged sample row reads of a batch (with the env/ columns of a multi-turn one)
SAMPLE_ROW_KEYS = ("tokens", "offsets", "prompt_lens", "finish_reasons", "loss_mask")

# dynamic sampling: round k of an episode samples with seed + episode + k * this stride
DYNAMIC_SAMPLING_SEED_STRIDE = 100_003

# step metrics that are the largest over an episode's steps, not their mean
STEP_MAXIMA = ("is_weight_max",)


def mismatch_kl(old_logprobs: np.ndarray, rollout_logprobs: np.ndarray) -> float:
    """k3 estimate of KL(rollout || trainer) over the response tokens sampled by the rollout:
    with ``d = old_logp - rollout_logp``, ``mean(exp(d) - d - 1)`` (0 when there are none)."""
    d = old_logprobs.astype(np.float64) - rollout_logprobs.astype(np.float64)
    return float(np.mean(np.expm1(d) - d)) if d.size else 0.0


def train(cfg: DictConfig, plan: Plan, debug: bool = False, overwrite: bool = False) -> dict:
    """Run ``cfg``. The output folder is locked for the run's lifetime (one run per folder); a run
    that starts fresh into a folder holding a run is refused, unless ``overwrite``: the old run is
    then moved aside (see chatlearn.runtime.output_dir)."""
    rt, p = cfg.runtime_args, cfg.models.policy
    started, started_wall = time.monotonic(), time.time()
    check_start(cfg, overwrite)  # before loading anything: refusals come first
    tokenizer = load_tokenizer(p.load, trust_remote_code=p.trust_remote_code, key="models.policy.load")
    # multi-turn: the environment, tools and chat template are set up first; the prompts show the tools
    multi_turn = MultiTurnRollout(cfg, tokenizer) if p.multi_turn.environment is not None else None
    data = dict(max_prompt_tokens=p.max_prompt_tokens_length, enable_thinking=p.enable_thinking,
                prompt_key=rt.prompt_key, ground_truth_key=rt.ground_truth_key,
                ground_truth_pattern=rt.ground_truth_pattern, prompt_instruction=rt.prompt_instruction,
                tools=multi_turn.tool_schemas if multi_turn is not None else None)
    train_set = load_prompts(rt.data_path.split(","), tokenizer, name=rt.data_subset, split=rt.data_split, **data)
    eval_set = None
    if rt.eval_data_path and (rt.eval_episode_interval > 0 or rt.enable_eval_before_training):
        eval_set = load_prompts(rt.eval_data_path.split(","), tokenizer, what="runtime_args.eval_data_path",
                                name=rt.eval_data_subset, split=rt.eval_data_split, **data)
    with RunLock(rt.output_dir) as lock:
        # validated: only now is anything in output_dir touched
        if not rt.enable_resume_training:
            found = previous_run(rt.output_dir)
            if found and not overwrite:
                raise output_refusal(rt.output_dir, found)
            if found:
                moved = move_aside(cfg, lock)
                print(f"[chatlearn] --overwrite: moved the previous run in {rt.output_dir} to {moved}", flush=True)
        else:
            reconcile_logs(cfg)
        write_config_yaml(cfg, os.path.join(rt.output_dir, "config.yaml"))
        attach_logs(rt.output_dir)  # third-party logs (chatlearn run): <output_dir>/logs/
        for name, s in (("train", train_set), ("eval", eval_set)):
            if s is not None:
                print(f"[chatlearn] {name} data: {len(s)} prompts"
                      + (f" ({s.dropped_too_long} dropped: longer than max_prompt_tokens_length)"
                         if s.dropped_too_long else ""), flush=True)
        for line in plan.describe():
            print(f"[chatlearn] {line}", flush=True)
        with Cluster(cfg, plan) as cluster:
            run = GRPO(cfg, plan, cluster, tokenizer, train_set, eval_set, multi_turn)
            try:
                last = run.train()
            finally:
                if run.pipeline is not None:
                    run.pipeline.close()
                run.progress.close()
                run.metrics.close()
                run.timeline.close()
            # the plots read the finished files: they are drawn while Ray's processes stop
            plots = threading.Thread(target=plot_after_run, args=(rt.output_dir,), name="plots", daemon=True)
            plots.start()
        plots.join()
    print_run_summary(rt.output_dir, time.monotonic() - started, started_wall)
    return last


def print_run_summary(out: str, seconds: float, since: float) -> None:
    """The end of a run on the console (:func:`chatlearn.logging.metrics.run_summary`): how it went,
    where the time went, and where its outputs are."""
    from chatlearn.logging.plots import read_metrics

    try:
        rows = read_metrics(out)
    except UserError:  # no row written (an interrupted start)
        rows = []
    outputs = {}
    for label, name in (("metrics", "metrics.jsonl"), ("checkpoints", "checkpoints"), ("plots", "plots"),
                        ("samples", "samples.jsonl"), ("eval samples", os.path.join("eval", "samples.jsonl")),
                        ("logs", "logs")):
        path = os.path.join(out, name)
        if os.path.exists(path):
            outputs[label] = path + (os.sep if os.path.isdir(path) else "")
    for line in run_summary(rows, seconds, since, outputs):
        print(line, flush=True)
