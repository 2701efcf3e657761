"""The Megatron trainer's resumable checkpoint: one safetensors file per rank. A file format
(JSON and safetensors, no megatron-core): the trainer (``chatlearn.models.trainer.megatron``)
writes and reads it, ``chatlearn merge`` (:mod:`chatlearn.checkpoint.merge`) reads it.

A folder written by ``MegatronTrainer.save_checkpoint``::

    rank_<rank>.safetensors        that rank's tensors: ``model.<name>`` (its shard of each
                                   parameter, by global Megatron name), ``optimizer.<i>.<j>.<key>``
                                   (Adam's state of parameter j of optimizer i: its
                                   moments, and ``step`` for torch's Adam, which counts per
                                   parameter), ``optimizer_group.<i>.<g>.step`` (the step
                                   count of parameter group g, for TE's / Apex's FusedAdam,
                                   which count per group: see ``.optimizer_state``),
                                   ``main.<i>.<j>`` (fp32 main parameters of a
                                   mixed-precision optimizer), ``rng_tracker.<name>``
                                   (Megatron's model-parallel RNG states)
    rng/rank_<rank>.safetensors    that rank's torch / numpy / python RNG states
                                   (``chatlearn.checkpoint.sharded``)
    chatlearn_checkpoint.json      metadata, by rank 0: format, parallel sizes, world size,
                                   whether the optimizer had stepped, the model's source; a
                                   MoE model's expert-parallel sizes and expert count, and
                                   every rank's place (``ranks``: tp, pp, dp, ep, etp, edp),
                                   where ``chatlearn merge`` finds the shards (a routed
                                   expert's parameters are named by their global id)
    .complete                      written last by rank 0, once every rank has finished

The shards are those of the parallel layout that wrote them: a checkpoint loads on the same
world size, tensor- and pipeline-parallel sizes and optimizer kind only. Nothing read back
unpickles anything: tensors are safetensors, metadata is JSON.
"""
from __future__ import annotations

import json
import os

from chatlearn.checkpoint import sharded
from chatlearn.errors import UserError

FORMAT = "chatlearn-megatron"
VERSION = 1
LAYOUT_KEYS = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
               "use_distributed_optimizer", "dtype")
# a mixture-of-experts model's too: expert_model_parallel_size, expert_tensor_parallel_size, num_experts


def rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank_{rank:05d}.safetensors")


def write_meta(path: str, meta: dict) -> None:
    with open(os.path.join(path, sharded.META_FILE), "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "version": VERSION, **meta}, f, indent=1)
        f.write("\n")


def read_meta(path: str, expected: dict) -> dict:
    """The metadata of the complete checkpoint folder ``path``, checked against this
    trainer's layout (``expected``: the values of ``LAYOUT_KEYS``); a UserError otherwise."""
    meta_file = os.path.join(path, sharded.META_FILE)
    if not os.path.isdir(path) or not os.path.isfile(meta_file):
        raise UserError(f"{path!r} is not a chatlearn Megatron trainer checkpoint folder (no "
                        f"{sharded.META_FILE}). Pass the folder written by save_checkpoint.")
    meta = sharded.read_complete_json(path, meta_file)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise UserError(f"checkpoint {path!r} has format {found!r}, not {FORMAT!r}: it was "
                        "written by another training backend. Resume with that backend.")
    if "version" in meta and meta["version"] > VERSION:  # no version: written before versions
        raise UserError(f"checkpoint {path!r} has format version {meta['version']}, newer "
                        f"than this chatlearn reads ({VERSION}). Upgrade chatlearn.")
    if "num_experts" in expected and meta.get("num_experts") != expected["num_experts"]:
        raise UserError(f"checkpoint {path!r} holds a model with {meta.get('num_experts')!r} experts per MoE "
                        f"layer, and the model loaded now has {expected['num_experts']}: it was saved from "
                        f"another model ({meta.get('hf_source')!r}). Load a checkpoint of this model, or load "
                        "that model.")
    differ = [f"{k} {meta.get(k)!r} (now {v!r})" for k, v in expected.items() if meta.get(k) != v]
    if differ:
        raise UserError(f"checkpoint {path!r} was written with another parallel layout: "
                        f"{', '.join(differ)}. Resume with the sizes it was saved with.")
    return meta
