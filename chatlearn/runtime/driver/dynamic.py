"""DAPO's dynamic sampling (``runtime_args.dynamic_sampling``): the generate stage scores the groups it
sampled and samples more until enough of them have unequal rewards."""
from __future__ import annotations

from typing import Callable

from chatlearn.algorithms.advantages import fill_groups, loss_token_counts, varied_groups
from chatlearn.batch import concat_batches, select_samples
from chatlearn.config.names import Stage
from chatlearn.logging.console import warn
from chatlearn.runtime.driver.sampling import EpisodeSamples, Prompts, Sampling, Scored

# round k of an episode samples with seed + episode + k * this stride
DYNAMIC_SAMPLING_SEED_STRIDE = 100_003


def dynamic_sampling(run, episode: int, first: EpisodeSamples, sampling: Sampling, draw: Callable[[], Prompts],
                     cfg, plan) -> EpisodeSamples:
    """Score the episode's groups, and while fewer than ``prompts_per_episode`` of the groups drawn
    have unequal (shaped) rewards, draw that many prompts more (``draw()``) and sample them, for at
    most ``dynamic_sampling_max_rounds`` rounds; the batch is the kept groups in the order they were
    drawn, filled with the earliest equal-reward groups when the rounds ran out
    (:func:`chatlearn.algorithms.advantages.fill_groups`). Round k samples with seed
    ``seed + episode + k * DYNAMIC_SAMPLING_SEED_STRIDE``; the sampler's position, saved with each
    checkpoint, includes every prompt drawn, so a resumed run draws what the uninterrupted one did.
    ``run``: the episode's measurements (each round's generate and reward stages are timed)."""
    g, needed = plan.group_size, plan.prompts_per_episode
    what = f"the rollouts of episode {episode}"
    rounds: list[tuple[EpisodeSamples, object]] = []
    kept = 0
    samples = first
    while True:
        with run.stage(Stage.REWARD, "reward"):
            samples.scored = sampling.scored(samples.batch, samples.prompts, what)
        varied = varied_groups(samples.scored.shaped, g)
        rounds.append((samples, varied))
        kept += int(varied.sum())
        if kept >= needed or len(rounds) >= cfg.runtime_args.dynamic_sampling_max_rounds:
            break
        prompts = draw()
        seed = cfg.models.policy.seed + episode + len(rounds) * DYNAMIC_SAMPLING_SEED_STRIDE
        with run.stage(Stage.GENERATE, "policy"):
            batch = sampling.sample(prompts, sampling.params(eval_mode=False, seed=seed),
                                    f"{what} (dynamic sampling round {len(rounds) + 1})", episode=episode)
        samples = EpisodeSamples(prompts, batch)
    if not kept:
        warn_no_varied_group(episode, len(rounds), needed, g)
    chosen = fill_groups([varied for _, varied in rounds], needed)
    parts = []
    for k, (s, _) in enumerate(rounds):
        groups = [grp for kk, grp in chosen if kk == k]
        if groups:
            idx = [grp * g + j for grp in groups for j in range(g)]
            parts.append((select_samples(s.batch, idx), s.prompts.select(idx), s.scored.select(idx)))
    drawn = len(rounds) * needed
    metrics = {"train/dynamic_sampling_rounds": float(len(rounds)),
               "train/dynamic_sampling_prompts_drawn": float(drawn),
               "train/dynamic_sampling_kept_frac": kept / drawn,
               "train/dynamic_sampling_filled_groups": float(max(needed - kept, 0))}
    return EpisodeSamples(
        prompts=Prompts.join([p for _, p, _ in parts]),
        batch=concat_batches([b for b, _, _ in parts]) if len(parts) > 1 else parts[0][0],
        scored=Scored.join([sc for _, _, sc in parts]), metrics=metrics,
        generated_tokens=sum(int(loss_token_counts(s.batch).sum()) for s, _ in rounds))  # the model's tokens


def warn_no_varied_group(episode: int, rounds: int, prompts: int, group_size: int) -> None:
    """The warning for an episode in which dynamic sampling found no group of unequal rewards in its
    ``rounds`` rounds (of ``prompts`` prompts x ``group_size`` responses each)."""
    warn(f"episode {episode}: dynamic sampling found no group of unequal rewards in {rounds} rounds "
         f"(runtime_args.dynamic_sampling_max_rounds; {rounds * prompts} prompts x {group_size} responses): every "
         "group's responses were rewarded alike, so the episode trains on groups whose advantages are all 0 and the "
         "policy learns nothing from it (train/dynamic_sampling_kept_frac 0). Check the reward functions and the "
         "data's ground truths (samples.jsonl shows both), or whether the prompts are all too hard or too easy for "
         "the model; raising runtime_args.dynamic_sampling_max_rounds draws more prompts per episode.")
