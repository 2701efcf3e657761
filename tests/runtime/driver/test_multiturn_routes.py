"""Routing replay in multi-turn rollouts: a trajectory carries the routes the engine recorded for the
model's own tokens, turn by turn; its prompt's and the observations' tokens have none (the trainer routes
those itself), and the column survives selecting and joining samples."""
from __future__ import annotations

import multiturn_envs
import numpy as np
from test_multiturn import SAMPLING, FakeEngine, make_cfg, prompts_for, tok  # noqa: F401 (tok: a fixture)

from chatlearn.batch import check, concat_batches, select_samples
from chatlearn.models.moe import layout
from chatlearn.runtime.driver.multiturn import MultiTurnLoop

LAY = layout.MoeLayout(layers=3, top_k=2, num_experts=8)


def route_of(token: int, position: int) -> np.ndarray:
    """What the fake engine routes a token to: a function of the token and its position in the call."""
    return np.array([[(token + position + layer) % 8, (token + 3 * layer + 1) % 8] for layer in range(LAY.layers)])


class RoutingEngine(FakeEngine):
    """FakeEngine that also returns ``routed_experts`` as an engine with routing replay does: every token of
    each call's sample (its prompt, the trajectory so far, and the response) but the last has a record."""

    def __call__(self, prompts, sampling):
        out = super().__call__(prompts, sampling)
        per_sample = []
        for i in range(len(prompts)):
            ids = out["tokens"][out["offsets"][i]:out["offsets"][i + 1]]
            per_sample.append(np.stack([route_of(int(t), j) for j, t in enumerate(ids[:-1])]))
        out["routed_experts"] = layout.assemble(per_sample, np.diff(out["offsets"]), LAY)
        return out


def test_multi_turn_trajectories_carry_routes_of_the_model_tokens_only(tok):  # noqa: F811
    multiturn_envs.RECORD.clear()
    script = {"t0": [["obs one", 0.5, False, {}], [None, 1.0, True, {}]],
              "t1": [["x", 0.0, False, {}], ["y", 0.0, False, {}], ["z", 1.0, False, {}]],
              "t2": [[None, 2.0, True, {}]]}
    engine = RoutingEngine(tok)
    batch = MultiTurnLoop(make_cfg(environment_kwargs={"script": script}), tok).run(
        engine, prompts_for(tok, ["t0", "t1", "t2"]), SAMPLING, "x")
    check(batch)
    routes = layout.decode(batch["routed_experts"])
    assert batch["routed_experts"].dtype == np.uint8 and routes.shape == (len(batch["tokens"]), 3, 2)
    off, plen, mask = batch["offsets"], batch["prompt_lens"], batch["loss_mask"].astype(bool)
    has = (routes >= 0).all((-1, -2))
    assert not (has & ~mask).any()  # the prompt's and the observations' tokens: none
    # each model token: the route its own turn's call gave it (at its position in that call)
    for i in range(len(plen)):
        for pos in range(int(off[i] + plen[i]), int(off[i + 1])):
            if not mask[pos]:
                continue
            at = pos - int(off[i])  # position in the trajectory = in the call of its turn
            token = int(batch["tokens"][pos])
            end_of_turn = pos + 1 == off[i + 1] or not mask[pos + 1]
            if end_of_turn:  # the turn's last sampled token: never fed back in its own call
                assert not has[pos]
            else:
                assert has[pos] and np.array_equal(routes[pos], route_of(token, at)), (i, pos)
    assert has.sum() > 0
    both = concat_batches([select_samples(batch, [2, 0]), select_samples(batch, [1])])
    check(both)
    assert np.array_equal(both["routed_experts"][:off[1] - off[0] + off[3] - off[2]],
                          np.concatenate([batch["routed_experts"][off[2]:off[3]], batch["routed_experts"][:off[1]]]))


def test_no_routes_without_an_engine_that_records_them(tok):  # noqa: F811
    batch = MultiTurnLoop(make_cfg(environment_kwargs={"script": {"t": [[None, 1.0, True, {}]]}}), tok).run(
        FakeEngine(tok), prompts_for(tok, ["t"]), SAMPLING, "x")
    assert "routed_experts" not in batch
