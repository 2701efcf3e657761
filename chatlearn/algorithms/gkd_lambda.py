"""``gkd_lambda``'s draw (algorithm: gkd): which episodes train on the student's own samples. Apart from
:mod:`chatlearn.algorithms.gkd` (which needs torch) so that the driver, which runs without torch, can ask it."""
from __future__ import annotations

import numpy as np

# the random stream of the on-policy draw: (seed, episode, this)
ON_POLICY_STREAM = 0x6B64


def on_policy(seed: int, episode: int, lam: float) -> bool:
    """Whether episode ``episode`` trains on the student's samples: ``u < lam`` for ``u`` uniform in [0, 1) drawn from
    ``(seed, episode)`` (numpy's ``default_rng``): always at ``lam`` 1, never at 0, else with probability ``lam``."""
    if lam >= 1.0:
        return True
    u = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(episode), ON_POLICY_STREAM]).random()
    return bool(u < lam)
