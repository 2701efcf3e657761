"""The reward models' turns: each model of kind ``reward_model`` scores every sample, on its devices.

A run may hold any number of reward models (``models.reward.load``'s ``reward_model``, and each
``models.<name>`` of kind ``reward_model``). In an episode each takes its turn in config order (the
scheduler makes it resident, offloading what shares its devices), scores the episode's conversations,
and its score, normalised by its ``normalize`` and times its ``weight``, is added to the reward
functions' reward. Each reports its own metrics: ``<train|eval>/reward_model/<name>/*``
(``reward_model``'s, ChatLearn's one reward model, keep their names ``<train|eval>/reward_model/*``).
"""
from __future__ import annotations

import contextlib

import numpy as np

from chatlearn.calls import put
from chatlearn.config.kinds import REWARD_MODEL, reward_model_settings
from chatlearn.config.names import Stage
from chatlearn.errors import UserError
from chatlearn.runtime.driver.sampling import Prompts, Sampling, Scored, whiten


def metric_prefix(prefix: str, name: str, family: str = "reward_model") -> str:
    """Where reward model ``name``'s metrics go: ``train/reward_model/`` for ``reward_model``,
    ``train/reward_model/<name>/`` for one of the user's naming (``family`` judge: ``train/judge/<name>/``)."""
    return f"{prefix}/{family}/" + ("" if name == REWARD_MODEL.default_model else f"{name}/")


class RewardModels:
    """The run's reward models (``names``, in config order) and how their scores join the reward."""

    def __init__(self, cfg, names: list[str], groups: dict, sampling: Sampling, sched):
        self.settings = {name: reward_model_settings(cfg, name) for name in names}
        self.others: dict = {}
        self.groups, self.sampling, self.sched = groups, sampling, sched

    def __bool__(self) -> bool:
        return bool(self.settings)

    def score_all(self, batch: dict, prompts: Prompts, run=None) -> dict[str, np.ndarray]:
        """Every reward model's raw score of each sample (float32 [N]), each in its turn (a ``run`` times the
        turns as the ``reward_model`` stage of each model)."""
        scores = {}
        for name in self.settings:
            with run.stage(Stage.REWARD_MODEL, name) if run is not None else contextlib.nullcontext():
                self.sched.take_turn(name)
                outs, _ = self.groups[name].call("score", put(self.sampling.conversations(batch, prompts)))
                scores[name] = np.asarray(outs[0], np.float32)
        return scores

    def add(self, scored: Scored, scores: dict[str, np.ndarray], prefix: str = "train",
            normalize: bool = True, others: dict | None = None) -> tuple[Scored, dict]:
        """``scored`` with each model's score added: ``weight`` x the score, normalised by its ``normalize``
        (none; batch: whitened over the batch, zero mean and unit std) unless not ``normalize`` (an
        evaluation: whitened, every evaluation's mean would be 0), added to the rewards and the shaped
        rewards. Returns it and each model's metrics (:func:`metric_prefix`; also, as every reward source's,
        ``<prefix>/reward/<name>/score``: the raw score's mean, and ``.../reward``: what it adds, on average).
        ``others``: the settings of scoring models that are not reward models (the judges, by name)."""
        added_all = np.zeros(len(scored.rewards), np.float64)
        metrics, adds = {}, {}
        for name, raw in scores.items():
            s = self.settings[name] if name in self.settings else others[name]
            raw = np.asarray(raw, np.float64)
            norm = raw
            if s.normalize == "batch" and normalize:
                norm = whiten(raw)
            adds[name] = added = s.weight * norm
            added_all = added_all + added
            where = metric_prefix(prefix, name, "reward_model" if name in self.settings else "judge")
            metrics.update({f"{where}{k}": v for k, v in (
                ("score_mean", float(raw.mean())), ("score_std", float(raw.std())), ("score_min", float(raw.min())),
                ("score_max", float(raw.max())), ("reward_mean", float(added.mean())))})
            metrics.update({f"{prefix}/reward/{name}/score": float(raw.mean()),
                            f"{prefix}/reward/{name}/reward": float(added.mean())})
        total = np.asarray(scored.rewards, np.float64) + added_all
        self.others = others or {}
        self.check_float32(total, adds)
        return Scored(total.astype(np.float32), scored.parts,
                      np.asarray(scored.shaped, np.float64) + added_all), metrics

    def check_float32(self, total: np.ndarray, adds: dict[str, np.ndarray]) -> None:
        """A sample's reward ``total`` (float64) past float32's largest number, the dtype rewards are trained
        in (it would become inf), is a UserError naming the reward model whose weighted score (``adds``)
        is the largest there."""
        with np.errstate(over="ignore"):
            over = np.flatnonzero(~np.isfinite(total.astype(np.float32)))
        if not over.size:
            return
        i = int(over[0])
        name = max(adds, key=lambda n: abs(float(adds[n][i])))
        s = self.settings[name] if name in self.settings else self.others[name]
        raise UserError(
            f"{'reward model' if name in self.settings else 'judge'} {name!r} adds {float(adds[name][i]):.6g} ({s.weight_key} {s.weight:g} x its score) to "
            f"the reward of sample {i}, which becomes "
            f"{total[i]:.6g}, past float32's largest number ({float(np.finfo(np.float32).max):.4g}), the dtype "
            "rewards are trained in: it would become inf, so the run stops before anything is trained on it. "
            f"Lower {s.weight_key}, or have the model's scores whitened (normalize: batch).")
