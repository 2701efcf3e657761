"""Sampling and scoring, shared by training and evaluation-only runs."""
from __future__ import annotations

import numpy as np

from chatlearn.models.base import concat_batches, select_samples


class Rollouts:
    """Needs ``cfg``, ``tokenizer``, ``policy`` (rollout group) and ``reward`` (reward group)."""

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

    def score(self, batch: dict, truths: list[str], sources: list[str], texts: list[str] | None = None
              ) -> np.ndarray:
        texts = self.responses_text(batch) if texts is None else texts
        shares = np.array_split(np.arange(len(texts)), len(self.reward))
        outs, _ = self.reward.call_each("score", [([texts[i] for i in s], [truths[i] for i in s],
                                                   [sources[i] for i in s]) for s in shares])
        return np.concatenate(outs).astype(np.float32)
