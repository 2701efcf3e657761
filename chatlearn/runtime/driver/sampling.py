"""Sampling and scoring, shared by training and evaluation-only runs: the prompts of a generate call
(:class:`Prompts`), the rollout replicas' and reward workers' calls (:class:`Sampling`), and what an
episode's samples are once scored (:class:`Scored`, :class:`EpisodeSamples`)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

from chatlearn.algorithms.advantages import overlong_penalty
from chatlearn.batch import concat_batches, select_samples
from chatlearn.calls import put
from chatlearn.data.vision import VisionProcessor, decode_image
from chatlearn.errors import UserError
from chatlearn.runtime.cluster.group import CallTimeout
from chatlearn.runtime.cluster.local import died_errors, kill
from chatlearn.runtime.driver.multiturn import prompt_messages


@dataclass(frozen=True)
class Prompts:
    """Prompts to sample, one entry per sample (each prompt repeated for its ``k`` samples): token
    ids, ground truths, data sources, the rows' other columns and their chat messages."""

    ids: list
    truths: list
    sources: list
    extra: list
    indices: Optional[list] = None  # the prompt set's rows these came from, once each (None: not from one)
    messages: Optional[list] = None  # the rows' chat messages (what a multi-turn environment's reset sees)
    # the rows' images (chatlearn.data.vision references; the samples of a prompt hold the same list), None: text
    images: Optional[list] = None
    # the rows' reference responses (token ids; PromptSet.responses: algorithm gkd with gkd_lambda < 1), None: none
    responses: Optional[list] = None

    @classmethod
    def of(cls, prompt_set, indices: Iterable[int], k: int) -> "Prompts":
        """Prompts ``indices`` of ``prompt_set`` (a :class:`~chatlearn.data.dataset.PromptSet`), each
        ``k`` times in a row."""
        indices = [int(i) for i in indices]
        rows = [i for i in indices for _ in range(k)]
        return cls(ids=[prompt_set.prompt_ids[i] for i in rows], truths=[prompt_set.ground_truths[i] for i in rows],
                   sources=[prompt_set.data_sources[i] for i in rows], extra=[prompt_set.extras[i] for i in rows],
                   indices=indices, messages=[prompt_set.messages[i] for i in rows] if prompt_set.messages else None,
                   images=[prompt_set.images[i] for i in rows] if prompt_set.images else None,
                   responses=[prompt_set.responses[i] for i in rows] if prompt_set.responses else None)

    def select(self, idx: list) -> "Prompts":
        """The entries ``idx``, in that order (no prompt set rows)."""
        return Prompts(ids=[self.ids[i] for i in idx], truths=[self.truths[i] for i in idx],
                       sources=[self.sources[i] for i in idx], extra=[self.extra[i] for i in idx],
                       messages=None if self.messages is None else [self.messages[i] for i in idx],
                       images=None if self.images is None else [self.images[i] for i in idx])

    @classmethod
    def join(cls, parts: list) -> "Prompts":
        """The entries of ``parts``, one after the other (no prompt set rows)."""
        fields = {f: sum((getattr(p, f) for p in parts), []) for f in ("ids", "truths", "sources", "extra")}
        messages = None if any(p.messages is None for p in parts) else sum((p.messages for p in parts), [])
        images = None if all(p.images is None for p in parts) else sum(
            (p.images if p.images is not None else [[] for _ in p.ids] for p in parts), [])
        return cls(**fields, messages=messages, images=images)


def float32_rewards(total: np.ndarray, weighted: list[np.ndarray], entries: list[dict], what: str) -> np.ndarray:
    """The samples' rewards ``total`` (float64) in float32, the dtype they are trained in. A total past
    float32's largest number (a finite float64 that would become inf) is a UserError naming the
    reward function whose weighted score (``weighted[f]``, of ``entries[f]``) does not fit, or the sum
    when none alone overflows, and the sample (``what``: the batch)."""
    with np.errstate(over="ignore"):
        rewards = total.astype(np.float32)
        over = np.flatnonzero(~np.isfinite(rewards))
        if not over.size:
            return rewards
        i = int(over[0])
        culprit = next((f for f, w in enumerate(weighted) if not np.isfinite(np.float32(w[i]))), None)
    count = f" ({over.size} of the {len(total)} samples overflow)" if over.size > 1 else ""
    if culprit is not None:
        entry = entries[culprit]
        head = (f"reward function {entry['name']!r} (models.reward.functions[{culprit}], {entry['path']!r}) gave "
                f"sample {i} of {what} the reward {weighted[culprit][i]:.6g} (its score x weight "
                f"{float(entry['weight']):g}){count}")
        fix = f"or lower models.reward.functions[{culprit}].weight"
    else:
        each = ", ".join(f"{e['name']!r} {w[i]:.6g}" for e, w in zip(entries, weighted))
        head = (f"the reward of sample {i} of {what} is {total[i]:.6g}{count}, the sum of the reward functions' "
                f"weighted scores ({each or 'none'}) and the environment's reward where there is one")
        fix = "or lower their weights (models.reward.functions[i].weight)"
    raise UserError(f"{head}, which is past float32's largest number ({float(np.finfo(np.float32).max):.4g}), the "
                    "dtype rewards are trained in: it would become inf, so the run stops before anything is trained "
                    f"on it. Return rewards of a smaller scale (clip or rescale them), {fix}.")


def whiten(raw: np.ndarray) -> np.ndarray:
    """``(raw - mean) / (std + 1e-6)`` over the batch (population std); zeros for one sample. Every scoring source's
    ``normalize: batch`` (reward functions, reward models, judges)."""
    raw = np.asarray(raw, np.float64)
    return (raw - raw.mean()) / (raw.std() + 1e-6) if len(raw) > 1 else raw * 0.0


def normalized(weighted: list[np.ndarray], entries: list[dict], parts: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Each reward function's contribution: ``weight x whiten(score)`` for ``normalize: batch`` (its raw score is
    ``parts["<name>/score"]``), else as it came (``weight x score``)."""
    return [float(e["weight"]) * whiten(parts[f"{e['name']}/score"]) if e["normalize"] == "batch" else w
            for w, e in zip(weighted, entries)]


def reference_batch(prompt_ids: list, responses: list, max_tokens: int) -> dict:
    """A batch of the given prompts and responses (token ids) as a generate call's: ``tokens``, ``offsets``,
    ``prompt_lens`` and ``finish_reasons`` (0 for a response cut to ``max_tokens``, else 1); no log-probs (nothing
    sampled them)."""
    cut = [list(r[:max_tokens]) for r in responses]
    seqs = [list(p) + r for p, r in zip(prompt_ids, cut, strict=True)]
    offsets = np.zeros(len(seqs) + 1, np.int64)
    np.cumsum([len(s) for s in seqs], out=offsets[1:])
    return {"tokens": np.fromiter((t for s in seqs for t in s), np.int64, int(offsets[-1])), "offsets": offsets,
            "prompt_lens": np.asarray([len(p) for p in prompt_ids], np.int64),
            "finish_reasons": np.asarray([len(r) <= max_tokens for r in responses], np.int8)}


@dataclass(frozen=True)
class Scored:
    """The rewards of a batch's samples: ``rewards`` (the reward functions' weighted sum, float32 [N]),
    ``parts`` (each function's per-sample outputs by ``"<name>/<key>"``) and ``shaped`` (what the
    advantages and dynamic sampling read: ``rewards`` plus DAPO's overlong penalty where it is on)."""

    rewards: np.ndarray
    parts: dict
    shaped: np.ndarray

    def select(self, idx: list) -> "Scored":
        return Scored(self.rewards[idx], {k: v[idx] for k, v in self.parts.items()}, self.shaped[idx])

    @classmethod
    def join(cls, parts: list["Scored"]) -> "Scored":
        return cls(np.concatenate([p.rewards for p in parts]),
                   {k: np.concatenate([p.parts[k] for p in parts]) for k in parts[0].parts},
                   np.concatenate([p.shaped for p in parts]))


@dataclass
class EpisodeSamples:
    """What the generate stage hands to the rest of an episode: the prompts, the batch (see
    :mod:`chatlearn.batch`), their rewards (None until the reward stage has run), the generate stage's
    own metrics, and the response tokens generated when more were generated than the batch holds
    (dynamic sampling)."""

    prompts: Prompts
    batch: dict
    scored: Optional[Scored] = None
    metrics: dict = field(default_factory=dict)
    generated_tokens: Optional[int] = None


class Sampling:
    """The calls that sample and score: ``policy`` (the rollout group), ``reward`` (the reward group),
    ``reward_spec`` (the :class:`~chatlearn.models.specs.RewardSpec` the reward workers were built from)
    and ``multi_turn`` (a :class:`~chatlearn.runtime.driver.multiturn.MultiTurnLoop`, or None: single-turn)."""

    def __init__(self, cfg, tokenizer, policy, reward, reward_spec, multi_turn=None):
        self.cfg, self.tokenizer, self.multi_turn = cfg, tokenizer, multi_turn
        self._processor = None  # a vision-language model's image processor, loaded with the first images
        self.policy, self.reward, self.reward_spec = policy, reward, reward_spec

    def sample(self, prompts: Prompts, sampling: dict, what: str, episode: int | None = None) -> dict:
        """The samples of ``prompts``: one response each, or with a multi-turn environment one trajectory
        each (:class:`~chatlearn.runtime.driver.multiturn.MultiTurnLoop`; ``what`` names them in its warnings,
        ``episode`` is the training episode they are of, None for an evaluation)."""
        if self.multi_turn is None:
            return self.generate(prompts.ids, sampling, prompts.images)
        return self.multi_turn.run(self.generate, prompts, sampling, what, episode=episode)

    def references(self, prompts: Prompts) -> dict:
        """The batch of ``prompts`` with their reference responses (the data's, :func:`reference_batch`) in place of
        sampled ones, each cut to ``models.policy.max_response_tokens_length`` as a sample would be; a prompt's images
        processed as for the rollout."""
        if prompts.responses is None:
            raise ValueError("these prompts carry no reference responses (load_prompts(..., responses=True))")
        batch = reference_batch(prompts.ids, prompts.responses, self.cfg.models.policy.max_response_tokens_length)
        if prompts.images is not None and any(prompts.images):
            batch["images"] = self.vision_inputs(prompts.images)
        return batch

    def params(self, eval_mode: bool, seed: int) -> dict:
        """The sampling parameters of a generate call: the ``eval_*`` ones for evaluation."""
        p = self.cfg.models.policy
        pre = "eval_" if eval_mode else ""
        return {"temperature": p[pre + "temperature"], "top_p": p[pre + "top_p"], "top_k": p[pre + "top_k"],
                "presence_penalty": p[pre + "presence_penalty"],
                "frequency_penalty": p[pre + "frequency_penalty"],
                "repetition_penalty": p[pre + "repetition_penalty"],
                "max_tokens": p.max_response_tokens_length, "seed": seed}

    def generate(self, prompts: list[list[int]], sampling: dict, images: list | None = None) -> dict:
        """Spread the prompts over the rollout replicas and reassemble the batch in prompt order.

        With ``data_rerank`` the samples of one prompt go to different replicas (round robin), so a
        replica's share mixes prompts; otherwise each replica gets a contiguous slice. ``images``: each
        prompt's image references (:class:`Prompts`), None for text: decoded and processed once per prompt
        (:meth:`vision_inputs`), handed to the rollout with the prompts and kept as the batch's ``images``
        column (each sample's dict, the same object for the samples of one prompt) for the trainers.
        """
        vision = self.vision_inputs(images) if images is not None and any(images) else None
        replicas = len(self.policy)
        order = np.arange(len(prompts))
        if self.cfg.runtime_args.data_rerank:
            shares = [order[r::replicas] for r in range(replicas)]
        else:
            shares = np.array_split(order, replicas)
        args = [([prompts[i] for i in share], {**sampling, "seed": sampling["seed"] * 1000 + r})
                + (() if vision is None else ([vision[i] for i in share],)) for r, share in enumerate(shares)]
        outs, _ = self.policy.call_each("generate", args)
        batch = concat_batches([o for o, s in zip(outs, shares) if len(s)])
        self.check_routes(batch)
        position = np.concatenate(shares)
        batch = select_samples(batch, np.argsort(position))
        if vision is not None:
            batch["images"] = vision
        return batch

    def vision_inputs(self, images: list) -> list:
        """Each sample's ``{"pixel_values", "image_grid_thw"}`` (numpy; None for a sample without images) from
        its prompt's image references: every distinct reference list (one per prompt, shared by its samples) is
        decoded and processed once, and its samples get the same dict."""
        if self._processor is None:
            self._processor = VisionProcessor(self.cfg.models.policy.load)
        made: dict[int, dict | None] = {}
        out = []
        for refs in images:
            if id(refs) not in made:
                if not refs:
                    made[id(refs)] = None
                else:
                    found = self._processor.images([decode_image(r, "", "a prompt's image") for r in refs])
                    made[id(refs)] = {"pixel_values": np.asarray(found["pixel_values"], dtype=np.float32),
                                      "image_grid_thw": np.asarray(found["image_grid_thw"], dtype=np.int64)}
            out.append(made[id(refs)])
        return out

    def check_routes(self, batch: dict) -> None:
        """With ``routing_replay: rollout`` the rollout engine's batch carries ``routed_experts`` (the first
        generate call of the run finds out); a UserError naming the key and the fix otherwise."""
        if self.cfg.models.policy_trainer.routing_replay != "rollout" or "routed_experts" in batch:
            return
        if not len(batch["tokens"]):
            return
        backend = self.cfg.runtime_args.rollout_backend
        raise UserError(
            f"routing replay is on, but the rollout engine ({backend}) returned no routed experts (the batch's "
            "routed_experts column is missing), so the trainers cannot route the tokens to the experts the "
            "engine chose. The hf rollout records them on a Qwen3-MoE, Qwen2-MoE or Mixtral model; vLLM returns "
            "them only when started with enable_return_routed_experts, which vLLM 0.32 allows with its Model "
            "Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1) and prefix caching, on an MoE model; the SGLang rollout does "
            "not record them. Use the hf or vllm rollout on an MoE model, or set routing_replay: off.",
            key="models.policy_trainer.routing_replay")

    def responses_text(self, batch: dict) -> list[str]:
        off, plen, tokens = batch["offsets"], batch["prompt_lens"], batch["tokens"]
        return self.tokenizer.batch_decode([tokens[off[i] + plen[i]:off[i + 1]] for i in range(len(plen))],
                                           skip_special_tokens=True)

    def prompts_text(self, batch: dict) -> list[str]:
        off, plen, tokens = batch["offsets"], batch["prompt_lens"], batch["tokens"]
        return self.tokenizer.batch_decode([tokens[off[i]:off[i] + plen[i]] for i in range(len(plen))],
                                           skip_special_tokens=True)

    def score(self, batch: dict, truths: list, sources: list[str], extra: list[dict], texts: list[str] | None = None,
              what: str = "a batch", normalize: bool = False) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Rewards of the samples (the weighted sum of the reward functions, plus a multi-turn
        trajectory's environment reward ``env/reward``) and each function's per-sample outputs by
        ``"<name>/<key>"``; the reward workers take contiguous shares.

        The functions run one at a time on every worker (``RewardManager.score_one``, summed as
        ``RewardManager.score`` sums them), each within ``models.reward.timeout_s``: a worker that
        overruns is killed and the run stops with a UserError naming the function and the samples
        (``what``: the batch, e.g. "the rollouts of episode 3"). With ``normalize`` (training's samples), a
        function of ``normalize: batch`` adds ``weight x`` its score whitened over the batch (:func:`normalized`);
        an evaluation's scores are added as they are."""
        texts = self.responses_text(batch) if texts is None else texts
        prompts = self.prompts_text(batch)
        shares = [s for s in np.array_split(np.arange(len(texts)), len(self.reward)) if len(s)]
        batches = [put({"prompts": [prompts[i] for i in s], "responses": [texts[i] for i in s],
                            "ground_truths": [truths[i] for i in s], "data_sources": [sources[i] for i in s],
                            "extra": [extra[i] for i in s]}) for s in shares]
        entries = self.reward_spec.functions
        totals = [np.zeros(len(s), dtype=np.float64) for s in shares]
        outs = [{"metrics": {}} for _ in shares]
        weighted = []  # each function's weighted scores of every sample (float64)
        for f, entry in enumerate(entries):
            try:
                parts, _ = self.reward.call_each("score_one", [(f, b) for b in batches],
                                                 timeout=self.reward_spec.timeout_s or None)
            except CallTimeout as late:
                raise self.reward_timeout(late, f, entry, shares, len(texts), what) from None
            except died_errors() as died:  # the function ended the process: name it
                raise self.reward_worker_died(died, f, entry, what) from None
            weighted.append(np.concatenate([part["score"] for part in parts]))
            for total, out, part in zip(totals, outs, parts):
                total += part["score"]
                out["metrics"].update(part["metrics"])
        for o in outs[1:]:
            odd = set(o["metrics"]) ^ set(outs[0]["metrics"])
            if odd:
                raise UserError(f"reward function {sorted(odd)[0].split('/')[0]!r} (models.reward.functions) "
                                "returned different dict keys for different batches. Return the same keys for "
                                "every batch.")
        parts = {k: np.concatenate([o["metrics"][k] for o in outs]) for k in outs[0]["metrics"]}
        total = np.concatenate(totals)
        if normalize and any(e["normalize"] == "batch" for e in entries):
            weighted = normalized(weighted, entries, parts)
            total = np.zeros(len(texts), np.float64)
            for w in weighted:
                total = total + w
        if "env/reward" in batch:  # the environment's (discounted) reward of each trajectory
            total = total + np.asarray(batch["env/reward"], np.float64)
        return float32_rewards(total, weighted, entries, what), parts

    def scored(self, batch: dict, prompts: Prompts, what: str) -> Scored:
        """The samples' rewards (:meth:`score`), shaped: DAPO's overlong penalty
        (``models.reward.overlong_buffer_len``, :func:`chatlearn.algorithms.advantages.overlong_penalty`)
        added to the reward functions' total where it is on."""
        rewards, parts = self.score(batch, prompts.truths, prompts.sources, prompts.extra, None, what, normalize=True)
        r = self.cfg.models.reward
        if r.overlong_buffer_len <= 0:
            return Scored(rewards, parts, rewards)
        lens = np.diff(batch["offsets"]) - np.asarray(batch["prompt_lens"])
        penalty = overlong_penalty(lens, self.cfg.models.policy.max_response_tokens_length,
                                   r.overlong_buffer_len, r.overlong_penalty_factor)
        return Scored(rewards, parts, rewards.astype(np.float64) + penalty)

    def conversations(self, batch: dict, prompts: Prompts) -> list[list[dict]]:
        """Each sample as a conversation a reward model renders with its own chat template: the prompt's
        chat messages (a prompt given as text: one user message of the text the policy saw, its template
        left out), then the response as the assistant's message. A multi-turn trajectory's response is
        its text after the prompt, tool calls and observations included; its prompt is the first observation
        its environment's reset returned where it returned one (``env/prompt``: what the policy saw)."""
        responses = self.responses_text(batch)
        if prompts.messages is not None:
            heads = [list(m) for m in prompts.messages]
        else:
            heads = [[{"role": "user", "content": text}] for text in self.prompts_text(batch)]
        heads = [prompt_messages(batch, i) or head for i, head in enumerate(heads)]
        return [[*head, {"role": "assistant", "content": r}] for head, r in zip(heads, responses)]

    def reward_timeout(self, late: CallTimeout, index: int, entry: dict, shares: list[np.ndarray], n: int,
                       what: str) -> UserError:
        """The error for reward workers that did not return in time; they are killed (a running Python
        function cannot be stopped otherwise; the run's other actors go when the run stops)."""
        for w in late.stuck:
            kill(self.reward.actors[w])
        where = "; ".join(f"samples {int(shares[w][0])}-{int(shares[w][-1])} of {n} on reward worker {w}"
                          for w in late.stuck)
        return UserError(
            f"reward function {entry['name']!r} (models.reward.functions[{index}], {entry['path']!r}) did not "
            f"return within {late.timeout:g} s (models.reward.timeout_s) while scoring {what} ({where}), so the "
            "run stops; the stuck reward worker was killed. Make the function return sooner (give what it "
            "waits on a time limit of its own), or raise models.reward.timeout_s (0: no limit).")

    @staticmethod
    def reward_worker_died(err: BaseException, index: int, entry: dict, what: str) -> UserError:
        """The error for a reward worker whose process ended while a reward function ran: the function
        named, not Ray's guesses (the OOM killer, ``ray stop``); Ray's own account is in the logs folder."""
        pid = re.search(r"^\s*pid: (\d+)", str(err), re.M)
        log = f" (its output: logs/worker-{pid.group(1)}.log in runtime_args.output_dir)" if pid else ""
        return UserError(
            f"the reward worker{' (process ' + pid.group(1) + ')' if pid else ''} exited while scoring {what}: "
            f"reward function {entry['name']!r} (models.reward.functions[{index}], {entry['path']!r}) was running "
            "and the process ended without a Python error (exit code not known: os._exit or exit() in native "
            f"code, a crash, or a kill){log}, so the run stops. Make the function return one number per "
            "sample (a failed sample can score 0.0), or raise an exception to stop the run with its message.")

    @staticmethod
    def reward_metrics(parts: dict[str, np.ndarray], prefix: str) -> dict:
        """``<prefix>/reward/<name>/<key>``: the mean over the samples of each reward function's output."""
        return {f"{prefix}/reward/{k}": float(v.mean()) for k, v in parts.items()}
