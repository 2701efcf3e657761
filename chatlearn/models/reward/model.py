"""A reward model: a Hugging Face sequence-classification model (``AutoModelForSequenceClassification``
with one label, e.g. Skywork-Reward or a Qwen2.5-Math-RM style head) that gives each conversation
(the prompt's messages, then the response as the assistant's message) one scalar score.

Rendering: the reward model's own tokenizer and chat template, never the policy's:

    text = tokenizer.apply_chat_template(conversation, tokenize=False)   (a chat template)
    text = "\\n".join(message["content"] for message in conversation)     (none)
    ids  = tokenizer(text, add_special_tokens=<no chat template>)

A chat template writes the special tokens the model wants (BOS included) itself, so they are not
added a second time; without one the tokenizer adds its own, as ``tokenizer(text)`` does.

Pooling: the score of a conversation of ``n`` tokens is the classification logit at its last token,

    score = head(h[n - 1])    with h = the backbone's last hidden states, head = the ``score`` layer,

the quantity ``XForSequenceClassification.forward`` returns for the conversation alone. Batches are
right-padded, so ``n - 1`` is known from the lengths; HF's own pooling (the rightmost token that is
not ``pad_token_id``, transformers 5.x ``GenericForSequenceClassification``) would pick an earlier
token when a conversation ends in tokens equal to the pad id (a pad token that is the eos), so the
position is taken from the lengths instead.

On several ranks the model is sharded with FSDP2 (``fully_shard`` on the decoder layers, then the
root), as the frozen reference model is; :meth:`RewardModel.score` is then a collective.
"""
from __future__ import annotations

import types
from typing import TYPE_CHECKING, Iterable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

from chatlearn.config.names import Part
from chatlearn.errors import UserError
from chatlearn.models.base import ScoringModel
from chatlearn.models.specs import resolve_for_device
from chatlearn.models.stash import Stash, own_storage, release_device_memory
from chatlearn.models.trainer.fsdp import decoder_layers, init_distributed

if TYPE_CHECKING:
    from chatlearn.models.specs import RewardModelSpec

KEY = "models.reward.load"


def _pooled_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   last: torch.Tensor) -> torch.Tensor:
    """float32 [B]: ``score(h[b, last[b]])`` for each row ``b`` (right-padded rows; ``last``: the
    index of each row's last real token). Bound to the model; when it is sharded, registered with
    ``register_fsdp_forward_method``, so it runs as a forward of the root (the root's parameters,
    embeddings, final norm and the ``score`` head, are all-gathered; the layers gather their own)."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    return model.score(hidden[rows, last]).float()[:, 0]


class RewardModel(ScoringModel):
    """Scores conversations with a sequence-classification reward model (forward only, frozen).

    Every rank receives all the conversations; rank ``r`` of ``W`` scores its contiguous share
    ``[r * S, (r + 1) * S)`` with ``S = ceil(N / W)``, and the scores are all-gathered, so that every
    rank returns the same array. Parts: ``weights`` only (see :meth:`offload`).
    """

    def __init__(self, spec: RewardModelSpec):
        """``spec``: load, trust_remote_code, seed, micro_batch_size, max_length, bf16 (None: resolved
        here for the device), device. Joins the process group (RANK, WORLD_SIZE, MASTER_ADDR,
        MASTER_PORT), loads the model (bfloat16 storage with ``bf16`` on CUDA, else float32) and its
        tokenizer; a model without a scalar score head, or a tokenizer with neither a pad nor an eos
        token, raises a :class:`~chatlearn.errors.UserError` naming ``models.reward.load``."""
        self.device = init_distributed()
        if spec.device is None or spec.bf16 is None:
            spec = resolve_for_device(spec, self.device.type)
        self.spec = spec
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(int(spec.seed))
        self.tokenizer = self._load_tokenizer()
        self.model = self._build_model()
        self._stashes: dict = {}

    # ------------------------------------------------------------------ setup
    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.spec.load, trust_remote_code=self.spec.trust_remote_code)
        if tok.pad_token_id is None:
            if tok.eos_token_id is None:
                raise UserError(f"the reward model's tokenizer ({self.spec.load}) has neither a pad token nor an "
                                "eos token to pad micro-batches with; set pad_token in its tokenizer_config.json",
                                key=KEY)
            tok.pad_token = tok.eos_token
        return tok

    def _param_dtype(self) -> torch.dtype:
        """bfloat16 storage with ``bf16`` on CUDA (the dtype it computes in), else float32."""
        return torch.bfloat16 if self.spec.bf16 and self.device.type == "cuda" else torch.float32

    def _build_model(self) -> torch.nn.Module:
        """The frozen model in eval mode, sharded over the ranks when there are several (a plain
        module on one rank: FSDP2 over a mesh of one would only copy every weight before use)."""
        from transformers import AutoConfig, AutoModelForSequenceClassification

        spec = self.spec
        config = AutoConfig.from_pretrained(spec.load, trust_remote_code=spec.trust_remote_code)
        if getattr(config, "num_labels", None) != 1:
            raise UserError(f"{spec.load}: its config.json gives {getattr(config, 'num_labels', None)} labels "
                            "(num_labels / id2label; 2 when unset, as in a causal LM's config), but a reward model "
                            "gives one scalar score per conversation (num_labels 1). Point models.reward.load at "
                            "a sequence-classification reward model with one label.", key=KEY)
        model, info = AutoModelForSequenceClassification.from_pretrained(
            spec.load, dtype=self._param_dtype(), trust_remote_code=spec.trust_remote_code,
            output_loading_info=True)
        prefix = f"{model.base_model_prefix}."
        head_missing = sorted(k for k in (info["missing_keys"] if "missing_keys" in info else ())
                              if not k.startswith(prefix))
        if head_missing or not isinstance(getattr(model, "score", None), torch.nn.Module):
            raise UserError(f"{spec.load} has no trained score head ({', '.join(head_missing) or 'no score layer'}"
                            f" in {type(model).__name__}): it is not a reward model. Point models.reward.load "
                            "at a sequence-classification checkpoint with one label.", key=KEY)
        if model.config.pad_token_id is None:  # HF's own pooling reads it; ours reads the lengths
            model.config.pad_token_id = self.tokenizer.pad_token_id
        model.config.use_cache = False
        model.requires_grad_(False)
        model.train(False)
        model.reward_scores = types.MethodType(_pooled_scores, model)
        if self.world == 1:
            own_storage(model.to(self.device).parameters())
            return model
        mesh = init_device_mesh(self.device.type, (self.world,))
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        register_fsdp_forward_method(model, "reward_scores")
        return model

    # ------------------------------------------------------------------ scoring
    def render(self, conversation: list[dict]) -> list[int]:
        """The token ids the reward model reads for one conversation (see the module's docstring)."""
        tok = self.tokenizer
        if tok.chat_template:
            try:
                text = tok.apply_chat_template(conversation, tokenize=False)
            except Exception as err:  # jinja2 errors, raise_exception in the template, bad roles
                raise UserError(f"the reward model's tokenizer ({self.spec.load}) cannot render a conversation "
                                f"with its chat template: {type(err).__name__}: {err}. Give the reward model a "
                                "chat template that accepts the prompt's messages followed by one assistant "
                                "message (chat_template.jinja or tokenizer_config.json in its folder).",
                                key=KEY) from None
            return list(tok(text, add_special_tokens=False)["input_ids"])
        text = "\n".join(str(m["content"] if "content" in m else "") for m in conversation)
        return list(tok(text, add_special_tokens=True)["input_ids"])

    def score(self, conversations: list[list[dict]]) -> np.ndarray:
        """float32 [N]: one score per conversation (each a list of ``{"role", "content"}`` messages:
        the prompt's, then ``{"role": "assistant", "content": response}``), the same array on every
        rank.

        A collective: every rank must call it with the same conversations. Each rank renders all of
        them (so a conversation that cannot be rendered, or one longer than ``max_length`` tokens,
        raises the same :class:`~chatlearn.errors.UserError` on every rank before any collective),
        scores its contiguous share in right-padded micro-batches of ``micro_batch_size``
        (``score = head(h[n - 1])``, see the module's docstring), every rank running the same
        number of forwards (a short dummy one makes up a missing micro-batch), and the shares are
        all-gathered. The weights must be onloaded."""
        if Part.WEIGHTS in self._stashes:
            raise RuntimeError("RewardModel: weights are offloaded; call onload(['weights'])")
        ids = [self.render(c) for c in conversations]
        self._check_lengths(ids)
        if not ids:  # alike on every rank: no collective
            return np.zeros(0, dtype=np.float32)
        n, size = len(ids), max(1, int(self.spec.micro_batch_size))
        share = -(-n // self.world)
        mine = ids[self.rank * share:(self.rank + 1) * share]
        steps = -(-share // size)
        out = torch.zeros(share, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for step in range(steps):
                rows = mine[step * size:(step + 1) * size]
                scores = self._forward(rows or [[self.tokenizer.pad_token_id]])
                if rows:
                    out[step * size:step * size + len(rows)] = scores
            self._reshard()
            parts = [torch.empty_like(out) for _ in range(self.world)]
            dist.all_gather(parts, out)
        return torch.cat(parts)[:n].cpu().numpy().astype(np.float32)

    def _check_lengths(self, ids: list[list[int]]) -> None:
        limit = int(self.spec.max_length)
        over = [(i, len(x)) for i, x in enumerate(ids) if len(x) > limit]
        empty = [i for i, x in enumerate(ids) if not x]
        if over:
            i, length = max(over, key=lambda t: t[1])
            raise UserError(f"{len(over)} conversation(s) are longer than the reward model's context of {limit} "
                            f"tokens (the longest, at index {i}, has {length} tokens in its tokenizer). Shorten "
                            "the prompts or max_response_tokens_length, or use a reward model with a longer "
                            "context.", key=KEY)
        if empty:
            raise UserError(f"conversation {empty[0]} renders to no tokens with the reward model's tokenizer",
                            key=KEY)

    def _forward(self, rows: list[list[int]]) -> torch.Tensor:
        """float32 [len(rows)] scores of one right-padded micro-batch."""
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        width = int(lengths.max())
        input_ids = torch.full((len(rows), width), int(self.tokenizer.pad_token_id), dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, :len(r)] = 1
        dev = self.device
        return self.model.reward_scores(input_ids.to(dev), attention_mask.to(dev), (lengths - 1).to(dev))

    def _reshard(self) -> None:
        """Free every unsharded parameter (the root keeps them after a forward)."""
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    # ------------------------------------------------------------------ residency
    def offload(self, parts: Iterable[str]) -> dict:
        """Free the device storage of ``weights`` (this rank's shards), keeping a host copy; other
        parts (which a reward model does not hold) and weights already offloaded are skipped.
        Returns {"bytes": bytes copied to the host}."""
        moved = 0
        if Part.WEIGHTS in set(parts) and Part.WEIGHTS not in self._stashes:
            self._reshard()
            self._stashes[Part.WEIGHTS] = Stash(self.model.parameters())
            moved = self._stashes[Part.WEIGHTS].nbytes
            release_device_memory(self.device)
        return {"bytes": moved}

    def onload(self, parts: Iterable[str]) -> dict:
        """Restore the offloaded ``weights`` bit for bit. Returns {"bytes": bytes copied back}."""
        if Part.WEIGHTS in set(parts) and Part.WEIGHTS in self._stashes:
            return {"bytes": self._stashes.pop(Part.WEIGHTS).restore()}
        return {"bytes": 0}

