"""What a mixture-of-experts model looks like from its ``config.json``, and the ``routed_experts`` column.

The ``routed_experts`` batch column (``chatlearn/batch.py``) holds, per token, the top-k experts each MoE
layer of the rollout engine routed it to: ``[T, num_moe_layers, top_k]``, aligned with ``tokens``, layers in
the model's order of MoE layers, experts as global expert ids in the order the engine returned them.
It is stored compactly (:func:`column_dtype`): ``uint8`` when the model has fewer than 255 experts, with 255
meaning "no record", else ``int16`` with -1. "No record" (:data:`NONE`) marks a token the trainer routes
itself: the last sampled token of a response (never fed back to the engine), padding, and in a multi-turn
trajectory every token that is not the model's own (the prompt, tool and environment observations).

Numpy only: the driver reads it without torch.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

NONE = -1  # decoded: no record for this token (route it yourself)
NONE_UINT8 = 255  # encoded in uint8


@dataclass(frozen=True)
class MoeLayout:
    """The MoE layers of a model: ``layers`` (how many decoder layers have a routed MoE block), ``top_k``
    (experts per token), ``num_experts`` (routed experts per layer)."""

    layers: int
    top_k: int
    num_experts: int
    # the decoder layers that have them, in order (from config.json; empty when not known): vLLM reports
    # routes for every decoder layer, these pick the MoE layers' out
    decoder_layers: tuple = field(default=(), compare=False)

    @property
    def dtype(self) -> np.dtype:
        return column_dtype(self.num_experts)

    def bytes_per_token(self) -> int:
        """Bytes of the ``routed_experts`` column per token."""
        return self.layers * self.top_k * self.dtype.itemsize


def layout_of_config(conf: dict) -> MoeLayout | None:
    """The MoE layout a Hugging Face ``config.json`` (as a dict) declares, or None for a dense model.

    Qwen3-MoE and Qwen2-MoE (``num_experts``, ``num_experts_per_tok``; a decoder layer ``i`` has a routed
    block unless ``i`` is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``, as their
    ``DecoderLayer`` decides) and Mixtral (``num_local_experts``: every layer)."""
    if isinstance(conf.get("text_config"), dict):  # a multimodal model's language model
        conf = conf["text_config"]
    experts = conf.get("num_experts") or conf.get("num_local_experts") or 0
    k = conf.get("num_experts_per_tok") or 0
    if not experts or not k:
        return None
    n = int(conf["num_hidden_layers"]) if "num_hidden_layers" in conf else 0
    if "num_local_experts" in conf and "num_experts" not in conf:  # Mixtral: every layer
        return MoeLayout(n, int(k), int(experts), tuple(range(n)))
    step = int(conf.get("decoder_sparse_step") or 1)
    dense = set(conf.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)
    return MoeLayout(len(layers), int(k), int(experts), layers) if layers else None


def layout_of_folder(folder: str) -> MoeLayout | None:
    """:func:`layout_of_config` of a model folder's ``config.json`` (None when the folder has none)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return layout_of_config(json.load(f))


def column_dtype(num_experts: int) -> np.dtype:
    """uint8 for fewer than 255 experts (255: no record), int16 otherwise (-1: no record)."""
    if num_experts < NONE_UINT8:
        return np.dtype(np.uint8)
    if num_experts <= np.iinfo(np.int16).max:
        return np.dtype(np.int16)
    raise ValueError(f"{num_experts} experts do not fit the routed_experts column (int16)")


def none_value(dtype) -> int:
    """The "no record" value of an encoded column of ``dtype``."""
    return NONE_UINT8 if np.dtype(dtype) == np.uint8 else NONE


def encode(ids, num_experts: int) -> np.ndarray:
    """Expert ids (any integer dtype; negative: no record) -> the column's compact dtype. Ids must be in
    ``[0, num_experts)``; a ValueError otherwise (an engine that reports another model's experts)."""
    ids = np.asarray(ids)
    dtype = column_dtype(num_experts)
    missing = ids < 0
    if ids.size and int(ids.max(initial=0)) >= num_experts:
        raise ValueError(f"routed expert id {int(ids.max())} is not below the model's {num_experts} experts")
    out = ids.astype(dtype)
    out[missing] = none_value(dtype)
    return out


def decode(column) -> np.ndarray:
    """An encoded column (or a slice of it) -> int64 expert ids, -1 where there is no record."""
    column = np.asarray(column)
    out = column.astype(np.int64)
    if column.dtype == np.uint8:
        out[column == NONE_UINT8] = NONE
    return out


def empty(tokens: int, layout: MoeLayout) -> np.ndarray:
    """An encoded column of ``tokens`` tokens without records."""
    return np.full((tokens, layout.layers, layout.top_k), none_value(layout.dtype), dtype=layout.dtype)


def assemble(per_sample: list, lengths, layout: MoeLayout) -> np.ndarray:
    """The batch column from each sample's records: ``per_sample[i]`` an integer array ``[m_i, layers, top_k]``
    of the first ``m_i <= lengths[i]`` tokens of sample ``i`` (None: no record), the tokens after them
    without record."""
    lengths = [int(n) for n in lengths]
    out = empty(sum(lengths), layout)
    start = 0
    for rec, n in zip(per_sample, lengths):
        if rec is not None:
            rec = np.asarray(rec)
            m = min(len(rec), n)
            if rec.shape[1:] != (layout.layers, layout.top_k):
                raise ValueError(f"routed experts of shape {rec.shape[1:]} per token, the model has "
                                 f"{layout.layers} MoE layers x top-{layout.top_k}")
            out[start:start + m] = encode(rec[:m], layout.num_experts)
        start += n
    return out
