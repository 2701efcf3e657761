"""The stage watchdog with fakes (a clock, the workers' heartbeats): deadlines from the stages' own
times, a silent worker stops the run naming its model and rank, a slow stage whose workers answer
runs on to its cap, the reward workers and nested calls are left alone, a stopped process is killed,
and a collective that timed out is named in one paragraph."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from chatlearn.config.deadlines import collective_timeout_s, deadline_s, silent_after
from chatlearn.runtime.cluster import roles, watchdog
from chatlearn.runtime.cluster.watchdog import Watchdog, collective_timeout_message


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Beats:
    """Heartbeats of fake workers: ``moving`` actors beat on every read, the others stay as they were."""

    def __init__(self, moving):
        self.moving, self.count, self.reads = set(moving), {}, 0

    def __call__(self, actors):
        self.reads += 1
        out = {}
        for i, a in enumerate(actors):
            self.count[a] = self.count.get(a, 0) + (1 if a in self.moving or a not in self.count else 0)
            out[a] = {"n": self.count[a], "pid": 4242 + i, "node": "10.0.0.7", "method": "train", "running_s": 1.0}
        return out


@pytest.fixture
def workers(monkeypatch):
    known = {"a0": ("policy_trainer", 0), "a1": ("policy_trainer", 1), "r0": ("reward", 0)}
    for actor, role in known.items():
        monkeypatch.setitem(roles._ROLES, actor, role)
    return {a: object() for a in known}


def dog(floor, workers, beats, clock):
    return Watchdog(floor, actors=lambda: workers, read=beats, clock=clock, thread=False)


def test_deadlines_come_from_the_floor_and_the_longest_earlier_time():
    assert deadline_s(600, None) == 600  # a stage's first call: the floor
    assert deadline_s(600, 100) == 600 and deadline_s(600, 200) == 1000  # 5 x its longest
    assert deadline_s(600, None, build=True) == 1200
    assert silent_after(600) == 60 and silent_after(20) == 10
    assert collective_timeout_s(600) == 2400 and collective_timeout_s(0) is None


def test_a_silent_worker_stops_the_run_naming_model_rank_and_stage(workers):
    clock, beats = Clock(), Beats(moving={"a1", "r0"})
    wd = dog(20, workers, beats, clock)
    with wd.watch("policy_trainer", "train"):
        clock.now += 19
        assert wd.check() is None and beats.reads == 0  # before the deadline nothing is read
        clock.now += 1
        assert wd.check() is None  # overdue: the heartbeats are read from now on
        clock.now += 9
        assert wd.check() is None
        clock.now += 1  # rank 0 silent for silent_after(20) = 10 s
        stall = wd.check()
    assert stall is not None
    text = stall.message
    for word in ("the policy_trainer rank 0 worker (process 4242, node 10.0.0.7, last seen running train)",
                 "no heartbeat for 10 s", "stage train of policy_trainer waited 30 s", "deadline 20 s",
                 "runtime_args.stage_timeout_s 20", "py-spy dump --pid 4242"):
        assert word in text, text
    assert "rank 1" not in text and "reward" not in text
    assert stall.stopped == [{"n": 1, "pid": 4242, "node": "10.0.0.7", "method": "train", "running_s": 1.0}]


def test_a_slow_stage_whose_workers_answer_runs_on_to_its_cap(workers, monkeypatch):
    clock, beats, warnings = Clock(), Beats(moving={"a0", "a1"}), []
    monkeypatch.setattr(watchdog, "warn", warnings.append)
    wd = dog(20, workers, beats, clock)
    with wd.watch("policy_trainer", "train"):
        for _ in range(59):  # every second up to 4 x the deadline: the reward worker, silent, is not counted
            clock.now += 1
            assert wd.check() is None
        assert len(warnings) == 1 and "may run on to 80 s" in warnings[0], warnings
        clock.now += 21
        stall = wd.check()
    assert stall is not None and "stage train of policy_trainer did not finish within 80 s" in stall.message
    assert "policy_trainer rank 0, policy_trainer rank 1" in stall.message


def test_the_deadline_grows_with_the_stage_s_own_times(workers):
    clock, beats = Clock(), Beats(moving=set())
    wd = dog(20, workers, beats, clock)
    with wd.watch("policy", "generate"):
        clock.now += 100  # slow but finished: a deadline is read only while the stage runs
    with wd.watch("policy", "generate"):
        clock.now += 499
        assert wd.check() is None and beats.reads == 0  # 5 x 100 s
        clock.now += 1
        wd.check()
        assert beats.reads == 1


def test_nested_calls_reward_and_no_floor_are_not_watched(workers):
    clock, beats = Clock(), Beats(moving=set())
    wd = dog(20, workers, beats, clock)
    with wd.watch("policy_trainer", "train"):
        with wd.watch("policy_trainer", "onload", call=True):  # inside a stage: the stage's deadline
            assert len(wd.active) == 1
    with wd.watch("reward", "reward"):  # models.reward.timeout_s is its limit
        assert not wd.active
    off = dog(0, workers, beats, clock)
    with off.watch("policy_trainer", "train"):
        clock.now += 10_000
        assert not off.active and off.check() is None
    # watches on two threads at once (a pass beside the reward) are both active
    inside = threading.Event()
    release = threading.Event()

    def other():
        with wd.watch("ref_policy", "ref_logprobs"):
            inside.set()
            release.wait(5)

    t = threading.Thread(target=other)
    with wd.watch("policy_trainer", "old_logprobs"):
        t.start()
        inside.wait(5)
        assert len(wd.active) == 2
        release.set()
        t.join()


def test_a_stall_kills_a_stopped_process_and_the_run_s_actors(monkeypatch):
    import ray

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(proc.pid, signal.SIGSTOP)
    killed = []
    monkeypatch.setattr(ray, "kill", killed.append)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.7")
    actors = {"a0": "handle-0", "a1": "handle-1"}
    wd = Watchdog(20, actors=lambda: actors, read=lambda a: {}, thread=False)
    wd._closed.set()  # the run ended at once: no interrupt of the driver
    try:
        wd.stop(watchdog.Stall("the policy_trainer rank 0 worker stopped answering", [{"pid": proc.pid,
                                                                                      "node": "10.0.0.7"}]))
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert killed == ["handle-0", "handle-1"]
    assert watchdog.stall_message() == "the policy_trainer rank 0 worker stopped answering"
    Watchdog(0, thread=False)  # a new run forgets the stall
    assert watchdog.stall_message() is None


def test_a_collective_that_timed_out_is_one_paragraph(monkeypatch):
    monkeypatch.setitem(roles._ROLES, "a1", ("policy_trainer", 1))
    Watchdog(20, actors=dict, thread=False)
    assert watchdog.collective_env() == {"CHATLEARN_COLLECTIVE_TIMEOUT_S": "80"}

    class RayTaskError(RuntimeError):
        actor_id = "a1"

    err = RayTaskError("ray::Worker.call() (pid=777, ip=10.0.0.7)\nRuntimeError: [gloo/transport/tcp/"
                       "unbound_buffer.cc:81] Timed out waiting 80000ms for recv operation to complete")
    text = collective_timeout_message(err)
    assert text.startswith("the policy_trainer rank 1 worker (process 777): a collective operation"), text
    assert "within 80 s (4 x runtime_args.stage_timeout_s)" in text
    # NCCL takes the process down: the reason is in the dead worker's log
    assert collective_timeout_message(RuntimeError("actor died"), "[Rank 0] Watchdog caught collective "
                                      "operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE)") is not None
    assert collective_timeout_message(RuntimeError("CUDA out of memory")) is None


JOIN = """
import torch, torch.distributed as dist
from chatlearn.models.trainer.fsdp import init_distributed
init_distributed()
print(dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout.total_seconds())
"""


def test_the_trainers_process_group_gets_the_timeout(monkeypatch):
    """The rendezvous environment's CHATLEARN_COLLECTIVE_TIMEOUT_S (4 x stage_timeout_s) is the default
    group's timeout (gloo here; NCCL alike); without it, torch's default."""
    from datetime import timedelta

    from chatlearn.models.trainer.fsdp import collective_timeout

    monkeypatch.delenv("CHATLEARN_COLLECTIVE_TIMEOUT_S", raising=False)
    assert collective_timeout() is None
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "LOCAL_RANK": "0",
           "MASTER_PORT": str(29400 + os.getpid() % 500), "CHATLEARN_COLLECTIVE_TIMEOUT_S": "80"}
    out = subprocess.run([sys.executable, "-c", JOIN], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == 80.0
    monkeypatch.setenv("CHATLEARN_COLLECTIVE_TIMEOUT_S", "80")
    assert collective_timeout() == timedelta(seconds=80)


def test_a_worker_in_the_driver_s_process_always_answers_so_only_the_cap_stops_it(monkeypatch):
    """Without Ray (runtime_args.single_process) a model's worker is this process: its heartbeat is read
    from it directly (its pid, the method it runs), it never falls silent while the watchdog runs, and a
    stage that hangs there is stopped by the cap, naming the model."""
    import time

    from chatlearn.runtime.cluster.group import create_group
    from conftest import HERE

    monkeypatch.syspath_prepend(os.path.join(HERE, "support"))
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the inline worker's environment stays in this test
    toy = create_group("policy_trainer", "toy_backend:Toy", None, num_actors=1, pg=None, bundles=[], gpu_fraction=0,
                       cpus=0, threads=1, distributed=False, env={}, place="inline")
    actor = toy.actors[0]
    key = actor._actor_id.hex()
    try:
        busy = threading.Thread(target=toy.call, args=("sleep", 1.5))
        busy.start()
        time.sleep(0.3)
        beat = watchdog.read_heartbeats([key])[key]
        assert beat["pid"] == os.getpid() and beat["method"] == "sleep" and beat["node"] == "local"
        busy.join()
        clock = Clock()
        wd = Watchdog(20, actors=lambda: {key: actor}, clock=clock, thread=False)
        with wd.watch("policy_trainer", "train"):
            for _ in range(40):
                clock.now += 2
                monkeypatch.setattr(time, "monotonic", lambda: clock.now)  # its heartbeat moves with time
                stall = wd.check()
                if stall is not None:
                    break
        assert stall is not None and "stage train of policy_trainer did not finish within" in stall.message
        assert "policy_trainer rank 0" in stall.message and not stall.stopped
    finally:
        actor.kill()
