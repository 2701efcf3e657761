"""Where an Adam optimizer keeps its step count, read and restored for both layouts.

megatron-core (0.16, ``megatron/core/optimizer/__init__.py``) builds its inner optimizer from
the first of these that imports:

* TransformerEngine's ``transformer_engine.pytorch.optimizers.FusedAdam`` and Apex's
  ``apex.optimizers.FusedAdam`` (both ``fused_adam.py``): one count per *parameter group*,
  ``group["step"]``: a Python int, or a one-element int32 tensor on the device when built with
  ``capturable=True``; created by the first ``step()``. Their per-parameter state holds only
  ``exp_avg``, ``exp_avg_sq`` (and ``master_param`` with TE's ``master_weights``), never a step.
  TE since 2.x advances the count of an empty group too; Apex and older TE skip empty groups.
* ``torch.optim.AdamW`` / ``Adam`` (the fallback, and what runs on a CPU): one count per
  *parameter*, ``state[p]["step"]``, a 0-dim float32 tensor, on the CPU unless the optimizer
  is ``capturable`` or ``fused`` (then on the parameter's device) (``torch/optim/adam.py``).

The step count drives the learning-rate schedule and Adam's bias correction, so it is read
where the optimizer in use keeps it (:func:`step_count`) and checkpoints save and restore it
in the same layout (:func:`group_steps`, :func:`restore_group_steps`,
:func:`param_step_device`).
"""
from __future__ import annotations

import torch


def step_count(optimizer: torch.optim.Optimizer) -> int:
    """The optimizer steps taken by ``optimizer`` (an inner torch optimizer): the largest
    group or per-parameter step count, 0 before the first step."""
    steps = [0]
    for group in optimizer.param_groups:
        if "step" in group:  # TE / Apex FusedAdam
            steps.append(int(group["step"]))
        for p in group["params"]:
            state = optimizer.state[p] if p in optimizer.state else {}
            if "step" in state:  # torch.optim.Adam(W)
                steps.append(int(state["step"]))
    return max(steps)


def group_steps(optimizer: torch.optim.Optimizer) -> dict[int, torch.Tensor]:
    """``{group index: step}`` of the groups that keep a step count, as tensors for a
    checkpoint file: a 0-dim int64 tensor for an int count, the count's own tensor (on the
    CPU) for a capturable optimizer's."""
    out = {}
    for g, group in enumerate(optimizer.param_groups):
        if "step" in group:
            step = group["step"]
            out[g] = (step.detach().to("cpu", copy=True) if torch.is_tensor(step)
                      else torch.tensor(int(step), dtype=torch.int64))
    return out


def restore_group_steps(optimizer: torch.optim.Optimizer, saved: dict[int, torch.Tensor]) -> None:
    """Set the group step counts from :func:`group_steps`' output (groups absent there lose
    theirs, as a fresh optimizer has none): a 0-dim tensor becomes an int, a one-element
    tensor (capturable) goes back to the device of the group's parameters."""
    for g, group in enumerate(optimizer.param_groups):
        if g not in saved:
            group.pop("step", None)
            continue
        value = saved[g]
        if value.dim() == 0:
            group["step"] = int(value)
        else:
            device = group["params"][0].device if group["params"] else value.device
            group["step"] = value.to(device, copy=True)


def param_step_device(group: dict, param: torch.Tensor) -> torch.device:
    """Where ``torch.optim.Adam(W)`` expects the per-parameter step of ``param``: on its
    device for a ``capturable`` or ``fused`` group, else on the CPU."""
    if group.get("capturable") or group.get("fused"):
        return param.device
    return torch.device("cpu")
