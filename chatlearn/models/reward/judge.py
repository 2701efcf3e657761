"""An LLM judge: a causal LM on a rollout backend that gives each sample a verdict.

The driver renders each sample's judge prompt from the judge's ``prompt_template`` (Jinja:
``chatlearn.runtime.driver.judges``) and sends the rendered messages here; the judge reads them with
its own tokenizer:

    ids = tokenizer(apply_chat_template(messages, add_generation_prompt=True))   (apply_chat_template)
    ids = tokenizer(messages[0]["content"])                                       (otherwise)

then, on the rollout engine of its ``backend`` (``chatlearn/models/rollout/hf.py`` or ``vllm.py``,
built from a :class:`~chatlearn.models.specs.RolloutSpec` of the judge's folder), either

* generates a verdict (greedy at ``temperature`` 0, at most ``max_verdict_tokens`` tokens), returned as
  text for the driver's parser, or
* with ``want_probs`` (parser ``yes_prob``) reads the probability of the reply's first token being
  ``yes_word``'s first token rather than ``no_word``'s: ``p = P(yes) / (P(yes) + P(no))`` at the
  position after the prompt (one forward, nothing generated).

Parts: ``weights`` and ``kv_cache``, those of its rollout engine, which it offloads and onloads.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Iterable

import numpy as np
import torch

from chatlearn.config import registry
from chatlearn.errors import UserError
from chatlearn.models.base import JudgingModel
from chatlearn.models.specs import resolve_for_device

if TYPE_CHECKING:
    from chatlearn.models.specs import JudgeSpec


class JudgeModel(JudgingModel):
    """A judge on one device (one engine; replicas are separate actors)."""

    def __init__(self, spec: JudgeSpec):
        from transformers import AutoTokenizer

        self.spec = spec
        device = "cuda" if torch.cuda.is_available() else "cpu"
        module, name = registry.ROLLOUT_BACKENDS.get(spec.backend).split(":")
        self.engine = getattr(importlib.import_module(module), name)(resolve_for_device(spec.rollout_spec(), device))
        self.tokenizer = AutoTokenizer.from_pretrained(spec.load, trust_remote_code=spec.trust_remote_code)
        self.yes_id, self.no_id = (self.first_token(w) for w in (spec.yes_word, spec.no_word))

    def first_token(self, word: str) -> int:
        ids = self.tokenizer(word, add_special_tokens=False)["input_ids"]
        if not ids:
            raise UserError(f"{word!r} is no token of the judge's tokenizer ({self.spec.load})",
                            key=f"models.{self.spec.name}.yes_word")
        return int(ids[0])

    def render(self, messages: list[dict]) -> list[int]:
        """The token ids the judge reads for one rendered prompt (see the module's docstring)."""
        tok = self.tokenizer
        if self.spec.apply_chat_template and tok.chat_template:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return list(tok(text, add_special_tokens=False)["input_ids"])
        return list(tok("\n".join(m["content"] for m in messages), add_special_tokens=True)["input_ids"])

    def prompt_lengths(self, prompts: list[list[dict]]) -> list[int]:
        """The length of each rendered prompt in the judge's tokens (the driver's preflight check)."""
        return [len(self.render(p)) for p in prompts]

    def judge(self, prompts: list[list[dict]], probs: bool | None = None) -> dict:
        """``{"texts": the verdicts (decoded, special tokens left out; "" when nothing is generated),
        "yes_probs": float32 [N] (NaN unless ``want_probs``), "generated_tokens": int}`` of each prompt
        (a list of chat messages)."""
        want = self.spec.want_probs if probs is None else probs
        ids = [self.render(p) for p in prompts]
        self.check_lengths(ids)
        n = len(ids)
        out = {"texts": [""] * n, "yes_probs": np.full(n, np.nan, np.float32), "generated_tokens": 0}
        if not n:
            return out
        if want:
            out["yes_probs"] = self.yes_probs(ids)
        if not want or probs:  # probs=True (tools, tests): both
            batch = self.engine.generate(ids, {"temperature": self.spec.temperature,
                                               "max_tokens": self.spec.max_verdict_tokens, "seed": self.spec.seed})
            offsets, lens = batch["offsets"], batch["prompt_lens"]
            tokens = np.asarray(batch["tokens"])
            texts = []
            for i in range(n):
                start, end = int(offsets[i]) + int(lens[i]), int(offsets[i + 1])
                texts.append(self.tokenizer.decode(tokens[start:end].tolist(), skip_special_tokens=True))
                out["generated_tokens"] += end - start
            out["texts"] = texts
        return out

    def check_lengths(self, ids: list[list[int]]) -> None:
        """A rendered prompt longer than ``max_prompt_tokens_length`` (or empty) is a UserError naming the key."""
        limit = int(self.spec.max_prompt_tokens_length)
        over = [(i, len(x)) for i, x in enumerate(ids) if len(x) > limit or not x]
        if over:
            i, length = max(over, key=lambda t: t[1])
            raise UserError(f"{len(over)} judge prompt(s) are longer than max_prompt_tokens_length ({limit} tokens) "
                            f"or empty: the longest, sample {i}, renders to {length} tokens in the judge's tokenizer "
                            f"({self.spec.load}). Raise max_prompt_tokens_length (within the judge's context), or "
                            "shorten the template, the prompts or models.policy.max_response_tokens_length.",
                            key=f"models.{self.spec.name}.max_prompt_tokens_length")

    @torch.no_grad()
    def yes_probs(self, ids: list[list[int]]) -> np.ndarray:
        """``P(yes) / (P(yes) + P(no))`` at the position after each prompt: batched forwards on an engine with a
        transformers model (hf), the engine's ``probe_logprobs`` of each prompt followed by either token otherwise."""
        model = getattr(self.engine, "model", None)
        if not isinstance(model, torch.nn.Module):
            found = []
            for row in ids:
                y = float(self.engine.probe_logprobs([*row, self.yes_id])["logprobs"][-1])
                no = float(self.engine.probe_logprobs([*row, self.no_id])["logprobs"][-1])
                found.append(1.0 / (1.0 + np.exp(no - y)))
            return np.asarray(found, np.float32)
        device = next(model.parameters()).device
        pad = int(self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0)
        out = []
        size = max(1, int(self.spec.generation_batch_size))
        for start in range(0, len(ids), size):
            rows = ids[start:start + size]
            width = max(len(r) for r in rows)
            x = torch.full((len(rows), width), pad, dtype=torch.long)
            mask = torch.zeros_like(x)
            for i, r in enumerate(rows):  # left padding: the last position is every row's next token
                x[i, width - len(r):] = torch.tensor(r)
                mask[i, width - len(r):] = 1
            pos = (mask.cumsum(1) - 1).clamp(min=0)
            logits = model(input_ids=x.to(device), attention_mask=mask.to(device), position_ids=pos.to(device),
                           use_cache=False).logits[:, -1].float()
            two = torch.log_softmax(logits, -1)[:, [self.yes_id, self.no_id]]
            out.append(torch.softmax(two, -1)[:, 0].cpu())
        return torch.cat(out).numpy().astype(np.float32)

    # ------------------------------------------------------------------ residency
    def offload(self, parts: Iterable[str]) -> dict:
        """Its rollout engine's ``weights`` and ``kv_cache`` off the device (``Rollout.offload``)."""
        return self.engine.offload(parts)

    def onload(self, parts: Iterable[str]) -> dict:
        return self.engine.onload(parts)
