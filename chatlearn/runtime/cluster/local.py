"""Workers of a run without Ray (``runtime_args.single_process``), and calls that work with either kind.

Where every model of a run lives in one process on one machine (:func:`chatlearn.config.plan._single_process`),
Ray's head, its worker processes and the copies through its object store buy nothing: the models are built
in the driver's own process (:class:`InlineActor`) and the reward workers, which run user code that may
hang or end its process, in processes of their own started here (:class:`ProcessActor`). Both answer the
calls the driver makes of a Ray actor: ``actor.method.remote(*args)`` returns a future, and
``chatlearn.calls`` (``get``, ``wait``, ``put``) and :func:`kill` take Ray's objects and these alike.

What Ray's calls guarantee is kept: one call at a time per actor, in the order made; arguments and
results are values of their own (dicts and lists copied, numpy arrays handed over read-only, as Ray's
object store hands them out), so neither side changes what the other holds; an actor's error is raised
by :func:`get`; a worker process that ends fails its calls with :class:`WorkerDied`, naming it.
"""
from __future__ import annotations

import itertools
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import traceback
from concurrent import futures
from multiprocessing.connection import Connection

from chatlearn.runtime.cluster.worker import Worker

_IDS = itertools.count()
# set by the ``chatlearn`` command (chatlearn.cli.entry): this process ends with the run, so a run
# without Ray leaves its models to the process's end instead of tearing them down
PROCESS_ENDS_WITH_RUN = False


class WorkerDied(RuntimeError):
    """A worker process of a run without Ray ended (or was stopped by the run) while calls were due."""

    def __init__(self, actor_id: str, role: str, pid: int | None, reason: str):
        self.actor_id, self.role, self.pid, self.reason = actor_id, role, pid, reason
        super().__init__(f"the {role} worker died: {reason}\n  pid: {pid}")

    def __reduce__(self):
        return (WorkerDied, (self.actor_id, self.role, self.pid, self.reason))


class _ActorId(str):
    def hex(self) -> str:  # as a Ray actor's id is named (``actor._actor_id.hex()``)
        return str(self)


class _Method:
    __slots__ = ("actor", "name")

    def __init__(self, actor: "LocalActor", name: str):
        self.actor, self.name = actor, name

    def remote(self, *args, **kwargs) -> futures.Future:
        return self.actor.submit(self.name, args, kwargs)


class LocalActor:
    """What the two kinds share: ``actor.<method>.remote(...)``, a name, an id."""

    def __init__(self, role: str):
        self.role = role
        self._actor_id = _ActorId(f"local{os.getpid()}x{next(_IDS)}")
        self.dead: str | None = None  # why it takes no more calls

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def submit(self, method: str, args: tuple, kwargs: dict) -> futures.Future:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError


def _failed(err: BaseException) -> futures.Future:
    f = futures.Future()
    f.set_exception(err)
    return f


def handed_over(value):
    """``value`` as the receiving side of a Ray call gets it, without copying data: containers are new,
    numpy arrays read-only views (Ray's object store hands them out so), everything else itself."""
    if isinstance(value, dict):
        return {k: handed_over(v) for k, v in value.items()}
    if isinstance(value, list):
        return [handed_over(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(handed_over(v) for v in value)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray) and value.dtype != object:
        view = value.view()
        view.flags.writeable = False
        return view
    return value


def _resolved(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Ray's objects among the top-level arguments replaced by their values (as Ray does)."""
    ray = sys.modules.get("ray")
    if ray is None:
        return args, kwargs
    kind = ray.ObjectRef
    return (tuple(ray.get(a) if isinstance(a, kind) else a for a in args),
            {k: ray.get(v) if isinstance(v, kind) else v for k, v in kwargs.items()})


class InlineActor(LocalActor):
    """A :class:`~chatlearn.runtime.cluster.worker.Worker` in this process: a call runs in the calling
    thread, one at a time, and returns a finished future."""

    def __init__(self, role: str, threads: int, preload: str | None, uses_torch: bool = True):
        super().__init__(role)
        self._lock = threading.Lock()
        self._worker = Worker(threads, preload, uses_torch, place="inline")

    def submit(self, method: str, args: tuple, kwargs: dict) -> futures.Future:
        args, kwargs = _resolved(args, kwargs)
        with self._lock:
            if self.dead is not None:
                return _failed(WorkerDied(self._actor_id, self.role, os.getpid(), self.dead))
            f = futures.Future()
            try:
                out = getattr(self._worker, method)(*handed_over(args), **handed_over(kwargs))
            except Exception as err:  # noqa: BLE001 - raised by get(), as Ray raises a task's error
                f.set_exception(err)
            else:
                f.set_result(handed_over(out))
            return f

    def heartbeat(self) -> dict:
        """What a Ray worker's heartbeat says (chatlearn.runtime.cluster.watchdog): this process answers
        as long as the watchdog that asks runs."""
        worker = self._worker  # read once: kill() may drop it meanwhile (the watchdog asks from its thread)
        method, running = worker.doing() if worker is not None else (None, 0.0)
        return {"n": int(time.monotonic() // 2), "pid": os.getpid(), "node": "local", "method": method,
                "running_s": running}

    def kill(self) -> None:
        """Take no more calls and drop the worker's objects (a call running now runs to its end)."""
        self.dead = self.dead or "stopped by the run"
        self._worker = None

    def stop(self) -> None:
        """The run ended: the worker's engines are shut down (``Worker.close``), then it takes no more calls."""
        with self._lock:
            if self._worker is not None:
                self._worker.close()
        self.kill()


class ProcessActor(LocalActor):
    """A :class:`~chatlearn.runtime.cluster.worker.Worker` in a process of its own (``python -m
    chatlearn.runtime.cluster.local``), started with ``env`` as its whole environment; calls and
    results travel pickled over a socket pair. Its standard output and error are this process's until
    the worker sends them to the run's logs folder."""

    def __init__(self, role: str, threads: int, preload: str | None, uses_torch: bool, env: dict[str, str]):
        super().__init__(role)
        mine, theirs = socket.socketpair()
        self._proc = subprocess.Popen([sys.executable, "-m", "chatlearn.runtime.cluster.local", str(theirs.fileno())],
                                      env=env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self.pid = self._proc.pid
        # the socket itself is kept: its shutdown() ends the process's input and wakes this side's reader
        self._sock = mine
        self._conn = Connection(os.dup(mine.fileno()))
        self._send_lock, self._pending_lock = threading.Lock(), threading.Lock()
        self._pending: dict[int, futures.Future] = {}
        self._calls = itertools.count(1)
        self._send(0, "__init__", (threads, preload, uses_torch), {}, futures.Future())
        threading.Thread(target=self._read, name=f"chatlearn-{role}-results", daemon=True).start()

    def _send(self, call: int, method: str, args: tuple, kwargs: dict, f: futures.Future) -> futures.Future:
        with self._pending_lock:
            if self.dead is not None:
                return _failed(WorkerDied(self._actor_id, self.role, self.pid, self.dead))
            self._pending[call] = f
        try:
            data = pickle.dumps((call, method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
            with self._send_lock:
                self._conn.send_bytes(data)
        except (OSError, EOFError):
            pass  # the process is gone: the reader fails the call
        except Exception as err:  # noqa: BLE001 - arguments that do not pickle: this call's error
            with self._pending_lock:
                self._pending.pop(call, None)
            f.set_exception(err)
        return f

    def submit(self, method: str, args: tuple, kwargs: dict) -> futures.Future:
        args, kwargs = _resolved(args, kwargs)
        return self._send(next(self._calls), method, args, kwargs, futures.Future())

    def _read(self) -> None:
        while True:
            try:
                call, ok, value = pickle.loads(self._conn.recv_bytes())
            except (OSError, EOFError):
                break
            except Exception as err:  # noqa: BLE001 - a result that does not unpickle here
                call, ok, value = -1, False, err
            with self._pending_lock:
                f = self._pending.pop(call, None)
            if f is None or f.done():
                continue
            if ok:
                f.set_result(value)
            else:
                f.set_exception(value)
        code = self._proc.wait()
        self._conn.close()
        self._sock.close()
        reason = self.dead or (f"its process exited with code {code}" if code >= 0
                               else f"its process was killed by signal {-code}")
        with self._pending_lock:
            self.dead = reason
            pending, self._pending = list(self._pending.values()), {}
        for f in pending:
            if not f.done():
                f.set_exception(WorkerDied(self._actor_id, self.role, self.pid, reason))

    def heartbeat(self) -> dict:
        alive = self._proc.poll() is None
        return {"n": int(time.monotonic() // 2) if alive else -1, "pid": self.pid, "node": "local",
                "method": None, "running_s": 0.0}

    def kill(self) -> None:
        """SIGKILL the process; its calls still due fail with :class:`WorkerDied`."""
        with self._pending_lock:
            self.dead = self.dead or "killed by the run"
        self._proc.kill()
        self._proc.wait()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the process: its input closes, it exits; killed if it has not within ``timeout_s``."""
        with self._pending_lock:
            self.dead = self.dead or "stopped by the run"
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already closed by the other side
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


# ---------------------------------------------------------------------------- calls of either kind
def kill(actor) -> None:
    """``ray.kill``, or a local actor's :meth:`LocalActor.kill`."""
    if isinstance(actor, LocalActor):
        actor.kill()
        return
    import ray

    ray.kill(actor)


def died_errors() -> tuple[type, ...]:
    """The errors of a call whose worker died: Ray's and :class:`WorkerDied`."""
    import ray

    return (ray.exceptions.RayActorError, WorkerDied)


# ---------------------------------------------------------------------------- the worker process
def _portable(err: BaseException) -> BaseException:
    """``err`` as it can travel back: itself when it pickles, with the worker's traceback as a note."""
    text = "".join(traceback.format_exception(err))
    try:
        err.add_note(f"(in the worker process {os.getpid()}:)\n{text.rstrip()}")
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
        return RuntimeError(text)


def serve(fd: int) -> None:
    """A worker process's loop: build the worker from the first message, then answer each call in turn.
    Ends when the driver's side of the socket closes (the run ended, or its driver died)."""
    conn = Connection(fd)
    worker, broken = None, None
    while True:
        try:
            call, method, args, kwargs = pickle.loads(conn.recv_bytes())
        except (OSError, EOFError):
            os._exit(0)
        try:
            if method == "__init__":
                worker = Worker(*args, place="process")
                reply = (call, True, None)
            elif broken is not None:
                reply = (call, False, broken)
            else:
                reply = (call, True, getattr(worker, method)(*args, **kwargs))
        except Exception as err:  # noqa: BLE001 - the caller's error
            reply = (call, False, _portable(err))
            if method == "__init__":
                broken = reply[2]
        try:
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001 - a result that does not pickle
            data = pickle.dumps((call, False, _portable(TypeError(f"the result of {method} does not pickle: {err}"))))
        conn.send_bytes(data)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
