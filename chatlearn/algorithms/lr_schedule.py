"""Learning-rate schedule as a pure function of the optimizer step (Megatron's
``OptimizerParamScheduler.get_lr``, with its key names)."""
from __future__ import annotations

import math

LR_DECAY_STYLES = ("constant", "linear", "cosine")


def learning_rate(step: int, *, lr: float, min_lr: float, decay_style: str, warmup_iters: int,
                  decay_iters: int, warmup_init: float) -> float:
    """The learning rate of optimizer step ``step`` (0 = the first step; the number of steps
    already taken), as Megatron's scheduler (W = warmup_iters, D = decay_iters):

        step <= W (W > 0):   warmup_init + (lr - warmup_init) * step / W
        constant:            lr
        step > D:            min_lr
        otherwise, r = (step - W) / (D - W):
            linear:          min_lr + (lr - min_lr) * (1 - r)
            cosine:          min_lr + (lr - min_lr) * (1 + cos(pi * r)) / 2
    """
    if warmup_iters > 0 and step <= warmup_iters:
        return warmup_init + (lr - warmup_init) * step / warmup_iters
    if decay_style == "constant":
        return lr
    if step > decay_iters:
        return min_lr
    ratio = (step - warmup_iters) / (decay_iters - warmup_iters)
    if decay_style == "linear":
        coeff = 1.0 - ratio
    elif decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"unknown lr_decay_style {decay_style!r}; one of {LR_DECAY_STYLES}")
    return min_lr + coeff * (lr - min_lr)


def resolve_schedule(lr_warmup_iters: int, lr_warmup_fraction: float, lr_decay_iters: int | None,
                     total_steps: int) -> tuple[int, int]:
    """``(warmup_iters, decay_iters)`` in optimizer steps: ``lr_warmup_iters`` when > 0, else
    floor(lr_warmup_fraction * total_steps); ``lr_decay_iters`` or, when null, the run's
    ``total_steps`` (num_episode x optimizer steps per episode)."""
    warmup = int(lr_warmup_iters) if lr_warmup_iters > 0 else int(lr_warmup_fraction * total_steps)
    return warmup, int(lr_decay_iters) if lr_decay_iters is not None else int(total_steps)


def trainer_learning_rate(cfg: dict, step: int) -> float:
    """:func:`learning_rate` from the trainer config keys lr, min_lr, lr_decay_style,
    lr_warmup_iters, lr_decay_iters, lr_warmup_init (already resolved to steps)."""
    return learning_rate(step, lr=float(cfg["lr"]), min_lr=float(cfg["min_lr"]),
                         decay_style=cfg["lr_decay_style"], warmup_iters=int(cfg["lr_warmup_iters"]),
                         decay_iters=int(cfg["lr_decay_iters"]),
                         warmup_init=float(cfg["lr_warmup_init"]))
