"""SIGTERM raises like Ctrl-C; a dead worker is named by model and rank; leftovers of killed runs
(orphaned Ray processes, vLLM's rendezvous files) are found and removed, and nothing else is."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import ray

from chatlearn.runtime.cluster import group, leftovers, roles, signals
from chatlearn.runtime.cluster.signals import SIGHUP_EXIT, SIGTERM_EXIT, Terminated, exit_code, stop_on_sigterm


def test_sigterm_raises_terminated_with_its_exit_code():
    old = signal.getsignal(signal.SIGTERM)
    try:
        stop_on_sigterm()
        with pytest.raises(KeyboardInterrupt) as info:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert isinstance(info.value, Terminated) and exit_code() == SIGTERM_EXIT == 143
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # a second SIGTERM does not interrupt the stop
    finally:
        signal.signal(signal.SIGTERM, old)
        signals._received.clear()
        signals._received_signal.clear()
    assert exit_code() == 130


def test_sighup_stops_like_sigterm_with_129():
    """A closed terminal (SIGHUP) ended the run at once with 129, no message, ``run.lock`` left behind."""
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        stop_on_sigterm()
        with pytest.raises(KeyboardInterrupt) as info:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(1)
        assert isinstance(info.value, Terminated) and exit_code() == SIGHUP_EXIT == 129
        assert "SIGHUP" in signals.stop_message()
        # a SIGTERM or another SIGHUP while stopping does not interrupt the stop
        assert signal.getsignal(signal.SIGHUP) == signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        signals._received.clear()
        signals._received_signal.clear()
    assert exit_code() == 130


SIGHUP_RUN = """
import sys, time
from chatlearn import cli
from chatlearn.runtime.rundir.lock import RunLock

def run(args):  # a run that holds its folder's lock, as chatlearn.runtime.driver.run.train does
    with RunLock(sys.argv[1]):
        print("ready", flush=True)
        time.sleep(60)
    return 0

cli._run = run
sys.exit(cli.main(["run", "config.yaml"]))
"""


def test_sighup_to_a_run_releases_its_lock_and_exits_129(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SIGHUP_RUN, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    assert (tmp_path / "run.lock").exists()
    proc.send_signal(signal.SIGHUP)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 129, stderr
    assert "terminated (SIGHUP" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "run.lock").exists()


SIGTERM_IN_RAY_GET = """
import os, signal, threading, time, ray
from chatlearn.runtime.cluster.signals import exit_code, stop_on_sigterm
ray.init(num_cpus=1, include_dashboard=False)
stop_on_sigterm()
@ray.remote
def wait():
    time.sleep(60)
threading.Timer(2, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
try:
    ray.get(wait.remote())
except KeyboardInterrupt as err:
    print("exit", type(err).__name__, exit_code(), flush=True)
ray.shutdown()
"""


@pytest.mark.slow  # a driver with Ray in a subprocess: about 7 s
def test_sigterm_during_ray_get_still_exits_143():
    """Ray turns the handler's exception into a plain KeyboardInterrupt inside ``ray.get``; the
    exit code still says SIGTERM (a job stopped by its scheduler exited 130 this way)."""
    out = subprocess.run([sys.executable, "-c", SIGTERM_IN_RAY_GET], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert "exit KeyboardInterrupt 143" in out.stdout, out.stdout + out.stderr[-3000:]


SIGTERM_IN_A_FINALISER = """
import os, signal, weakref
from chatlearn.runtime.cluster.signals import Terminated, exit_code, stop_on_sigterm
stop_on_sigterm()
class Held:
    pass
def collected(_):  # garbage collection runs this between two bytecodes of whatever code is running
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):
        pass
held = Held()
ref = weakref.ref(held, collected)
try:
    del held
    for _ in range(10 ** 7):
        pass
    print("went on", flush=True)
except Terminated:
    print("stopped", exit_code(), flush=True)
"""


def test_sigterm_landing_in_a_finaliser_still_stops_the_run():
    """Python drops an exception raised in a finaliser or weakref callback ("Exception ignored"): a
    SIGTERM that lands there is delivered again to the code that was running, so the run stops with
    143 instead of going on with SIGTERM ignored (a job stopped by Slurm then exited 1)."""
    out = subprocess.run([sys.executable, "-c", SIGTERM_IN_A_FINALISER], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "stopped 143", out.stdout + out.stderr
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_dead_actor_is_named_by_model_and_rank(monkeypatch):
    monkeypatch.setitem(roles._ROLES, "ab12", ("policy_trainer", 1))
    monkeypatch.setitem(roles._ROLES, "cd34", ("policy", 0))
    text = ("The actor died unexpectedly before finishing this task.\n\tclass_name: Worker\n\tactor_id: ab12\n"
            "\tpid: 4242\n\tip: 10.0.0.7\nThe actor is dead because its worker process has died.")
    msg = group.dead_worker_message(ray.exceptions.RayActorError("ab12", text))
    assert msg.startswith("the policy_trainer rank 1 worker (process 4242, node 10.0.0.7) died: "
                          "The actor is dead because its worker process has died. The run stopped")
    assert "class_name" not in msg and "Worker\n" not in msg
    assert group.role_of("cd34") == "policy replica 0"
    unknown = group.dead_worker_message(ray.exceptions.RayActorError("ffff", "gone"))
    assert unknown.startswith("a worker of this run died: gone. The run stopped")
    assert group.dead_worker_message(ValueError("x")) is None


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def marked(driver, name="ray::FakeAgent"):
    env = {**os.environ, leftovers.DRIVER_ENV: str(driver)}
    return subprocess.Popen(["bash", "-c", f"exec -a {name} sleep 60"], env=env)


def test_orphaned_ray_processes_of_a_dead_driver_are_stopped_and_nothing_else():
    dead, live = dead_pid(), os.getpid()
    orphan, of_live_run, not_ray = marked(dead), marked(live), marked(dead, name="python-train")
    unmarked = subprocess.Popen(["bash", "-c", "exec -a ray::Mine sleep 60"],
                                env={k: v for k, v in os.environ.items() if k != leftovers.DRIVER_ENV})
    try:
        time.sleep(0.3)
        found = leftovers.orphaned_processes()
        assert orphan.pid in found
        assert not {of_live_run.pid, not_ray.pid, unmarked.pid} & set(found)
        said = []
        leftovers.clean_leftovers(log=said.append)
        assert orphan.wait(timeout=10) is not None
        assert str(orphan.pid) in said[0] and "no longer exists" in said[0]
        assert of_live_run.poll() is None and not_ray.poll() is None and unmarked.poll() is None
    finally:
        for p in (orphan, of_live_run, not_ray, unmarked):
            p.kill()
            p.wait()


def test_temp_files_of_dead_processes_are_removed_and_nothing_else(tmp_path):
    tmp = str(tmp_path)
    mine, theirs, stranger = (os.path.join(tmp, f"vllm_dist_{n}") for n in ("aa", "bb", "cc"))
    for path in (mine, theirs, stranger):
        open(path, "w").close()
    # a process that recorded a file and was killed
    code = (f"import sys; sys.path.insert(0, {os.getcwd()!r}); from chatlearn.runtime.cluster import leftovers; "
            f"leftovers.record_owned([{theirs!r}], {tmp!r})")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert json.load(open(next(tmp_path.glob("chatlearn-owned-*.json"))))["files"] == [theirs]
    leftovers.record_owned([mine], tmp)  # this process: alive
    assert leftovers.remove_stale_files(tmp) == 1
    assert not os.path.exists(theirs) and os.path.exists(mine) and os.path.exists(stranger)
    assert leftovers.release_owned(tmp) == 1  # a normal end removes this process's own files
    assert sorted(os.listdir(tmp)) == ["vllm_dist_cc"]
    assert leftovers.record_owned([], tmp) is None
