"""The scheduler owns residency: models are registered with ``add`` and move only through ``ensure``
(chatlearn/runtime/driver/scheduler.py), with fake worker groups that record the calls they get."""
from __future__ import annotations

import pytest

from chatlearn.config.kinds import DEFAULT_MODELS
from chatlearn.config.names import Part
from chatlearn.config.plan import ModelPlacement, Plan
from chatlearn.runtime.driver.scheduler import Scheduler, Timeline


class _Remote:
    def remote(self):
        return []  # no GPU memory to report: tracking stays off


class _Actor:
    device_memory = _Remote()


class FakeGroup:
    def __init__(self, name: str, log: list):
        self.name, self.log, self.actors = name, log, [_Actor()]

    def call(self, method, parts):
        self.log.append((self.name, method, sorted(map(str, parts))))
        return [{"bytes": 8 * len(parts)}], 0.0


def plan_of(device_groups: list[list[str]], kinds: dict | None = None) -> Plan:
    """``kinds``: the kinds of models that are not today's defaults (e.g. a teacher)."""
    plan = Plan.__new__(Plan)
    plan.device_groups = device_groups
    plan.placements = {n: ModelPlacement(n, 1, g, [0]) for g, names in enumerate(device_groups) for n in names}
    plan.placements["reward"] = ModelPlacement("reward", 1, -1, [], 1.0)
    plan.kinds = {n: {**DEFAULT_MODELS, **(kinds or {})}[n] for n in plan.placements}
    return plan


@pytest.fixture
def ray_get(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)


def colocated(ray_get, movable=None, order=("policy_trainer", "ref_policy", "reward", "policy")):
    log: list = []
    sched = Scheduler(plan_of([["policy", "policy_trainer", "ref_policy"]]), Timeline(None), offload_without_gpu=True)
    movable = movable or {}
    for name in order:
        sched.add(name, lambda name=name: FakeGroup(name, log),
                  movable[name] if name in movable else DEFAULT_MODELS[name].parts)
    return sched, log


def test_add_makes_room_builds_and_registers_in_turn(ray_get):
    log: list = []
    sched = Scheduler(plan_of([["policy", "policy_trainer", "ref_policy"]]), Timeline(None), offload_without_gpu=True)
    built = []

    def build(name):
        built.append((name, dict(sched.snapshot())))  # what was resident when the model was built
        return FakeGroup(name, log)

    for name in ("policy_trainer", "ref_policy", "reward", "policy"):
        sched.add(name, lambda name=name: build(name), DEFAULT_MODELS[name].parts)
    # each model is built on devices the earlier ones have left (the reward workers hold none, so the
    # reference leaves only for the rollout engine); the last one stays resident
    assert built == [("policy_trainer", {}), ("ref_policy", {}), ("reward", {"ref_policy": ["weights"]}),
                     ("policy", {})]
    assert log == [("policy_trainer", "offload", ["grads", "optimizer", "weights"]),
                   ("ref_policy", "offload", ["weights"])]
    assert sched.snapshot() == {"policy": ["kv_cache", "weights"]}
    assert set(sched.groups) == {"policy_trainer", "ref_policy", "reward", "policy"}
    assert "reward" not in sched.resident  # it holds no device part


def test_ensure_offloads_what_conflicts_and_onloads_only_what_is_missing(ray_get):
    sched, log = colocated(ray_get)
    log.clear()
    sched.ensure("policy_trainer", [Part.WEIGHTS])
    assert log == [("policy", "offload", ["kv_cache", "weights"]), ("policy_trainer", "onload", ["weights"])]
    log.clear()
    sched.ensure("policy_trainer", ["weights", "optimizer", "grads"])  # weights already there
    assert log == [("policy_trainer", "onload", ["grads", "optimizer"])]
    log.clear()
    sched.ensure("policy_trainer", ["weights"])  # nothing moves when nothing has to
    assert log == []
    # a weight push: the rollout engine's weights next to the trainer's, nothing else
    sched.ensure("policy", [Part.WEIGHTS], keep={"policy_trainer": [Part.WEIGHTS]})
    assert sched.snapshot() == {"policy": ["weights"], "policy_trainer": ["weights"]}
    sched.ensure("policy", [Part.KV_CACHE])
    assert sched.snapshot() == {"policy": ["kv_cache", "weights"]}
    kinds = [(e["model"], e["action"], e["parts"]) for e in sched.timeline.events if e["kind"] == "transition"]
    assert kinds[-4:] == [("policy_trainer", "offload", ["optimizer", "grads"]), ("policy", "onload", ["weights"]),
                          ("policy_trainer", "offload", ["weights"]), ("policy", "onload", ["kv_cache"])]


def test_a_keep_beyond_the_push_pair_breaks_the_invariant(ray_get):
    sched, _ = colocated(ray_get)
    sched.ensure("policy_trainer", ["weights", "optimizer"])
    with pytest.raises(RuntimeError, match="residency invariant broken"):
        sched.ensure("policy", ["weights"], keep={"policy_trainer": ["weights", "optimizer"]})


def test_pinned_parts_stay_and_are_exempt(ray_get, capsys):
    sched, log = colocated(ray_get, movable={"policy_trainer": {Part.WEIGHTS, Part.GRADS}})
    assert "keeps its optimizer on the devices it shares" in capsys.readouterr().out
    assert sched.resident["policy_trainer"] == {Part.OPTIMIZER}  # built, then only the movable parts left
    sched.ensure("policy_trainer", DEFAULT_MODELS["policy_trainer"].parts)
    log.clear()
    sched.ensure("policy", ["weights", "kv_cache"])
    assert log[0] == ("policy_trainer", "offload", ["grads", "weights"])
    assert sched.resident["policy_trainer"] == {Part.OPTIMIZER}


def test_models_on_disjoint_devices_never_turn(ray_get):
    log: list = []
    sched = Scheduler(plan_of([["policy"], ["policy_trainer"]]), Timeline(None), offload_without_gpu=True)
    for name in ("policy_trainer", "policy"):
        sched.add(name, lambda name=name: FakeGroup(name, log), DEFAULT_MODELS[name].parts)
    sched.ensure("policy_trainer", DEFAULT_MODELS["policy_trainer"].parts)
    sched.ensure("policy", DEFAULT_MODELS["policy"].parts)
    assert log == []
    assert sched.snapshot() == {"policy": ["kv_cache", "weights"],
                                "policy_trainer": ["grads", "optimizer", "weights"]}


def test_without_a_gpu_nothing_moves_unless_asked(ray_get, capsys):
    """Logical devices: every part is in host memory, so the turns move nothing (and say so once);
    offload_without_gpu=True moves the parts as on GPUs."""
    for asked in (False, True):
        log = []
        sched = Scheduler(plan_of([["policy", "policy_trainer"]]), Timeline(None), offload_without_gpu=asked)
        sched.add("policy_trainer", lambda: FakeGroup("policy_trainer", log), ["weights", "optimizer", "grads"])
        sched.add("policy", lambda: FakeGroup("policy", log), ["weights", "kv_cache"])
        sched.ensure("policy_trainer", ["weights", "optimizer", "grads"])
        sched.ensure("policy", ["weights", "kv_cache"])
        notice = "no GPU: colocated models keep" in capsys.readouterr().out
        if asked:
            assert log and not notice
        else:
            assert log == [] and notice
            assert sched.resident == {"policy_trainer": {"weights", "optimizer", "grads"},
                                      "policy": {"weights", "kv_cache"}}


def test_a_teacher_takes_its_turn_and_leaves_for_the_others(ray_get):
    """A distillation teacher colocated with the policy and its trainer: made resident for its pass (the others
    leave), its weights leave for the trainer's turn; its turns and moves are in the timeline."""
    from chatlearn.config.kinds import TEACHER

    log: list = []
    plan = plan_of([["policy", "policy_trainer", "teacher"]], {"teacher": TEACHER})
    sched = Scheduler(plan, Timeline(None), offload_without_gpu=True)
    for name in ("teacher", "policy_trainer", "reward", "policy"):  # the build order of their kinds
        sched.add(name, lambda name=name: FakeGroup(name, log), plan.kinds[name].parts)
    assert sched.snapshot() == {"policy": ["kv_cache", "weights"]}
    log.clear()
    sched.ensure("teacher", [Part.WEIGHTS])  # the teacher's log-probs
    assert log == [("policy", "offload", ["kv_cache", "weights"]), ("teacher", "onload", ["weights"])]
    assert sched.snapshot() == {"teacher": ["weights"]}
    log.clear()
    sched.take_turn("policy_trainer")  # old log-probs and training
    assert log[0] == ("teacher", "offload", ["weights"]) and ("policy_trainer", "onload",
                                                              ["grads", "optimizer", "weights"]) in log
    moves = [(e["model"], e["action"]) for e in sched.timeline.events if e["kind"] == "transition"]
    assert ("teacher", "onload") in moves and ("teacher", "offload") in moves
