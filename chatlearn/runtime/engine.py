"""The GRPO episode loop.

One episode, in the order the code runs it:

1. rollout: the policy engine samples ``num_inference_per_prompt`` responses per prompt;
2. reward: CPU workers score them;
3. reference log-probs (ref_policy);
4. old log-probs (policy_trainer), group-relative advantages, optimizer steps;
5. weight push: the rollout engine wakes its weights, receives the new ones, then its KV cache.

The order is chosen to minimise turns on shared devices: the reference model runs before the
trainer so that the trainer, once resident for its old log-probs, stays resident to train; and the
rollout engine, resident after the push, stays resident for evaluation and the next rollout.
With full colocation that is four turns per episode (policy -> ref -> trainer -> policy weights
-> policy KV cache).
"""
from __future__ import annotations

import os
import shutil
import time

import numpy as np
import ray
from omegaconf import DictConfig, OmegaConf

from chatlearn.algorithms.grpo import group_advantages
from chatlearn.config.plan import Plan
from chatlearn.data.dataset import PromptSampler, PromptSet, load_prompts
from chatlearn.logging.metrics import MetricsWriter, summary_line
from chatlearn.models.base import concat_batches, response_mask, select_samples
from chatlearn.runtime.cluster import Cluster
from chatlearn.runtime.scheduler import MODEL_PARTS, Scheduler, Timeline, movable_parts


class GRPO:
    """Holds the models and data of a run; ``train()`` runs the episodes."""

    def __init__(self, cfg: DictConfig, plan: Plan, cluster: Cluster, tokenizer, train_set: PromptSet,
                 eval_set: PromptSet | None):
        self.cfg, self.plan, self.tokenizer = cfg, plan, tokenizer
        self.train_set, self.eval_set = train_set, eval_set
        rt, m = cfg.runtime_args, cfg.models
        self.out = rt.output_dir
        self.timeline = Timeline(os.path.join(self.out, "timeline.jsonl"))
        self.sched = Scheduler(plan, {}, {}, self.timeline)
        # Build each model, then let it leave the devices it shares, so the next one has room.
        # The rollout engine comes last: it sizes its KV cache from the memory left free.
        for name in ("policy_trainer", "ref_policy", "reward", "policy"):
            group = cluster.create(name)
            self.sched.groups[name] = group
            if name == "reward":
                continue
            self.sched.movable[name] = movable_parts(name, m[name].free_gpu_memory)
            self.sched.resident[name] = set(MODEL_PARTS[name])
            if plan.colocated_with(name) and name != "policy":
                self.sched.offload(name, self.sched.movable[name])
        self.policy, self.trainer = self.sched.groups["policy"], self.sched.groups["policy_trainer"]
        self.ref, self.reward = self.sched.groups["ref_policy"], self.sched.groups["reward"]
        self.sampler = PromptSampler(len(train_set), shuffle=rt.data_shuffle, seed=rt.seed)
        self.metrics = MetricsWriter(self.out)

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict:
        rt = self.cfg.runtime_args
        last: dict = {}
        if rt.enable_eval_before_training and self.eval_set is not None:
            last = self.evaluate()
            self.log(0, last)
        for episode in range(1, rt.num_episode + 1):
            self.timeline.episode = episode
            metrics = self.episode(episode)
            final = episode == rt.num_episode
            if self.eval_set is not None and rt.eval_episode_interval > 0 and (
                    episode % rt.eval_episode_interval == 0 or final):
                metrics.update(self.evaluate())
            self.log(episode, metrics)
            last = metrics
        return last

    def episode(self, episode: int) -> dict:
        cfg, plan, n = self.cfg, self.plan, self.plan.group_size
        p, t = cfg.models.policy, cfg.models.policy_trainer
        timer = StageTimer(self.sched)
        start = time.perf_counter()

        # 1. rollout: sample n responses for each prompt
        idx = self.sampler.next(plan.prompts_per_episode)
        prompts = [self.train_set.prompt_ids[i] for i in idx for _ in range(n)]
        truths = [self.train_set.ground_truths[i] for i in idx for _ in range(n)]
        sources = [self.train_set.data_sources[i] for i in idx for _ in range(n)]
        with timer("policy", "generate"):
            self.sched.ensure("policy", ["weights", "kv_cache"])
            batch = self.generate(prompts, self.sampling(eval_mode=False, seed=p.seed + episode))

        # 2. reward (CPU workers)
        with timer("reward", "reward"):
            rewards = self.score(batch, truths, sources)

        # 3. reference log-probs; before the trainer so the trainer stays resident to train
        temperature = self.train_temperature
        with timer("ref_policy", "ref_logprobs"):
            self.sched.ensure("ref_policy", ["weights"])
            batch["ref_logprobs"] = self.logprobs(self.ref, batch, temperature)

        # 4. old log-probs, advantages, optimizer steps
        with timer("policy_trainer", "old_logprobs"):
            self.sched.ensure("policy_trainer", ["weights"])
            batch["old_logprobs"] = self.logprobs(self.trainer, batch, temperature)
        batch["advantages"] = group_advantages(rewards, n).astype(np.float32)
        with timer("policy_trainer", "train"):
            self.sched.ensure("policy_trainer", ["weights", "optimizer", "grads"])
            step_metrics = self.optimize(batch)
            if self.should_save(episode):
                self.save_hf(episode)

        # 5. new weights into the rollout engine: its weights first, the push, then its KV cache
        with timer("policy", "weight_push"):
            self.sched.ensure("policy", ["weights"], keep={"policy_trainer": ["weights"]})
            self.push_weights()
            self.sched.ensure("policy", ["kv_cache"])

        metrics = {f"train/{k}": v for k, v in step_metrics.items()}
        metrics.update(self.rollout_metrics(batch, rewards, prefix="train"))
        mask = response_mask(batch)
        diff = np.abs(batch["rollout_logprobs"][mask] - batch["old_logprobs"][mask])
        metrics["train/logprob_diff_rollout_vs_trainer_mean"] = float(diff.mean()) if diff.size else 0.0
        metrics["train/logprob_diff_rollout_vs_trainer_max"] = float(diff.max()) if diff.size else 0.0
        metrics.update(timer.totals())
        metrics["time/episode"] = time.perf_counter() - start
        return metrics

    # ------------------------------------------------------------------ stages
    @property
    def train_temperature(self) -> float:
        """Log-probs are taken under the sampling distribution's temperature (1 for greedy)."""
        t = self.cfg.models.policy.temperature
        return t if t > 0 else 1.0

    def sampling(self, eval_mode: bool, seed: int) -> dict:
        p = self.cfg.models.policy
        pre = "eval_" if eval_mode else ""
        return {"temperature": p[pre + "temperature"], "top_p": p[pre + "top_p"], "top_k": p[pre + "top_k"],
                "max_tokens": p.max_response_tokens_length, "seed": seed}

    def generate(self, prompts: list[list[int]], sampling: dict) -> dict:
        """Spread the prompts over the rollout replicas and reassemble the batch in prompt order.

        With ``data_rerank`` the samples of one prompt go to different replicas (round robin), so a
        replica's share mixes prompts; otherwise each replica gets a contiguous slice.
        """
        replicas = len(self.policy)
        order = np.arange(len(prompts))
        if self.cfg.runtime_args.data_rerank:
            shares = [order[r::replicas] for r in range(replicas)]
        else:
            shares = np.array_split(order, replicas)
        args = [([prompts[i] for i in share], {**sampling, "seed": sampling["seed"] * 1000 + r})
                for r, share in enumerate(shares)]
        outs, _ = self.policy.call_each("generate", args)
        batch = concat_batches([o for o, s in zip(outs, shares) if len(s)])
        position = np.concatenate(shares)
        return select_samples(batch, np.argsort(position))

    def responses_text(self, batch: dict) -> list[str]:
        off, plen, tokens = batch["offsets"], batch["prompt_lens"], batch["tokens"]
        return self.tokenizer.batch_decode([tokens[off[i] + plen[i]:off[i + 1]] for i in range(len(plen))],
                                           skip_special_tokens=True)

    def score(self, batch: dict, truths: list[str], sources: list[str]) -> np.ndarray:
        texts = self.responses_text(batch)
        shares = np.array_split(np.arange(len(texts)), len(self.reward))
        outs, _ = self.reward.call_each("score", [([texts[i] for i in s], [truths[i] for i in s],
                                                   [sources[i] for i in s]) for s in shares])
        return np.concatenate(outs).astype(np.float32)

    def logprobs(self, group, batch: dict, temperature: float) -> np.ndarray:
        ref = ray.put({k: batch[k] for k in ("tokens", "offsets", "prompt_lens")})
        outs, _ = group.call("compute_logprobs", ref, temperature)
        return outs[0]

    def optimize(self, batch: dict) -> dict:
        """``sample_per_episode / train_global_batch_size`` optimizer steps (times num_training_epoch)."""
        plan = self.plan
        keys = ("tokens", "offsets", "prompt_lens", "old_logprobs", "ref_logprobs", "advantages")
        sums: dict[str, float] = {}
        steps = 0
        for _ in range(self.cfg.runtime_args.num_training_epoch):
            for s in range(0, plan.samples_per_episode, plan.samples_per_step):
                sub = select_samples({k: batch[k] for k in keys}, range(s, s + plan.samples_per_step))
                outs, _ = self.trainer.call("train", ray.put(sub), self.train_temperature)
                for k, v in outs[0].items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                steps += 1
        return {k: v / steps for k, v in sums.items()}

    def push_weights(self) -> None:
        bucket_mb = self.cfg.runtime_args.coalesced_buffer_mb
        refs = [a.value.remote("export_weights", bucket_mb) for a in self.trainer.actors]
        # rank 0 holds the full weights; the rollout replicas read them from the object store
        ray.get([a.call_per_item.remote("update_weights", refs[0]) for a in self.policy.actors])
        ray.get(refs)

    def should_save(self, episode: int) -> bool:
        rt = self.cfg.runtime_args
        return episode == rt.num_episode or (rt.save_episode_interval > 0 and episode % rt.save_episode_interval == 0)

    def save_hf(self, episode: int) -> None:
        """Write ``<output_dir>/checkpoints/hf/episode_N`` atomically (a temporary folder, then a rename)."""
        final = os.path.join(self.out, "checkpoints", "hf", f"episode_{episode}")
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.trainer.call("save_hf", os.path.abspath(tmp))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)

    def evaluate(self) -> dict:
        p = self.cfg.models.policy
        k = p.eval_num_inference_per_prompt
        es = self.eval_set
        prompts = [ids for ids in es.prompt_ids for _ in range(k)]
        truths = [g for g in es.ground_truths for _ in range(k)]
        sources = [s for s in es.data_sources for _ in range(k)]
        start = time.perf_counter()
        self.sched.ensure("policy", ["weights", "kv_cache"])
        batch = self.generate(prompts, self.sampling(eval_mode=True, seed=p.seed))
        rewards = self.score(batch, truths, sources)
        metrics = self.rollout_metrics(batch, rewards, prefix="eval")
        for src in sorted(set(sources)):
            sel = np.array([s == src for s in sources])
            metrics[f"eval/{src}/reward_mean"] = float(rewards[sel].mean())
        metrics["time/eval"] = time.perf_counter() - start
        self.sched.stage("policy", "eval", metrics["time/eval"])
        return metrics

    @staticmethod
    def rollout_metrics(batch: dict, rewards: np.ndarray, prefix: str) -> dict:
        resp = (batch["offsets"][1:] - batch["offsets"][:-1]) - batch["prompt_lens"]
        return {f"{prefix}/reward_mean": float(rewards.mean()), f"{prefix}/reward_std": float(rewards.std()),
                f"{prefix}/response_len_mean": float(resp.mean()),
                f"{prefix}/truncated_frac": float(1.0 - batch["finish_reasons"].mean())}

    def log(self, episode: int, metrics: dict) -> None:
        self.metrics.write(episode, metrics)
        print(summary_line(episode, self.cfg.runtime_args.num_episode, metrics), flush=True)


class StageTimer:
    """Times stages (``time/<stage>``) and the turns inside them (``time/transitions``)."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self._totals: dict[str, float] = {}
        self._mark = len(sched.timeline.events)

    def __call__(self, model: str, stage: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.start = time.perf_counter()

            def __exit__(self, *exc):
                seconds = time.perf_counter() - self.start
                timer._totals[f"time/{stage}"] = timer._totals.get(f"time/{stage}", 0.0) + seconds
                timer.sched.stage(model, stage, seconds)

        return _Ctx()

    def totals(self) -> dict:
        events = [e for e in self.sched.timeline.events[self._mark:] if e["kind"] == "transition"]
        out = dict(self._totals)
        out["time/transitions"] = sum(e["seconds"] for e in events)
        out["sched/transitions"] = len(events)
        out["sched/bytes_moved"] = sum(e["bytes"] for e in events)
        return out


def train(cfg: DictConfig, plan: Plan, debug: bool = False) -> dict:
    from transformers import AutoTokenizer

    rt, p = cfg.runtime_args, cfg.models.policy
    os.makedirs(rt.output_dir, exist_ok=True)
    OmegaConf.save(cfg, os.path.join(rt.output_dir, "config.yaml"))
    tokenizer = AutoTokenizer.from_pretrained(p.load, trust_remote_code=p.trust_remote_code)
    data = dict(max_prompt_tokens=p.max_prompt_tokens_length, enable_thinking=p.enable_thinking)
    train_set = load_prompts(rt.data_path.split(","), tokenizer, **data)
    eval_set = None
    if rt.eval_data_path and (rt.eval_episode_interval > 0 or rt.enable_eval_before_training):
        eval_set = load_prompts(rt.eval_data_path.split(","), tokenizer, what="runtime_args.eval_data_path", **data)
    for name, s in (("train", train_set), ("eval", eval_set)):
        if s is not None:
            print(f"[chatlearn] {name} data: {len(s)} prompts"
                  + (f" ({s.dropped_too_long} dropped: longer than max_prompt_tokens_length)"
                     if s.dropped_too_long else ""), flush=True)
    for line in plan.describe():
        print(f"[chatlearn] {line}", flush=True)
    with Cluster(cfg, plan) as cluster:
        run = GRPO(cfg, plan, cluster, tokenizer, train_set, eval_set)
        try:
            last = run.train()
        finally:
            run.metrics.close()
            run.timeline.close()
    print(f"[chatlearn] done: metrics in {os.path.join(rt.output_dir, 'metrics.jsonl')}, "
          f"checkpoints in {os.path.join(rt.output_dir, 'checkpoints', 'hf')}", flush=True)
    return last
