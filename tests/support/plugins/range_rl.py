"""A plugin module (``runtime_args.plugins``) as a user writes one: an advantage estimator and a policy loss of
its own (docs/architecture.md, "Plugins", shows the estimator). For the tests, each call also leaves a JSON line
in the file ``$CHATLEARN_PROBE_LOG`` when it is set (which process ran it, and the advantages it returned or was
given), so that a test can tell that both ran, where, and that the estimator's advantages reached the loss."""
import json
import os

import numpy as np

from chatlearn.plugins import register_advantage_estimator, register_policy_loss


@register_advantage_estimator("group_range")
def group_range(rewards, group_means, group_size, response_lens, keep):
    """A_i = (r_i - mean_g) / (max_g - min_g + 1e-6): the group baseline, scaled by the group's reward range
    (0 for a group whose rewards are all equal)."""
    groups = rewards.reshape(-1, group_size)
    spread = np.repeat(groups.max(axis=1) - groups.min(axis=1), group_size)
    advantages = (rewards - group_means) / (spread + 1e-6)
    _trace("advantages", advantages.tolist())
    return advantages


@register_policy_loss("unclipped")
def unclipped(logp, old_logp, advantages, seq, spec):
    """-A * ratio per token, without PPO's clip (nothing is ever clipped)."""
    ratio = (logp - old_logp).exp()
    never = ratio > float("inf")
    _trace("loss", sorted(set(advantages.detach().tolist())))
    return -advantages * ratio, never, never, ratio.detach()


def _trace(what: str, values: list) -> None:
    path = os.environ.get("CHATLEARN_PROBE_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"what": what, "pid": os.getpid(), "values": values}) + "\n")
