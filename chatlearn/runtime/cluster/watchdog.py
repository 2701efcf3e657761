"""Deadlines of the workers' calls, and heartbeats that tell a slow worker from a stopped one.

Every worker process runs a heartbeat thread (:func:`chatlearn.runtime.cluster.heartbeat.start_heartbeat`)
that writes, every ``HEARTBEAT_S`` seconds, a counter, its process id, node and the method it is running into Ray's
key-value store. A stopped process (SIGSTOP, a frozen node) or one that holds the interpreter
writes nothing; one waiting on a GPU kernel or a collective goes on writing.

On the driver, :class:`Watchdog` gives every stage a deadline (``chatlearn.config.deadlines``, from
``runtime_args.stage_timeout_s`` and the stage's longest earlier time). The engine's stages, the
scheduler's turns and builds, and any other call of a worker group (evaluation, resume) are
watched, one watch per driver thread at a time (the outermost). The heartbeats are read only once a
watch is overdue: a worker whose heartbeat has not moved for ``silent_after`` seconds stops the run;
when all move, the stage is slow, not stuck, and may run on to its cap. A stall records one
paragraph (:func:`stall_message`, printed by the CLI), kills the stopped processes and the run's
actors (so that the driver's waits end), and exits with 1. The reward workers are not watched: they
have their own limit, ``models.reward.timeout_s``.
"""
from __future__ import annotations

import _thread
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from chatlearn.config.deadlines import CAP_FACTOR, collective_timeout_s, deadline_s, silent_after
from chatlearn.config.kinds import DEFAULT_MODELS
from chatlearn.logging.console import warn
from chatlearn.runtime.cluster.heartbeat import NAMESPACE
from chatlearn.runtime.cluster.local import LocalActor, kill
from chatlearn.runtime.cluster.roles import handle_of, live_actors, model_of, role_of
from chatlearn.runtime.cluster.signals import terminated

TICK_S = 1.0
GRACE_S = 60.0  # after a stall, the driver's own wait for the run to end before it is interrupted
# models whose calls have their own limit (their kind's own_deadline: the reward workers, models.reward.timeout_s)
UNWATCHED = tuple(name for name, kind in DEFAULT_MODELS.items() if kind.own_deadline)

_STATE: dict = {"stall": None, "failed_in": None, "collective_s": None}


def stall_message() -> str | None:
    """The paragraph of the stall that stopped this process's run, if one did."""
    return _STATE["stall"]


def collective_env() -> dict[str, str]:
    """The trainer ranks' rendezvous variable of their collectives' timeout (read by
    ``chatlearn.models.trainer.fsdp.collective_timeout``), from this run's watchdog; {}: torch's default."""
    seconds = _STATE["collective_s"]
    return {"CHATLEARN_COLLECTIVE_TIMEOUT_S": f"{seconds:g}"} if seconds else {}


# ---------------------------------------------------------------------------- heartbeats
def read_heartbeats(actor_ids: list[str]) -> dict[str, dict | None]:
    """On the driver: the last heartbeat of each actor (None: none yet); a worker of a run without Ray
    (chatlearn.runtime.cluster.local) answers for itself."""
    out = {}
    for actor in actor_ids:
        handle = handle_of(actor)
        if isinstance(handle, LocalActor):
            out[actor] = handle.heartbeat()
            continue
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(actor.encode(), namespace=NAMESPACE)
        out[actor] = json.loads(raw) if raw else None
    return out


def forget_heartbeats(actor_ids: list[str]) -> None:
    actor_ids = [a for a in actor_ids if not isinstance(handle_of(a), LocalActor)]
    if not actor_ids:
        return
    from ray.experimental import internal_kv

    for actor in actor_ids:
        with contextlib.suppress(Exception):
            internal_kv._internal_kv_del(actor.encode(), namespace=NAMESPACE)


# ---------------------------------------------------------------------------- driver side
@dataclass
class Watch:
    """One watched stage: ``what`` names it (``stage train of policy_trainer``)."""

    model: str
    what: str
    start: float
    allowed: float  # seconds to its deadline; it may run on to CAP_FACTOR x that while its workers answer
    basis: str  # where the deadline comes from
    warned: bool = False


@dataclass
class Stall:
    message: str
    stopped: list[dict] = field(default_factory=list)  # the silent workers' last heartbeats


class Watchdog:
    """Deadlines of the calls made from the driver's threads (see the module docstring).

    ``stage_timeout_s``: the floor (0: nothing is watched). ``actors()``: actor id -> handle of the
    run's workers (by default those started from now on); ``read``: their heartbeats; ``clock``:
    seconds; ``thread``: False in tests, which call :meth:`check` themselves."""

    def __init__(self, stage_timeout_s: float, *, unwatched: Iterable[str] = UNWATCHED,
                 actors: Callable[[], dict] | None = None,
                 read: Callable[[list[str]], dict] = read_heartbeats, clock: Callable[[], float] = time.monotonic,
                 thread: bool = True):
        self.floor = float(stage_timeout_s)
        self.unwatched = tuple(unwatched)  # models whose calls have a limit of their own
        before = set(live_actors())
        self.actors = actors or (lambda: {a: h for a, h in live_actors().items() if a not in before})
        self.read, self.clock = read, clock
        self.longest: dict[tuple, float] = {}
        self.active: dict[int, Watch] = {}
        self.heard: dict[str, tuple[str, float]] = {}  # actor -> (last heartbeat, when it last moved)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._closed = threading.Event()
        _STATE.update(stall=None, failed_in=None, collective_s=collective_timeout_s(self.floor))
        if thread and self.floor > 0:
            threading.Thread(target=self._loop, name="chatlearn-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def watch(self, model: str, stage: str, *, call: bool = False, build: bool = False):
        """The block is ``stage`` of ``model`` (``call``: a worker call outside any stage, named by its
        method; ``build``: the model's start-up). Nested blocks on one thread are the outer one's."""
        if self.floor <= 0 or model in self.unwatched or getattr(self._local, "busy", False):
            yield
            return
        key = (model, stage, call)
        what = (f"building {model}" if build else f"the {stage} call of {model}" if call
                else f"stage {stage} of {model}")
        start = self.clock()
        basis = (f"twice runtime_args.stage_timeout_s {self.floor:g}" if build
                 else f"runtime_args.stage_timeout_s {self.floor:g}, or 5 x its longest earlier time")
        w = Watch(model, what, start, deadline_s(self.floor, self.longest.get(key), build), basis)
        self._local.busy = True
        with self._lock:
            self.active[id(w)] = w
        try:
            yield
        except BaseException:
            _STATE["failed_in"] = what
            raise
        finally:
            self._local.busy = False
            with self._lock:
                del self.active[id(w)]
                self.longest[key] = max(self.longest[key] if key in self.longest else 0.0, self.clock() - start)

    def check(self) -> Stall | None:
        """One look: the stall that stops the run, if any (warns once of a slow stage)."""
        now = self.clock()
        with self._lock:
            overdue = sorted((w for w in self.active.values() if now - w.start >= w.allowed), key=lambda w: w.start)
        if not overdue:
            self.heard.clear()
            return None
        watched = [a for a in self.actors() if model_of(a) not in self.unwatched]
        try:
            beats = self.read(watched)
        except Exception:  # noqa: BLE001 - Ray's store not answering: look again at the next tick
            return None
        silent = []
        for actor in watched:
            beat = json.dumps(beats.get(actor), sort_keys=True)
            if actor not in self.heard or self.heard[actor][0] != beat:
                self.heard[actor] = (beat, now)
            elif now - self.heard[actor][1] >= silent_after(self.floor):
                silent.append(actor)
        if silent:
            return self._stopped(overdue, silent, beats, now)
        for w in overdue:
            if now - w.start >= CAP_FACTOR * w.allowed:
                return self._capped(w, now)
            if not w.warned:
                w.warned = True
                warn(f"{w.what} has run {now - w.start:.0f} s, past its deadline of {w.allowed:.0f} s ({w.basis}); "
                     f"its workers answer their heartbeats, so it may run on to {CAP_FACTOR * w.allowed:.0f} s")
        return None

    def _stopped(self, overdue: list[Watch], silent: list[str], beats: dict, now: float) -> Stall:
        models = {model_of(a) for a in silent}
        w = next((w for w in overdue if w.model in models), overdue[0])
        names = []
        for actor in silent:
            beat = beats.get(actor) or {}
            where = ", ".join(p for p in (f"process {beat['pid']}" if "pid" in beat else "",
                                          f"node {beat['node']}" if "node" in beat else "") if p)
            doing = f", last seen running {beat['method']}" if beat.get("method") else ""
            detail = f" ({where}{doing})" if where else " (no heartbeat since it was started)"
            names.append(f"the {role_of(actor) or 'actor ' + actor[:8]} worker{detail}")
        pids = " ".join(str(beats[a]["pid"]) if beats.get(a) and "pid" in beats[a] else "PID" for a in silent)
        message = (
            f"{_join(names)} stopped answering: no heartbeat for {silent_after(self.floor):.0f} s while {w.what} "
            f"waited {now - w.start:.0f} s (its deadline {w.allowed:.0f} s: {w.basis}). The process is stopped "
            "(SIGSTOP, a frozen node) or hung holding the Python interpreter; the run stopped and its workers were "
            "killed. The last complete "
            "checkpoint is kept and a rerun resumes from it. If the stage is only slow, raise "
            "runtime_args.stage_timeout_s (0: no deadline); to see where a worker hangs, run "
            f"`py-spy dump --pid {pids}` while it hangs (`ps e` shows CHATLEARN_WORKER=model:rank).")
        return Stall(message, [beats.get(a) or {} for a in silent])

    def _capped(self, w: Watch, now: float) -> Stall:
        ranks = sorted(role_of(a) or a[:8] for a in self.actors() if model_of(a) == w.model)
        message = (
            f"{w.what} did not finish within {now - w.start:.0f} s ({CAP_FACTOR:g} x its deadline of "
            f"{w.allowed:.0f} s: {w.basis}), although its workers ({', '.join(ranks) or w.model}) answered their "
            "heartbeats: a collective that never completes, a deadlock, or a stage far slower than before. The "
            "run stopped and its workers were killed. The last complete checkpoint is kept and a rerun resumes from it. If the stage is only "
            "slow, raise runtime_args.stage_timeout_s (0: no deadline); to see where it hangs, run `py-spy dump "
            "--pid PID` on its workers while it hangs (`ps e` shows CHATLEARN_WORKER=model:rank).")
        return Stall(message)

    def _loop(self) -> None:
        while not self._closed.wait(TICK_S):
            stall = self.check()
            if stall is not None:
                self.stop(stall)
                return

    def stop(self, stall: Stall) -> None:
        """Record the stall, kill the stopped processes (those on this node by pid: SIGKILL ends a
        stopped process) and every actor of the run, so that the driver's waits end with an error
        the CLI reports as the stall; if the driver still runs ``GRACE_S`` later, interrupt it."""
        _STATE["stall"] = stall.message
        here = ("local",)  # the node a worker of a run without Ray names
        if sys.modules.get("ray") is not None:
            here += (sys.modules["ray"].util.get_node_ip_address(),)
        for beat in stall.stopped:
            if beat.get("node") in here and "pid" in beat and int(beat["pid"]) != os.getpid():
                with contextlib.suppress(OSError):
                    os.kill(int(beat["pid"]), signal.SIGKILL)
        for handle in list(self.actors().values()):
            with contextlib.suppress(Exception):
                kill(handle)
        if not self._closed.wait(GRACE_S):
            _thread.interrupt_main()
        if not self._closed.wait(GRACE_S):  # stuck where an interrupt does not reach (native code)
            sys.stderr.write(f"[chatlearn] error: {stall.message}\n")
            sys.stderr.flush()
            os._exit(1)

    def close(self) -> None:
        """The run is ending: stop looking, and drop its heartbeats from Ray's store. Not after a SIGTERM:
        a job stopped as a whole (Slurm) has lost Ray's GCS with it, and a call to it would wait 60 s
        and then end the process with Ray's error instead of the run's exit code 143."""
        self._closed.set()
        if self.floor > 0 and not terminated():
            with contextlib.suppress(Exception):
                forget_heartbeats(list(self.actors()))


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


_COLLECTIVE = re.compile(r"collective operation timeout|Timed out waiting \d+ ?ms|DistBackendError[^\n]*[Tt]imed? ?out"
                         r"|Watchdog caught collective|wait timeout after \d+")


def collective_timeout_message(err: BaseException, log_tail: str = "") -> str | None:
    """One paragraph for a run that failed because a torch.distributed collective timed out (the error,
    or the dead worker's log tail, says so); None otherwise."""
    text = f"{err}\n{log_tail}"
    if not _COLLECTIVE.search(text):
        return None
    role = role_of(getattr(err, "actor_id", None))
    m = re.search(r"\bpid[:=] ?(\d+)", str(err))
    who = f"the {role} worker" if role else "a trainer worker"
    where = f" (process {m.group(1)})" if m else ""
    during = f" during {_STATE['failed_in']}" if _STATE["failed_in"] else ""
    limit = _STATE["collective_s"]
    within = (f"within {limit:g} s ({CAP_FACTOR:g} x runtime_args.stage_timeout_s)" if limit
              else "within torch's default timeout (runtime_args.stage_timeout_s is 0)")
    return (f"{who}{where}: a collective operation of its process group did not complete {within}{during}: "
            "another rank of the group stopped, died or is stuck (a hung GPU collective). The run stopped; the last "
            "complete checkpoint is kept and a rerun resumes from it. If the stage is only slow, raise "
            "runtime_args.stage_timeout_s; to see where a rank hangs, run `py-spy dump --pid PID` on its process "
            "while it hangs (`ps e` shows CHATLEARN_WORKER=model:rank).")
