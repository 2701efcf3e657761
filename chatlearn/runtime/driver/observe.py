"""What an episode reports of its samples, beside the stages' times (:mod:`.instrument`): the rollouts'
and rewards' metrics, how far the rollout engine's log-probs are from the trainer's, the trainer's
log-prob pass statistics, and the sample rows logged every ``log_samples_interval`` episodes. These
read what the stages produced; no stage computes them."""
from __future__ import annotations

import collections

import numpy as np

from chatlearn.algorithms.advantages import ROLLOUT_MISMATCH, response_mask
from chatlearn.batch import select_samples
from chatlearn.logging.console import warn
from chatlearn.data.vision import image_names
from chatlearn.models.moe.layout import layout_of_folder
from chatlearn.runtime.driver.multiturn import TOKEN_LIMIT, env_metrics, trajectory_fields
from chatlearn.runtime.driver.sampling import EpisodeSamples, Sampling

# what a logged sample row reads of a batch (with the env/ columns of a multi-turn one)
SAMPLE_ROW_KEYS = ("tokens", "offsets", "prompt_lens", "finish_reasons", "loss_mask")


def mismatch_kl(old_logprobs: np.ndarray, rollout_logprobs: np.ndarray) -> float:
    """k3 estimate of KL(rollout || trainer) over the response tokens sampled by the rollout:
    with ``d = old_logp - rollout_logp``, ``mean(exp(d) - d - 1)`` (0 when there are none)."""
    d = old_logprobs.astype(np.float64) - rollout_logprobs.astype(np.float64)
    return float(np.mean(np.expm1(d) - d)) if d.size else 0.0


def rollout_metrics(batch: dict, rewards: np.ndarray, prefix: str) -> dict:
    """``<prefix>/reward_mean``, ``reward_std``, ``response_len_mean``, ``truncated_frac``."""
    resp = (batch["offsets"][1:] - batch["offsets"][:-1]) - batch["prompt_lens"]
    return {f"{prefix}/reward_mean": float(rewards.mean()), f"{prefix}/reward_std": float(rewards.std()),
            f"{prefix}/response_len_mean": float(resp.mean()),
            f"{prefix}/truncated_frac": float(1.0 - batch["finish_reasons"].mean())}


def mismatch_metrics(batch: dict, pass_from: int, first_step: dict) -> dict:
    """How far the rollout engine's log-probs are from the trainer's before the update, over every
    response token: the old-log-prob pass's tokens (samples ``pass_from`` on), and the first
    optimizer step's as its own forward reported them (``first_step``: its :data:`ROLLOUT_MISMATCH`
    sums)."""
    mask = response_mask(batch)
    cut = min(pass_from, len(batch["prompt_lens"]))
    mask[:batch["offsets"][cut]] = False
    d = batch["old_logprobs"][mask].astype(np.float64) - batch["rollout_logprobs"][mask].astype(np.float64)
    own = dict.fromkeys(ROLLOUT_MISMATCH, 0.0)  # the first step's sums (none without it)
    if cut:
        own.update(first_step)
    count = d.size + own["rollout_tokens"]
    total = float(np.abs(d).sum()) + own["rollout_diff_sum"]
    kl = (mismatch_kl(batch["old_logprobs"][mask], batch["rollout_logprobs"][mask]) * d.size
          + own["rollout_kl_sum"])
    top = max(float(np.abs(d).max()) if d.size else 0.0, own["rollout_diff_max"])
    return {"train/logprob_diff_rollout_vs_trainer_mean": total / count if count else 0.0,
            "train/logprob_diff_rollout_vs_trainer_max": top,
            "train/mismatch_kl": kl / count if count else 0.0}


class EpisodeReport:
    """The metrics and sample rows of an episode's samples (see the module docstring)."""

    def __init__(self, cfg, plan, sampling: Sampling, sinks, trainer_group):
        self.cfg, self.plan, self.sampling, self.sinks, self.trainer = cfg, plan, sampling, sinks, trainer_group
        self.warned_truncated = False  # an episode whose every response was cut: warned once per run
        # each reward function's count of training episodes in a row in which it scored every sample alike;
        # those already warned about (once per run)
        self.constant_streaks: dict[str, int] = collections.defaultdict(int)
        self.warned_constant: set[str] = set()
        # a mixture-of-experts policy: the rollout-vs-trainer gap is reported as train/moe/logprob_gap too
        load = cfg.models.policy_trainer.load if cfg is not None else None
        self.moe = bool(load) and layout_of_folder(str(load)) is not None

    def log_samples(self, episode: int, samples: EpisodeSamples) -> None:
        """Every ``log_samples_interval`` episodes, ``log_samples_num`` decoded rows to the sinks
        (samples.jsonl, TensorBoard, W&B); decoding only, no random number drawn."""
        la = self.cfg.runtime_args.log_args_dict
        if la.log_samples_interval > 0 and episode % la.log_samples_interval == 0:
            p = samples.prompts
            self.sinks.write_samples(episode, self.sample_rows(samples.batch, samples.scored.rewards, p.truths,
                                                               p.sources, la.log_samples_num, p.images))

    def sample_rows(self, batch: dict, rewards: np.ndarray, truths: list, sources: list[str], k: int,
                    images: list | None = None) -> list[dict]:
        """``k`` of the episode's samples as rows (decoded prompt and response, reward, ...): one
        response of each of the first prompts, then second responses, so the rows spread over the
        groups. Only reads the batch; no random number is drawn. ``images``: each sample's image references
        (prompts with images), named in the row (``images``: their paths)."""
        n = self.plan.group_size
        groups = len(rewards) // n
        picks = [g * n + j for j in range(n) for g in range(groups)][:k]
        chosen = select_samples({key: batch[key] for key in batch if key in SAMPLE_ROW_KEYS or key.startswith("env/")},
                                picks)
        lens = np.diff(chosen["offsets"]) - chosen["prompt_lens"]
        tokenizer = self.sampling.tokenizer
        return [{"sample": i, "prompt": p, "response": r, "reward": float(rewards[i]),
                 "ground_truth": truths[i] if isinstance(truths[i], (str, int, float, bool)) or truths[i] is None
                 else str(truths[i]),
                 "data_source": sources[i], "response_tokens": int(n_tok), "finished": bool(done),
                 **trajectory_fields(tokenizer, chosen, j),
                 **({"images": image_names(images[i])} if images is not None else {})}
                for j, (i, p, r, n_tok, done) in enumerate(zip(
                    picks, self.sampling.prompts_text(chosen), self.sampling.responses_text(chosen), lens,
                    chosen["finish_reasons"]))]

    def metrics(self, episode: int, samples: EpisodeSamples, first_step: dict) -> dict:
        """The rollouts' and rewards' ``train/`` metrics, the trainer's log-prob pass statistics, and
        how far the rollout engine's log-probs are from the trainer's (warned past
        ``models.policy.logprob_mismatch_warn``; ``first_step``: what the first optimizer step's own
        forward measured of it)."""
        batch, scored = samples.batch, samples.scored
        metrics = {f"perf/logprob_{k}": v for k, v in self.trainer.call("logprob_stats")[0][0].items()}
        metrics.update(rollout_metrics(batch, scored.rewards, prefix="train"))
        metrics.update(self.sampling.reward_metrics(scored.parts, prefix="train"))
        if "old_logprobs" in batch:  # (algorithm: gkd takes none: its loss reads no old log-probs)
            metrics.update(mismatch_metrics(batch, self.plan.old_logprob_pass_from, first_step))
        if (self.moe or "routed_experts" in batch) and "old_logprobs" in batch:  # with routing replay on and off alike (README: both)
            metrics["train/moe/logprob_gap"] = metrics["train/logprob_diff_rollout_vs_trainer_mean"]
        metrics.update(env_metrics(batch, prefix="train"))
        self.warn_all_truncated(episode, batch)
        self.warn_constant_rewards(episode, scored.parts)
        warn_at = self.cfg.models.policy.logprob_mismatch_warn
        if warn_at > 0 and "old_logprobs" in batch and metrics["train/logprob_diff_rollout_vs_trainer_mean"] > warn_at:
            warn(f"episode {episode}: rollout and trainer log-probs differ by "
                 f"{metrics['train/logprob_diff_rollout_vs_trainer_mean']:.4f} nats per token on average "
                 f"(models.policy.logprob_mismatch_warn: {warn_at:g}; mismatch KL "
                 f"{metrics['train/mismatch_kl']:.2e}): the rollout engine samples from a different "
                 "distribution than the trainer (dtype, kernels, or a failed weight push)")
        return metrics

    def warn_all_truncated(self, episode: int, batch: dict) -> None:
        """Warn, the first time only, of an episode whose every response was cut at its token limit
        before it ended (a multi-turn one: every trajectory ended by ``token_limit``)."""
        if self.warned_truncated:
            return
        multi_turn = "env/status" in batch
        cut = (np.asarray(batch["env/status"]) == TOKEN_LIMIT) if multi_turn else ~np.asarray(
            batch["finish_reasons"], dtype=bool)
        if not cut.size or not cut.all():
            return
        self.warned_truncated = True
        longest = self.cfg.models.policy.max_response_tokens_length
        what = (f"trajectories ran out of tokens (models.policy.max_response_tokens_length {longest}, or "
                "multi_turn.max_turn_tokens)" if multi_turn else
                f"responses was cut at models.policy.max_response_tokens_length ({longest})")
        warn(f"episode {episode}: every one of the {cut.size} {what} before it ended (train/truncated_frac 1): "
             "the rewards score unfinished answers, often all alike, and the policy learns little or nothing "
             "(equal rewards in a group give zero advantages). Raise the limit, or ask the prompts for shorter "
             "answers. (Warned once per run.)")

    def warn_constant_rewards(self, episode: int, parts: dict[str, np.ndarray]) -> None:
        """Warn, once per run for each, of a reward function that gave every sample of
        ``runtime_args.max_constant_reward_episodes`` training episodes in a row the same score (``parts``:
        the episode's per-function outputs by ``"<name>/<key>"``): a reward without signal. Equal rewards
        within a group are normal; the same score for the whole episode, episode after episode, is not."""
        limit = self.cfg.runtime_args.max_constant_reward_episodes
        if limit <= 0:
            return
        for key, values in parts.items():
            name, _, part = key.partition("/")
            if part != "score":
                continue
            values = np.asarray(values)
            constant = values.size > 1 and bool(np.all(values == values[0]))
            self.constant_streaks[name] = self.constant_streaks[name] + 1 if constant else 0
            if self.constant_streaks[name] < limit or name in self.warned_constant:
                continue
            self.warned_constant.add(name)
            warn(f"episode {episode}: reward function {name!r} (models.reward.functions) gave every sample the same "
                 f"score, {float(values[0]):g}, in {limit} training episodes in a row (episodes {episode - limit + 1}"
                 f"-{episode}, {values.size} samples in this one): a reward without signal, which adds nothing to "
                 "the advantages (the only reward: every advantage is 0 and the policy learns nothing). Check that it "
                 "reads the responses and ground truths as they are (an answer format it does not parse, ground "
                 "truths of another form; samples.jsonl shows both), or that the prompts are neither too hard nor "
                 "too easy for the model. "
                 f"(runtime_args.max_constant_reward_episodes: {limit}; warned once per run.)")

    def evaluation(self, batch: dict, prompts, rewards: np.ndarray, parts: dict) -> dict:
        """``eval/`` metrics of an evaluation set's samples, overall and per data source."""
        metrics = rollout_metrics(batch, rewards, prefix="eval")
        metrics.update(self.sampling.reward_metrics(parts, prefix="eval"))
        metrics.update(env_metrics(batch, prefix="eval"))
        for src in sorted(set(prompts.sources)):
            sel = np.array([s == src for s in prompts.sources])
            metrics[f"eval/{src}/reward_mean"] = float(rewards[sel].mean())
        return metrics
