"""Routing replay on the Megatron trainer (``models.policy_trainer.routing_replay: rollout``): every
forward of a micro-batch that carries the rollout's ``routed_experts`` (old log-probs, reference,
training, and the recomputation of a layer in backward) routes each token to the experts the
rollout engine chose for it.

megatron-core 0.16 (``transformer/moe/router_replay.py``): with ``moe_enable_routing_replay`` in the
``TransformerConfig`` each ``TopKRouter`` holds a ``RouterReplay``, through which its top-k goes
(``moe_utils.topk_routing_with_score_function``): ``REPLAY_FORWARD`` takes the indices set by
``set_target_indices`` and gathers the router's scores at them (so the routing weights are the
router's own, differentiable, at the replayed experts: with ``moe_router_pre_softmax`` off the
softmax over those k logits, Hugging Face's renormalised top-k); ``REPLAY_BACKWARD`` pops them
from a list in the order they were set, for a layer recomputed in backward. megatron-core leaves
the switching to the caller and has no notion of a token without a record.

Here (``PartialReplay``, :func:`partial_replay_class`, swapped in for megatron-core's instances of this model's routers):

* a token whose record is -1 (no record: the last sampled token, padding, a tool's tokens) takes the
  router's own top-k (the rest of its row is not used);
* the action is chosen by the call itself: a layer's first forward uses the micro-batch's target;
  under recomputation (full, or ``moe_layer_recompute``) megatron-core runs that first forward
  without autograd (its ``CheckpointFunction``) and the recomputation in backward with it, so a
  call with gradients enabled on a recomputed model pops the oldest target still awaiting its
  backward (1F1B runs the backwards of a stage in the order of its forwards);
* every call keeps the indices it used (``recorded_topk_idx``), for the tests and the metrics.

:func:`layer_targets` maps a micro-batch's ``[rows, width, moe_layers, k]`` records onto this
pipeline stage's MoE layers (the model's MoE layers in order: ``HFArch.moe_layers``) in the
router's token order (sequence-major, ``[width * rows, k]``; under sequence parallelism this
tensor-parallel rank's slice of the sequence).
"""
from __future__ import annotations

import functools

import numpy as np
import torch


@functools.cache
def partial_replay_class():
    """:class:`PartialReplay` (built on first use: megatron-core is imported only where it runs)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    class PartialReplay(RouterReplay):
        """megatron-core's ``RouterReplay`` with -1 = route yourself and the action taken from the
        call (see the module docstring). ``recompute``: the layer is recomputed in backward."""

        recompute = False
        agree = 0.0  # recorded top-k choices the router made itself (training forwards; :func:`agreement`)
        slots = 0.0  # recorded top-k choices
        count = False  # count them (the training pass)

        def set_target_indices(self, topk_indices: torch.Tensor):
            self.target_topk_idx = topk_indices
            if self.recompute:
                self.replay_backward_list.append(topk_indices)

        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if self.router_replay_action is None:
                probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                self.record_indices(idx)
                return probs, idx
            if self.recompute and torch.is_grad_enabled() and self.replay_backward_list:
                target = self.replay_backward_list.pop(0)
            else:
                target = self.target_topk_idx
            if target is None:
                raise RuntimeError("routing replay: a forward reached an MoE router without its micro-batch's "
                                   "routed experts")
            target = target.to(scores.device)
            if tuple(target.shape) != (scores.shape[0], topk):
                raise RuntimeError(f"routing replay: {tuple(target.shape)} routed experts for {scores.shape[0]} "
                                   f"tokens of top-{topk}")
            own = (target < 0).any(dim=1)
            _, mine = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            if self.count and torch.is_grad_enabled() != self.recompute:  # each forward once, not its recompute
                rec = ~own
                self.agree += float((target[rec][:, :, None] == mine[rec][:, None, :]).any(-1).sum())
                self.slots += float(rec.sum()) * topk
            if bool(own.any()):
                target = torch.where(own[:, None], mine, target)
            probs = scores.gather(1, target)
            self.record_indices(target)
            return probs, target

    return PartialReplay


def install(model, recompute: bool) -> list:
    """Swap megatron-core's ``RouterReplay`` of every router of ``model`` (this stage's layers, in
    order) for a ``PartialReplay``; returns them (one per MoE layer of this stage)."""
    out = []
    for layer in model.decoder.layers:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        replay = getattr(router, "router_replay", None)
        if replay is None:
            continue
        replay.__class__ = partial_replay_class()
        replay.recompute = recompute
        out.append(replay)
    return out


def begin(replays: list, on: bool) -> None:
    """Before a pass: forget what the last pass left; replay (``on``) or route freely."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for r in replays:
        r.clear_indices()
        if on:
            r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        else:
            r.clear_router_replay_action()


def layer_targets(routed: torch.Tensor, stage_moe_slots: list[int], tp: int, tp_rank: int,
                  sequence_parallel: bool) -> list[torch.Tensor]:
    """``routed``: int64 ``[rows, width, moe_layers, k]`` -> for each of this stage's MoE layers
    (``stage_moe_slots``: their index among the model's MoE layers) its ``[tokens, k]`` targets in
    the router's token order (``[s, b]`` flattened; under sequence parallelism the ``tp_rank``-th
    of ``tp`` slices of the sequence)."""
    seq_major = routed.transpose(0, 1)  # [width, rows, L, k]
    if sequence_parallel and tp > 1:
        seq_major = seq_major.chunk(tp, dim=0)[tp_rank]
    k = routed.shape[-1]
    return [seq_major[:, :, slot, :].reshape(-1, k).contiguous() for slot in stage_moe_slots]


def decode_column(column, num_moe_layers: int, top_k: int) -> np.ndarray:
    """The batch's ``routed_experts`` token column as int64 ``[tokens, moe_layers, top_k]`` (-1: no
    record), from its declared encoding (``chatlearn/batch.py``, ``chatlearn.models.moe.layout``): uint8
    with 255, or a signed integer with -1 (any negative value), for no record."""
    arr = np.asarray(column)
    out = arr.astype(np.int64)
    none = (arr == np.iinfo(np.uint8).max) if arr.dtype == np.uint8 else (out < 0)
    out[none] = -1
    return out.reshape(arr.shape[0], num_moe_layers, top_k)
