"""Learning-rate schedule as a pure function of the optimizer step (Megatron's
``OptimizerParamScheduler.get_lr``, with its key names)."""
from __future__ import annotations

import math

from chatlearn.config import registry
from chatlearn.config.plan import resolve_schedule  # noqa: F401 (its home was here)

LR_DECAY_STYLES = registry.LR_DECAY_STYLES.names  # declared in chatlearn.config.registry


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
    return registry.LR_DECAY_STYLES.get(decay_style)(step, lr, min_lr, warmup_iters, decay_iters)


# Each style: the learning rate after the warmup, (step, lr, min_lr, W, D) -> float.
@registry.LR_DECAY_STYLES.register("constant")
def _constant(step, lr, min_lr, warmup_iters, decay_iters) -> float:
    return lr


def _decayed(coeff, step, lr, min_lr, warmup_iters, decay_iters) -> float:
    """``min_lr`` past the decay, else ``min_lr + coeff(r) * (lr - min_lr)``."""
    if step > decay_iters:
        return min_lr
    ratio = (step - warmup_iters) / (decay_iters - warmup_iters)
    return min_lr + coeff(ratio) * (lr - min_lr)


@registry.LR_DECAY_STYLES.register("linear")
def _linear(step, lr, min_lr, warmup_iters, decay_iters) -> float:
    return _decayed(lambda ratio: 1.0 - ratio, step, lr, min_lr, warmup_iters, decay_iters)


@registry.LR_DECAY_STYLES.register("cosine")
def _cosine(step, lr, min_lr, warmup_iters, decay_iters) -> float:
    return _decayed(lambda ratio: 0.5 * (math.cos(math.pi * ratio) + 1.0), step, lr, min_lr, warmup_iters,
                    decay_iters)


def trainer_learning_rate(spec, step: int) -> float:
    """:func:`learning_rate` from the fields lr, min_lr, lr_decay_style, lr_warmup_iters,
    lr_decay_iters and lr_warmup_init (already resolved to steps) of ``spec``, the trainer's
    :class:`~chatlearn.models.specs.TrainerSpec`."""
    return learning_rate(step, lr=float(spec.lr), min_lr=float(spec.min_lr),
                         decay_style=spec.lr_decay_style, warmup_iters=int(spec.lr_warmup_iters),
                         decay_iters=int(spec.lr_decay_iters),
                         warmup_init=float(spec.lr_warmup_init))
