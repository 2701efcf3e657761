"""Sampling and scoring, shared by training and evaluation-only runs."""
from __future__ import annotations

import numpy as np

from chatlearn.errors import UserError
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

    def prompts_text(self, batch: dict) -> list[str]:
        off, plen, tokens = batch["offsets"], batch["prompt_lens"], batch["tokens"]
        return self.tokenizer.batch_decode([tokens[off[i]:off[i] + plen[i]] for i in range(len(plen))],
                                           skip_special_tokens=True)

    def score(self, batch: dict, truths: list, sources: list[str], extra: list[dict], texts: list[str] | None = None
              ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Rewards of the samples (the weighted sum of the reward functions) and each function's
        per-sample outputs by ``"<name>/<key>"``; the reward workers take contiguous shares."""
        texts = self.responses_text(batch) if texts is None else texts
        prompts = self.prompts_text(batch)
        shares = [s for s in np.array_split(np.arange(len(texts)), len(self.reward)) if len(s)]
        outs, _ = self.reward.call_each("score", [([prompts[i] for i in s], [texts[i] for i in s],
                                                   [truths[i] for i in s], [sources[i] for i in s],
                                                   [extra[i] for i in s]) for s in shares])
        rewards = np.concatenate([o["score"] for o in outs]).astype(np.float32)
        for o in outs[1:]:
            odd = set(o["metrics"]) ^ set(outs[0]["metrics"])
            if odd:
                raise UserError(f"reward function {sorted(odd)[0].split('/')[0]!r} (models.reward.functions) "
                                "returned different dict keys for different batches. Return the same keys for "
                                "every batch.")
        parts = {k: np.concatenate([o["metrics"][k] for o in outs]) for k in outs[0]["metrics"]}
        return rewards, parts

    @staticmethod
    def reward_metrics(parts: dict[str, np.ndarray], prefix: str) -> dict:
        """``<prefix>/reward/<name>/<key>``: the mean over the samples of each reward function's output."""
        return {f"{prefix}/reward/{k}": float(v.mean()) for k, v in parts.items()}
