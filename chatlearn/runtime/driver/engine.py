"""The episode engine: runs an algorithm's stages through the residency scheduler.

One episode, in the order :meth:`Engine.episode` runs it (the algorithm, :mod:`.algorithm`, says what
its passes, advantages and trained models are; the engine knows none by name):

1. generate: the rollout engine samples ``num_inference_per_prompt`` responses per prompt (with
   dynamic sampling, scored and sampled again until enough groups have unequal rewards);
2. reward: CPU workers score them, while
3. the algorithm's forward passes (GRPO: the reference log-probs, then the old log-probs) run, a
   pass beside the others when its model shares no devices with a trained model;
4. advantages, then the optimizer steps of each trained model;
5. checkpoint (every ``save_episode_interval`` episodes), then the weight push: the rollout engine
   wakes its weights, receives the new ones, then its KV cache. The checkpoint is committed once the
   episode's evaluation and metrics row are written (:meth:`RunCheckpoints.commit`).

The order is chosen to minimise turns on shared devices: the reference model runs before the
trainer so that the trainer, once resident for its old log-probs, stays resident to train; and the
rollout engine, resident after the push, stays resident for evaluation and the next rollout.
Measurement (stage times, turns, throughput, overhead: :mod:`.instrument`) wraps the stages, and
the episode's metrics of its samples are reported by :mod:`.observe`; neither is code inside a stage.

With ``runtime_args.max_staleness`` = k > 0 (the rollout on devices of its own) steps 1-2 of the
next k episodes run on a rollout thread while the driver runs steps 3-5 of the current one
(:mod:`chatlearn.runtime.driver.overlap`): the push waits for the generate call in flight, and
episode n trains on samples of weight version n-1-k.
"""
from __future__ import annotations

import contextlib
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from omegaconf import DictConfig

from chatlearn.batch import check
from chatlearn.config.kinds import section
from chatlearn.config.names import Part, Stage
from chatlearn.config.plan import Plan
from chatlearn.data.dataset import PromptSampler, PromptSet
from chatlearn.logging.console import info
from chatlearn.logging.metrics import summary_line
from chatlearn.logging.perf import peak_memory
from chatlearn.logging.progress import RunProgress
from chatlearn.logging.sinks import MetricSinks, config_yaml
from chatlearn.logging.startup import clock
from chatlearn.runtime.cluster.cluster import Cluster
from chatlearn.runtime.cluster.watchdog import Watchdog
from chatlearn.runtime.driver.algorithm import Algorithm, ModelCalls, Pass, StepLoop, make_algorithm
from chatlearn.runtime.driver.checkpoints import RunCheckpoints
from chatlearn.runtime.driver.dynamic import dynamic_sampling
from chatlearn.runtime.driver.instrument import EpisodeRun, Instrument
from chatlearn.runtime.driver.landing import LandingCheck, probe_tokens
from chatlearn.runtime.driver.multiturn import MultiTurnLoop
from chatlearn.runtime.driver.observe import EpisodeReport
from chatlearn.runtime.driver.overlap import RolloutPipeline
from chatlearn.runtime.driver.replay import ReplayBuffer
from chatlearn.runtime.driver.judges import ScoringModels
from chatlearn.runtime.driver.sampling import EpisodeSamples, Prompts, Sampling, Scored
from chatlearn.runtime.driver.scheduler import Scheduler, Timeline, movable_parts
from chatlearn.runtime.weight_push.driver import WeightPush


class Engine:
    """Holds the models and data of a run; ``train()`` runs the episodes."""

    def __init__(self, cfg: DictConfig, plan: Plan, cluster: Cluster, tokenizer, train_set: PromptSet,
                 eval_set: PromptSet | None, multi_turn: MultiTurnLoop | None = None):
        self.cfg, self.plan = cfg, plan
        self.train_set, self.eval_set = train_set, eval_set
        rt, m = cfg.runtime_args, cfg.models
        self.out = rt.output_dir
        self.timeline = Timeline(os.path.join(self.out, "timeline.jsonl"))
        self.sched = Scheduler(plan, self.timeline, offload_without_gpu=rt.offload_without_gpu,
                               watchdog=Watchdog(rt.stage_timeout_s, unwatched=[
                                   n for n in plan.kinds if plan.kind(n).own_deadline]))
        groups = build_models(cfg, plan, cluster, self.sched)
        self.sampling = Sampling(cfg, tokenizer, groups["policy"], groups["reward"], cluster.specs["reward"],
                                 multi_turn)
        self.reward_models = ScoringModels(cfg, plan, groups, self.sampling, self.sched)  # reward models, judges
        self.progress = RunProgress(rt.num_episode)
        self.instrument = Instrument(self.sched, self.progress, rt.num_training_epoch)
        calls = ModelCalls(self.sched, train_temperature(cfg))
        self.algorithm: Algorithm = make_algorithm(cfg, plan, calls, StepLoop(cfg, plan, calls, self.progress))
        self.sampler = PromptSampler(len(train_set), shuffle=rt.data_shuffle, seed=rt.seed)
        # earlier episodes' samples to train on again, with the columns the algorithm trains on
        self.replay = ReplayBuffer(rt.max_replay_episode, self.algorithm.replay_columns)
        self.metrics = MetricSinks(cfg)
        self.report = EpisodeReport(cfg, plan, self.sampling, self.metrics, groups["policy_trainer"])
        self.weight_push: WeightPush | None = None  # set up on the first push
        # runtime_args.weight_push_check: every push is checked to have landed (chatlearn/runtime/driver/landing.py)
        self.landing = (LandingCheck(probe_tokens(train_set.prompt_ids[0] if len(train_set) else [],
                                                  len(tokenizer), m.policy.max_prompt_tokens_length),
                                     plan.trainer_dp, rt.weight_push_check_tolerance, m.policy.load, rt.rollout_backend)
                        if rt.weight_push_check else None)
        # runtime_args.max_staleness > 0: the rollouts of the next episodes run beside training
        self.pipeline = (RolloutPipeline(plan.max_staleness, lambda episode: self.next_prompts(), self.produce,
                                          lambda rows: Prompts.of(self.train_set, rows, self.plan.group_size))
                         if plan.max_staleness > 0 else None)
        # the config every checkpoint records (as config.yaml, secrets masked)
        self.checkpoints = RunCheckpoints(cfg, plan, self.sched, self.algorithm.trained, self.replay, self.pipeline,
                                          self.sampler, config_yaml(cfg))

    # ------------------------------------------------------------------ the loop
    def train(self, on_resumed: Callable[[], None] | None = None) -> dict:
        rt = self.cfg.runtime_args
        last: dict = {}
        startup = clock()
        start = self.resume() + 1 if rt.enable_resume_training else 1
        if on_resumed is not None:  # the checkpoint loaded: what the run records of a resume (config.yaml)
            on_resumed()
        if start > 1:
            startup.mark("resume")
        if start == 1 and rt.enable_eval_before_training and self.eval_set is not None:
            self.progress.begin(0)
            last = self.evaluate()
            self.log(0, last)
            startup.mark("eval_before")
        for episode in range(start, rt.num_episode + 1):
            metrics = self.episode(episode)
            if episode == start:  # where this process's start-up went, up to its first episode's end
                startup.mark("first_episode")
                metrics.update(startup.metrics())
                info(startup.line())
            final = episode == rt.num_episode
            if self.eval_set is not None and rt.eval_episode_interval > 0 and (
                    episode % rt.eval_episode_interval == 0 or final):
                metrics.update(self.evaluate())
            self.log(episode, metrics)
            self.checkpoints.commit()  # the episode's checkpoint and its metrics row: one unit
            last = metrics
        return last

    def episode(self, episode: int) -> dict:
        """One episode, stage by stage in the order it runs (see the module docstring); ``run``
        measures the stages, ``self.sched`` makes each model resident before it runs."""
        run = self.instrument.begin(episode)
        ahead = self.pipeline is not None  # generated and scored on the rollout thread (max_staleness)
        with run.stage(Stage.GENERATE, "policy") if not ahead else contextlib.nullcontext():
            samples = self.generate(episode)
        if self.cfg.runtime_args.dynamic_sampling:  # scored now: the rewards choose the groups that fill the batch
            samples = dynamic_sampling(run, episode, samples, self.sampling, self.next_prompts, self.cfg, self.plan)
        batch = samples.batch
        passes = self.algorithm.passes()
        # The reward workers (CPU) score beside the forward passes; a pass whose model shares no
        # devices with a trained model runs beside the others too. The reward models score first,
        # each taking its turn on its devices.
        with _closing(ThreadPoolExecutor(max_workers=1 + len(passes))) as pool:
            scoring = None if samples.scored is not None else run.background(
                pool, Stage.REWARD, "reward", self.sampling.scored, batch, samples.prompts,
                f"the rollouts of episode {episode}")
            model_scores = self.reward_models.score_all(batch, samples.prompts, run)
            started = [(p, self.start_pass(p, batch, run, pool)) for p in passes]
            for p, result in started:
                batch[p.column] = result.result()
            if scoring is not None:
                samples.scored = scoring.result()
        if model_scores:  # each model's score, weighted, added to the functions' rewards
            samples.scored, rm_metrics = self.reward_models.add(samples.scored, model_scores)
            samples.metrics.update(rm_metrics)

        metrics = {**samples.metrics, **self.algorithm.advantages(batch, samples.scored)}
        check(batch)  # every column the stages wrote is declared, of its kind and length (chatlearn.batch)
        self.report.log_samples(episode, samples)  # before the checkpoint, which keeps them
        train_batch = self.replay.training_batch(batch)
        first_steps = {}
        trains = self.algorithm.trains(episode)
        for model in trains:
            with run.stage(Stage.TRAIN, model):
                self.sched.take_turn(model)
                trained = self.algorithm.train(model, train_batch, episode)
            metrics.update(trained.metrics)
            first_steps[model] = trained.first_step
        self.replay.add(batch)  # before the checkpoint, which keeps it for the episodes that follow
        if self.checkpoints.due(episode):  # the last trained model is still resident with its optimizer state
            with run.stage(Stage.CHECKPOINT, trains[-1]):
                self.checkpoints.save(episode)

        # new weights into the rollout engine: its weights first, the push, then its KV cache (an episode
        # that left the policy as it was, a critic warm-up, pushes nothing)
        if "policy_trainer" in trains:
            with run.stage(Stage.WEIGHT_PUSH, "policy"):
                metrics.update(self.push_weights(f"after episode {episode}"))
        self.sched.ensure("policy", [Part.KV_CACHE])
        policy_first = first_steps["policy_trainer"] if "policy_trainer" in first_steps else {}  # not in warm-up
        metrics.update(self.report.metrics(episode, samples, policy_first))
        return run.finish(metrics, batch, samples.generated_tokens)

    # ------------------------------------------------------------------ stages
    def generate(self, episode: int) -> EpisodeSamples:
        """The episode's samples: generated now (``scored`` None: the reward stage runs beside the
        passes), or with ``max_staleness`` taken from the rollout pipeline, scored, with the staleness
        and overlap metrics (launching the rollouts ahead first)."""
        if self.pipeline is None:
            prompts = self.next_prompts()
            return EpisodeSamples(prompts, self.sample_episode(episode, prompts))
        self.pipeline.fill(episode, self.cfg.runtime_args.num_episode)
        self.progress.stage(Stage.GENERATE)
        ready, metrics = self.pipeline.take(episode, trainer_version=episode - 1)
        for stage, model in ((Stage.GENERATE, "policy"), (Stage.REWARD, "reward")):
            if f"time/{stage}" in metrics:  # timed on the rollout thread
                self.sched.stage(model, stage, metrics[f"time/{stage}"])
        return EpisodeSamples(ready.prompts, ready.batch, ready.scored, metrics)

    def produce(self, episode: int, prompts: Prompts) -> tuple:
        """Episode ``episode``'s samples and their (shaped) rewards, on the rollout thread: the
        generate call of the on-policy run (its seed), then scoring. Returns ``(batch, scored, seconds)``."""
        start = time.perf_counter()
        batch = self.sample_episode(episode, prompts)
        mid = time.perf_counter()
        scored = self.sampling.scored(batch, prompts, f"the rollouts of episode {episode}")
        return batch, scored, {"time/generate": mid - start, "time/reward": time.perf_counter() - mid}

    def sample_episode(self, episode: int, prompts: Prompts) -> dict:
        """The episode's samples (seed ``models.policy.seed + episode``), or the data's responses (gkd_lambda < 1)."""
        if self.algorithm.data_responses(episode):
            return self.sampling.references(prompts)
        self.sched.ensure("policy", [Part.WEIGHTS, Part.KV_CACHE])
        seed = self.cfg.models.policy.seed + episode
        return self.sampling.sample(prompts, self.sampling.params(eval_mode=False, seed=seed),
                                    f"the rollouts of episode {episode}", episode=episode)

    def next_prompts(self) -> Prompts:
        """The episode's prompts from the sampler, each repeated for its group of responses."""
        return Prompts.of(self.train_set, self.sampler.next(self.plan.prompts_per_episode), self.plan.group_size)

    def start_pass(self, p: Pass, batch: dict, run: EpisodeRun, pool: ThreadPoolExecutor) -> Future:
        """Pass ``p`` over ``batch``: computed now when its model is trained or shares devices with a
        trained model (the order of the passes then decides the turns), else started on ``pool`` to
        run beside the next ones. Returns a Future of the column."""
        trained = self.algorithm.trained
        if p.model in trained or any(m in trained for m in self.plan.colocated_with(p.model)):
            done: Future = Future()
            with run.stage(p.stage, p.model) if p.timed else contextlib.nullcontext():
                done.set_result(p.compute(batch))
            return done
        return pool.submit(run.timed, p.model, p.stage, p.compute, batch)

    def push_weights(self, when: str) -> dict:
        """Wake the rollout engine's weights (the trainer's stay beside them) and stream the trainer's
        weights into every rollout replica (``WeightPush``: buckets, transport chosen by placement,
        set up on the first push); returns ``sync/*`` metrics. The KV cache is woken after it. With
        ``runtime_args.weight_push_check`` the push is checked to have landed (:class:`LandingCheck`:
        the trainer's probe before the push, the replicas' once their KV cache is back); ``when``
        names the push in its error."""
        if self.pipeline is not None:  # the rollout engine changes weights between generate calls, never in one
            self.pipeline.drain()
        self.sched.ensure("policy_trainer", [Part.WEIGHTS])  # resident already, unless another trained model ran last
        expected = self.landing.trainer_side(self.sched.groups["policy_trainer"]) if self.landing else None
        self.sched.ensure("policy", [Part.WEIGHTS], keep={"policy_trainer": [Part.WEIGHTS]})
        if self.weight_push is None:
            self.weight_push = WeightPush(self.sched.groups["policy_trainer"], self.sched.groups["policy"],
                                          self.plan, self.cfg)
        pushed = self.weight_push.push()
        if self.landing is not None:
            self.sched.ensure("policy", [Part.KV_CACHE])
            pushed.update(self.landing.rollout_side(self.sched.groups["policy"], expected, when))
        if self.pipeline is not None:
            self.pipeline.pushed()
        return pushed

    def resume(self) -> int:
        """Continue from the newest complete checkpoint (:meth:`RunCheckpoints.restore`), its weights pushed
        into the rollout engine; returns its episode (0: none)."""
        found = self.checkpoints.restore()
        if found is None:
            return 0
        episode, path = found
        self.push_weights(f"on resuming from {path}")  # the rollout engine still holds the initial weights
        if self.pipeline is not None:
            self.pipeline.load(path)
            self.pipeline.pushed(version=episode)
        self.sched.ensure("policy", [Part.KV_CACHE])
        # rows a crashed run wrote past the checkpoint (also dropped before the run started, see
        # reconcile_logs; atomic, and a torn last row goes with them)
        self.metrics.truncate_after(episode)
        return episode

    # ------------------------------------------------------------------ evaluation and logging
    def evaluate(self) -> dict:
        p = self.cfg.models.policy
        prompts = Prompts.of(self.eval_set, range(len(self.eval_set)), p.eval_num_inference_per_prompt)
        start = time.perf_counter()
        self.progress.stage(Stage.EVAL)
        self.sched.ensure("policy", [Part.WEIGHTS, Part.KV_CACHE])
        batch = self.sampling.sample(prompts, self.sampling.params(eval_mode=True, seed=p.seed), "the evaluation set")
        rewards, reward_parts = self.sampling.score(batch, prompts.truths, prompts.sources, prompts.extra,
                                                    what="the evaluation set")
        model_metrics = {}
        if self.reward_models:  # the reward is the training reward: the models' scores too
            scored, model_metrics = self.reward_models.add(
                Scored(rewards, reward_parts, rewards), self.reward_models.score_all(batch, prompts), prefix="eval",
                normalize=False)
            rewards = scored.rewards
        metrics = {**self.report.evaluation(batch, prompts, rewards, reward_parts), **model_metrics}
        metrics["time/eval"] = time.perf_counter() - start
        self.instrument.stage(Stage.EVAL, "policy", metrics["time/eval"])
        return metrics

    def log(self, episode: int, metrics: dict) -> None:
        with self.sched.watchdog.watch("all models", "peak memory", call=True):  # asks every worker
            metrics = {**metrics, **peak_memory(self.sched.groups), **self.sched.take_gpu_peaks()}
        self.metrics.write(episode, metrics)
        self.progress.finish(episode, summary_line(episode, self.cfg.runtime_args.num_episode, metrics))

    def close(self) -> None:
        """Stop the rollout thread and close the progress display and the run's files."""
        self.sched.watchdog.close()
        if self.pipeline is not None:
            self.pipeline.close()
        self.progress.close()
        self.metrics.close()
        self.timeline.close()


def build_models(cfg, plan: Plan, cluster: Cluster, sched: Scheduler) -> dict:
    """Build every placed model, each once the models before it have left the devices they share with it,
    in the order of their kinds (the rollout engine last: it sizes its KV cache from the memory left
    free); returns the scheduler's worker groups by model."""
    order = sorted(plan.placements, key=lambda n: plan.kind(n).build_rank)
    cluster.prestart(order)  # every process starts now; the models are built in turn below
    for name in order:
        parts = plan.kind(name).parts
        movable = movable_parts(parts, cfg.models[section(name)].free_gpu_memory) if parts else ()
        sched.add(name, lambda name=name: cluster.create(name), movable)
    return sched.groups


def train_temperature(cfg) -> float:
    """Log-probs are taken under the sampling distribution's temperature (1 for greedy)."""
    t = cfg.models.policy.temperature
    return t if t > 0 else 1.0


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
