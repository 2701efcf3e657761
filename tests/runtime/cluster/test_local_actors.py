"""Workers of a run without Ray (chatlearn/runtime/cluster/local.py): the calls keep what Ray's calls
guarantee (values handed over, errors raised by ``get``, one call at a time, a dead process named),
in this process (inline) and in a process of their own (the reward workers')."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from chatlearn.calls import get, put, wait
from chatlearn.errors import UserError
from chatlearn.runtime.cluster.group import CallTimeout, WorkerGroup, create_group, dead_worker_message
from chatlearn.runtime.cluster.local import WorkerDied
from conftest import HERE, REPO

SUPPORT = os.path.join(HERE, "support")


@pytest.fixture
def same_environment():
    """An inline worker's environment goes into this process: put it back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def group(place: str, env: dict | None = None) -> WorkerGroup:
    env = {"PYTHONPATH": os.pathsep.join([SUPPORT, REPO]), **(env or {})}
    return create_group("toy", "toy_backend:Toy", {"spec": 1}, num_actors=1, pg=None, bundles=[], gpu_fraction=0,
                        cpus=0, threads=1, distributed=False, env=env, place=place)


def ask(actor, method: str, *args, timeout: float | None = None):
    """A backend method of one actor (the worker's ``call``), without its time."""
    return get(actor.call.remote(method, *args), timeout=timeout)[0]


def test_an_inline_worker_gets_values_of_its_own(same_environment):
    toy = group("inline", {"TOY_VAR": "set"})
    actor = toy.actors[0]
    assert ask(actor, "pid") == os.getpid()
    assert os.environ["TOY_VAR"] == "set"  # the worker's environment is this process's now
    batch = {"tokens": np.arange(4), "names": ["a"]}
    (out,), _ = toy.call("keep", put(batch))
    assert out["added"] == 1 and "added" not in batch  # the caller's dict is its own
    out["later"] = 2
    (keys,), _ = toy.call("kept_keys")
    assert keys == ["added", "names", "tokens"]  # and the result is a value of the caller's
    with pytest.raises(ValueError, match="read-only"):  # arrays handed over read-only, as Ray's
        toy.call("write", batch["tokens"])
    assert batch["tokens"][0] == 0
    with pytest.raises(UserError, match="bad input"):  # the worker's error, raised by get
        toy.call("fail", "bad input")
    actor.kill()
    with pytest.raises(WorkerDied, match="stopped by the run"):
        toy.call("echo", 1)


def test_an_inline_worker_runs_one_call_at_a_time(same_environment):
    toy = group("inline")
    actor, spans = toy.actors[0], []

    def call():
        start = time.monotonic()
        ask(actor, "sleep", 0.3)
        spans.append((start, time.monotonic()))

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (s1, e1), (s2, e2) = sorted(spans, key=lambda s: s[1])
    assert e2 - min(s1, s2) >= 0.6 - 0.05  # the second waited for the first


@pytest.mark.timeout(120)
def test_a_worker_process_answers_fails_and_is_named_when_it_dies():
    toy = group("process", {"TOY_VAR": "theirs"})
    actor = toy.actors[0]
    try:
        pid = ask(actor, "pid", timeout=60)
        assert pid != os.getpid()
        assert ask(actor, "env", "TOY_VAR") == "theirs" and ask(actor, "env", "CHATLEARN_WORKER") == "toy:0"
        assert "TOY_VAR" not in os.environ
        (out,), _ = toy.call("echo", {"a": np.arange(3)})
        assert out["a"].tolist() == [0, 1, 2]
        with pytest.raises(UserError, match="bad input") as err:
            toy.call("fail", "bad input")
        assert f"in the worker process {pid}" in "".join(err.value.__notes__)  # where it was raised
        # a call past its time: named by index, and the process killed (as the reward timeout does)
        with pytest.raises(CallTimeout) as late:
            toy.call_each("sleep", [(30,)], timeout=0.5)
        assert late.value.stuck == [0]
        actor.kill()
        with pytest.raises(WorkerDied, match="killed by the run"):
            toy.call("echo", 1)
    finally:
        actor.kill()


@pytest.mark.timeout(120)
def test_a_worker_process_that_exits_is_named_with_its_code():
    toy = group("process")
    actor = toy.actors[0]
    pid = ask(actor, "pid", timeout=60)
    with pytest.raises(WorkerDied) as died:
        toy.call("exit", 3)
    assert died.value.pid == pid and "exited with code 3" in str(died.value)
    message = dead_worker_message(died.value)
    assert message.startswith(f"the toy rank 0 worker (process {pid}) died: its process exited with code 3.")
    assert "a rerun resumes from it" in message


@pytest.mark.timeout(120)
def test_a_worker_process_ends_with_the_run_and_with_its_driver(tmp_path):
    toy = group("process")
    actor = toy.actors[0]
    pid = ask(actor, "pid", timeout=60)
    started = time.monotonic()
    actor.stop()
    assert time.monotonic() - started < 4 and actor._proc.poll() == 0  # ended on its own, not killed
    # a driver killed outright: its worker process sees its input close and exits
    driver = textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = [{SUPPORT!r}, {REPO!r}]
        from chatlearn.calls import get
        from chatlearn.runtime.cluster.local import ProcessActor
        a = ProcessActor("toy", 1, None, False, {{**os.environ, "PYTHONPATH": {SUPPORT + os.pathsep + REPO!r}}})
        get(a.setup.remote("toy_backend:Toy", None))
        print(get(a.call.remote("pid"))[0], flush=True)
        os.kill(os.getpid(), 9)
    """)
    proc = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=90)
    child = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{child}") or " Z" in open(f"/proc/{child}/stat").read()
    assert pid != child


def test_wait_and_get_of_local_calls():
    from concurrent.futures import Future

    done, pending = Future(), Future()
    done.set_result(1)
    ready, left = wait([pending, done], num_returns=1, timeout=0.1)
    assert ready == [done] and left == [pending]
    ready, left = wait([pending], num_returns=1, timeout=0.05)
    assert ready == [] and left == [pending]
    assert get([done]) == [1] and get(done) == 1 and get([]) == []
    if "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
        assert put({"a": 1}) == {"a": 1}  # without Ray in this process, the value itself
