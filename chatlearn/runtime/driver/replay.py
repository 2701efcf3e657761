"""``runtime_args.max_replay_episode``: an episode trains on its own samples and on those of up to
``max_replay_episode`` earlier episodes (0: its own only; -1: all earlier episodes), ChatLearn's
replay of episodes. The earlier samples keep what they were trained with: their old and reference
log-probs and advantages from their own episode."""
from __future__ import annotations

import os

import numpy as np

from chatlearn.batch import check, columns, concat_batches, select_samples

FILE = "replay.npz"


class ReplayBuffer:
    """``keys``: the batch columns an earlier episode's samples keep (the algorithm's
    ``replay_columns``: what its optimizer steps read)."""

    def __init__(self, max_replay_episode: int, keys: tuple[str, ...]):
        self.max_replay_episode = max_replay_episode
        self.episodes: list[dict] = []  # oldest first, the training columns of each kept episode
        self.keys = keys

    def training_batch(self, batch: dict) -> dict:
        """The current episode's training fields, after those of the kept earlier episodes."""
        own = columns(batch, self.keys)
        return concat_batches(self.episodes + [own]) if self.episodes else own

    def add(self, batch: dict) -> None:
        """Keep the current episode's samples for the episodes that follow."""
        if self.max_replay_episode == 0:
            return
        n = len(batch["prompt_lens"])
        self.episodes.append(select_samples(columns(batch, self.keys), range(n)))
        if self.max_replay_episode > 0:
            self.episodes = self.episodes[-self.max_replay_episode:]

    def save(self, folder: str) -> None:
        """Write the kept episodes into a checkpoint folder (nothing when there are none)."""
        if self.episodes:
            np.savez(os.path.join(folder, FILE),
                     **{f"{i}/{k}": v for i, ep in enumerate(self.episodes) for k, v in ep.items()})

    def load(self, folder: str) -> None:
        """Restore the kept episodes from a checkpoint folder (none when it holds none)."""
        self.episodes = []
        path = os.path.join(folder, FILE)
        if self.max_replay_episode == 0 or not os.path.exists(path):
            return
        with np.load(path) as data:
            count = 1 + max(int(name.split("/")[0]) for name in data.files)
            for i in range(count):
                self.episodes.append({k.split("/", 1)[1]: data[k] for k in data.files
                                      if k.split("/")[0] == str(i)})
                check(self.episodes[-1])  # the columns chatlearn.batch declares
        if self.max_replay_episode > 0:
            self.episodes = self.episodes[-self.max_replay_episode:]
