"""Routing capture and routing replay on a Hugging Face MoE model (``routing_replay: rollout``).

:class:`RouterPatch` replaces the ``forward`` of every top-k router of a model (Qwen3-MoE's
``Qwen3MoeTopKRouter``, Qwen2-MoE's ``Qwen2MoeTopKRouter``, Mixtral's ``MixtralTopKRouter``: transformers
5.x, each ``forward(hidden) -> (router_logits, router_scores, router_indices)``), in one of three modes:

* off (``mode`` None): the router's own forward, untouched.
* ``capture`` (the hf rollout): the router's own forward; its ``router_indices`` ``[tokens, top_k]`` are
  kept per MoE layer, call after call (prefill, then every decoding step), for the rollout to assemble per
  sample (:meth:`take`).
* ``replay`` (a trainer forward): each token goes to the experts recorded for it, ``target`` ``[tokens,
  layers, top_k]`` (int64, -1: no record, the token is routed by the router itself). As megatron-core's
  router replay (``transformer/moe/router_replay.py``, ``REPLAY_FORWARD``: ``probs = scores.gather(1,
  top_indices)``), the scores come from the trainer's own router at the replayed indices: ``softmax(logits)``
  gathered at them, then normalised as the model normalises its top-k (``norm_topk_prob``; Mixtral
  always), so the gradient reaches the router's weight through the gathered probabilities. Where the
  record equals the router's own choice the output is the unpatched router's. The share of the recorded
  choices the router would have made itself is counted (:meth:`agreement`, after :meth:`reset_agreement`),
  once per layer and target (a gradient-checkpointed layer's recomputation in backward is not counted
  twice), on the device.

The tokens a router sees are the model's ``input_ids`` flattened row by row (``[batch * seq]``), which is
how :func:`micro_batch_target` lays out ``target``.
"""
from __future__ import annotations

import types

import numpy as np
import torch
import torch.nn.functional as F

from chatlearn.models.moe.layout import MoeLayout, decode

# router classes whose forward is softmax -> top-k -> (normalised) scores; value: whether the scores are
# cast back to the logits' dtype (Qwen's are; Mixtral's stay float32)
ROUTERS = {"Qwen3MoeTopKRouter": True, "Qwen2MoeTopKRouter": True, "MixtralTopKRouter": False}


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers of a known class (:data:`ROUTERS`), in module order: the model's order of
    MoE layers."""
    return [m for m in model.modules() if type(m).__name__ in ROUTERS]


def unsupported_routers(model: torch.nn.Module) -> list[str]:
    """Class names of modules that look like MoE routers but are not of a class replay knows."""
    return sorted({type(m).__name__ for m in model.modules()
                   if type(m).__name__.endswith("Router") and type(m).__name__ not in ROUTERS})


def model_layout(model: torch.nn.Module) -> MoeLayout | None:
    """The MoE layout of a built model (its routers), None without routers."""
    found = routers(model)
    if not found:
        return None
    return MoeLayout(len(found), int(found[0].top_k), int(found[0].num_experts))


class RouterPatch:
    """The patched routers of one model (see the module docstring). ``mode``: None, ``"capture"`` or
    ``"replay"``."""

    def __init__(self, model: torch.nn.Module):
        self.routers = routers(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router of a known class ({', '.join(ROUTERS)})")
        self.layout = MoeLayout(len(self.routers), int(self.routers[0].top_k), int(self.routers[0].num_experts))
        self.mode: str | None = None
        self.records: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.target: torch.Tensor | None = None
        self._counted = [False] * len(self.routers)
        self.counting = False  # count the agreement (reset_agreement turns it on)
        self._agree: torch.Tensor | None = None  # on the model's device: no wait per layer
        self._slots: torch.Tensor | None = None
        for layer, router in enumerate(self.routers):
            original = router.forward
            router.forward = types.MethodType(
                lambda mod, hidden, _layer=layer, _orig=original: self._forward(mod, _orig, _layer, hidden), router)

    # ------------------------------------------------------------------ capture
    def start_capture(self) -> None:
        self.mode, self.records = "capture", [[] for _ in self.routers]

    def take(self) -> torch.Tensor:
        """The indices recorded since the last :meth:`take` (or :meth:`start_capture`): ``[tokens, layers,
        top_k]`` int64 on the model's device, the tokens of every call since then, in order; the records are
        cleared."""
        device = self.routers[0].weight.device
        calls = [torch.cat(r) if r else torch.zeros((0, self.layout.top_k), dtype=torch.long, device=device)
                 for r in self.records]
        self.records = [[] for _ in self.routers]
        return torch.stack(calls, dim=1).long()

    # ------------------------------------------------------------------ replay
    def set_target(self, target: torch.Tensor | None) -> None:
        """Replay ``target`` (``[tokens, layers, top_k]`` int64 on the model's device, -1: no record) in the
        forwards that follow, until the next call; None: route by the routers' own choice."""
        self.mode = None if target is None else "replay"
        self.target = target
        self._counted = [False] * len(self.routers)

    def reset_agreement(self, count: bool = True) -> None:
        """Start counting the agreement of the replayed forwards that follow (``count`` False: stop)."""
        self.counting = count
        device = self.routers[0].weight.device
        self._agree = torch.zeros((), dtype=torch.float64, device=device)
        self._slots = torch.zeros((), dtype=torch.float64, device=device)

    def agreement(self) -> tuple[float, float]:
        """``(recorded choices the routers made themselves, recorded choices)`` since :meth:`reset_agreement`
        (one wait for the device)."""
        if self._agree is None:
            return 0.0, 0.0
        return float(self._agree), float(self._slots)

    def off(self) -> None:
        self.mode, self.target, self.records = None, None, [[] for _ in self.routers]

    # ------------------------------------------------------------------ the router's forward
    def _forward(self, router, original, layer: int, hidden_states: torch.Tensor):
        if self.mode == "capture":
            logits, scores, indices = original(hidden_states)
            self.records[layer].append(indices.detach())  # on the device: no wait per layer
            return logits, scores, indices
        if self.mode != "replay":
            return original(hidden_states)
        hidden = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        _, own = torch.topk(probs, router.top_k, dim=-1)
        target = self.target[:, layer]
        if target.shape != own.shape:
            raise ValueError(f"routing replay: {tuple(target.shape)} recorded routes for {tuple(own.shape)} "
                             "routed tokens (the replay target is not aligned with the micro-batch)")
        recorded = (target >= 0).all(-1)
        indices = torch.where(recorded[:, None], target, own)
        values = probs.gather(1, indices)
        if getattr(router, "norm_topk_prob", True):
            values = values / values.sum(dim=-1, keepdim=True)
        if ROUTERS[type(router).__name__]:
            values = values.to(logits.dtype)
        if self.counting and not self._counted[layer]:
            self._counted[layer] = True
            with torch.no_grad():
                hit = (own[:, :, None] == target[:, None, :]).any(-1) & recorded[:, None]
                self._agree += hit.sum()
                self._slots += recorded.sum() * router.top_k
        return logits, values, indices


class DecodeRoutes:
    """The routes a decoding loop records (:class:`RouterPatch` in capture mode), by row and position of its
    ``[rows, width + steps]`` token grid: the prompt's (prefill) at once, then one position per step for the
    rows still running. int16 on the model's device (no wait per step); -1 where nothing was recorded."""

    def __init__(self, patch: RouterPatch, rows: int, width: int, steps: int, device: torch.device):
        lay = patch.layout
        self.patch, self.width = patch, width
        self.grid = torch.full((rows, width + steps, lay.layers, lay.top_k), -1, dtype=torch.int16, device=device)
        self.grid[:, :width] = patch.take().view(rows, width, lay.layers, lay.top_k).to(torch.int16)

    def step(self, rows: torch.Tensor, position: int) -> None:
        """After a decoding step that fed the token at ``position`` of each row of ``rows``."""
        self.grid[rows, position] = self.patch.take().to(torch.int16)

    def per_sample(self, prompt_lens: list[int], lengths) -> list[np.ndarray]:
        """Each row's routes ``[prompt + response, layers, top_k]``: its left padding cut, then its prompt
        and its ``lengths[i]`` response tokens."""
        grid = self.grid.cpu().numpy()
        return [grid[i, self.width - p:self.width + int(n)] for i, (p, n) in enumerate(zip(prompt_lens, lengths))]


def sample_routes(column, start: int, end: int) -> np.ndarray:
    """Decoded routes ``[end - start, layers, top_k]`` (int64, -1: none) of a batch's token range."""
    return decode(column[start:end])


def micro_batch_routes(shape: tuple[int, int], layout: MoeLayout, pieces: list[tuple[int, int, np.ndarray]],
                       device: torch.device) -> torch.Tensor:
    """The routes of a micro-batch of ``input_ids`` shape ``shape`` (``[batch, seq]``), aligned with it:
    ``[batch, seq, MoE layers, top_k]`` int64 on ``device``, -1 (no record: the model routes the token itself)
    everywhere but where ``pieces`` place routes: ``(row, col, routes [n, layers, top_k])`` (decoded, e.g.
    :func:`sample_routes`) puts them at ``[row, col:col + n]``. What a trainer replays (the Megatron trainer's
    ``RouterReplay`` takes each layer's ``[tokens, top_k]`` of it)."""
    out = np.full((shape[0], shape[1], layout.layers, layout.top_k), -1, dtype=np.int64)
    for row, col, routes in pieces:
        out[row, col:col + len(routes)] = routes
    return torch.from_numpy(out).to(device)


def micro_batch_target(shape: tuple[int, int], layout: MoeLayout, pieces: list[tuple[int, int, np.ndarray]],
                       device: torch.device) -> torch.Tensor:
    """:func:`micro_batch_routes` flattened as a Hugging Face router sees its tokens (row by row):
    ``[batch * seq, layers, top_k]``, :meth:`RouterPatch.set_target`'s target."""
    return micro_batch_routes(shape, layout, pieces, device).reshape(shape[0] * shape[1], layout.layers, layout.top_k)
