"""Per-token KL estimators (torch), shared by the trainers' loss (:mod:`chatlearn.algorithms.grpo`)
and the KL-in-reward penalty of the episode (:func:`chatlearn.algorithms.advantages.sequence_kl`,
which imports this module only when that penalty is on: the driver otherwise runs without torch).
This module imports neither of them.
"""
from __future__ import annotations

import torch

from chatlearn.config import registry

KL_LOG_RATIO_CLAMP = 20.0
LOW_VAR_KL_CLAMP = 10.0

# the names are declared in chatlearn.config.registry (what the config accepts); the functions
# registered below implement them
KL_ESTIMATORS = registry.KL_ESTIMATORS.declared


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens (Schulman, "Approximating
    KL divergence"; names as verl ``kl_penalty``), with d = logp - ref_logp:

        k1 = d                        k2 = d^2 / 2
        k3 = exp(-d) + d - 1          (d clamped to [-20, 20]; always >= 0)
        low_var_kl = clamp(k3, -10, 10)
    """
    return registry.KL_ESTIMATORS.get(estimator)(logp, ref_logp)


@registry.KL_ESTIMATORS.register("k1")
def _kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


@registry.KL_ESTIMATORS.register("k2")
def _kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp) ** 2


@registry.KL_ESTIMATORS.register("low_var_kl")
def _kl_low_var(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return torch.clamp(kl_k3(logp, ref_logp), -LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)


@registry.KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) per token (Schulman), always >= 0.

        d  = clamp(ref_logp - logp, -20, 20)
        k3 = exp(d) - d - 1
    """
    d = torch.clamp(ref_logp - logp, -KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    return torch.exp(d) - d - 1.0
