"""A model's Ray actors, created on their devices, with calls fanned out to all of them."""
from __future__ import annotations

import contextlib
import os
import re
import threading
import time

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from chatlearn.calls import get, wait
from chatlearn.errors import UserError
from chatlearn.runtime.cluster.local import InlineActor, ProcessActor, WorkerDied
from chatlearn.runtime.cluster.roles import register, role_of
from chatlearn.runtime.cluster.watchdog import collective_env
from chatlearn.runtime.cluster.worker import Worker
from chatlearn.runtime.cluster.worker_env import worker_env


class Activity:
    """When the actors were busy: ``(method, start, end)`` on the driver's clock.

    A call's interval is ``[return - seconds, return]``, with ``seconds`` the longest time an
    actor spent in the method, so Ray's dispatch and transfers fall outside it.
    """

    def __init__(self):
        self.spans: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()

    def record(self, method: str, seconds: float) -> None:
        end = time.perf_counter()
        with self._lock:
            self.spans.append((method, end - seconds, end))

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()

    def busy(self, methods: set[str], since: float, until: float) -> float:
        """Seconds in ``[since, until]`` during which at least one call of ``methods`` ran."""
        spans = sorted((max(s, since), min(e, until)) for m, s, e in self.spans
                       if m in methods and e > since and s < until)
        total, cur_s, cur_e = 0.0, None, None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                total += (cur_e - cur_s) if cur_e is not None else 0.0
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        return total + ((cur_e - cur_s) if cur_e is not None else 0.0)


class CallTimeout(Exception):
    """Calls still running after ``timeout`` seconds, on the actors numbered ``stuck``."""

    def __init__(self, stuck: list[int], timeout: float):
        self.stuck, self.timeout = stuck, timeout
        super().__init__(f"actors {stuck} did not return within {timeout:g} s")


def dead_worker_message(err: BaseException) -> str | None:
    """One paragraph for a Ray actor that died (``RayActorError``) or a worker process of a run without
    Ray that ended (:class:`~chatlearn.runtime.cluster.local.WorkerDied`): which model and rank, its process
    and node, and the reason; ``None`` for any other error."""
    if isinstance(err, WorkerDied):
        return (f"the {role_of(err.actor_id) or err.role} worker (process {err.pid}) died: {err.reason}. "
                "The run stopped; the last complete checkpoint is kept and a rerun resumes from it. A worker "
                "killed without a Python error was usually out of memory or crashed in native code; its own "
                "output, where it has any, follows.")
    if not isinstance(err, ray.exceptions.RayActorError):
        return None
    text = str(err)
    role = role_of(getattr(err, "actor_id", None))
    who = f"the {role} worker" if role else "a worker of this run"
    where = []
    for field in ("pid", "ip"):
        m = re.search(rf"^\s*{field}: (\S+)", text, re.M)
        if m:
            where.append(f"{'process' if field == 'pid' else 'node'} {m.group(1)}")
    reason = " ".join(line.strip() for line in text.splitlines()
                      if line.strip() and not re.match(r"\s*(class_name|actor_id|pid|name|namespace|ip):", line)
                      and line.strip() != ray.exceptions.ActorDiedError.BASE_ERROR_MSG)
    return (f"{who}{' (' + ', '.join(where) + ')' if where else ''} died: "
            f"{reason.rstrip('. ') or 'no reason given by Ray'}. The run stopped; the last complete "
            "checkpoint is kept and a rerun resumes from it. A worker killed without a Python error was "
            "usually out of memory (lower the batch or length settings) or crashed in native code; its own "
            "output, where it has any, follows.")


class WorkerGroup:
    """N actors of one model. ``call`` runs a method on every actor and returns the results in rank order.
    ``target``: the model is a further object of those actors (a fused rollout replica in the trainer's
    processes, :meth:`chatlearn.runtime.cluster.worker.Worker.call_on`); None: their own object."""

    def __init__(self, name: str, actors: list, target: str | None = None):
        self.name = name
        self.actors = actors
        self.target = target
        self.activity: Activity | None = None  # set by the engine to account busy time
        self.watchdog = None  # set by the scheduler: the deadline of each call (chatlearn.runtime.cluster.watchdog)

    def __len__(self) -> int:
        return len(self.actors)

    def _remote(self, actor, method: str, *args, **kwargs):
        if self.target is None:
            return actor.call.remote(method, *args, **kwargs)
        return actor.call_on.remote(self.target, method, *args, **kwargs)

    def call_async(self, method: str, *args, **kwargs) -> list:
        return [self._remote(a, method, *args, **kwargs) for a in self.actors]

    def call(self, method: str, *args, **kwargs) -> tuple[list, float]:
        """Results of every actor, and the longest time any of them took."""
        with self._watched(method):
            outs = get(self.call_async(method, *args, **kwargs))
        return self._done(method, outs)

    def _watched(self, method: str):
        """A call outside any watched stage gets a deadline of its own (the watchdog's)."""
        if self.watchdog is None:
            return contextlib.nullcontext()
        return self.watchdog.watch(self.name, method, call=True)

    def call_each(self, method: str, per_actor_args: list[tuple], timeout: float | None = None
                  ) -> tuple[list, float]:
        """Actor i runs ``method(*per_actor_args[i])``. With ``timeout`` (seconds), a :class:`CallTimeout`
        naming the actors still running once it has passed; a call that fails raises at once."""
        refs = [self._remote(a, method, *args) for a, args in zip(self.actors, per_actor_args)]
        with self._watched(method):
            if timeout:
                pending, deadline = list(refs), time.monotonic() + timeout
                while pending:
                    ready, pending = wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
                    if not ready:
                        raise CallTimeout([refs.index(r) for r in pending], timeout)
                    get(ready)  # the error of a failed call, now
            outs = get(refs)
        return self._done(method, outs)

    def _done(self, method: str, outs: list) -> tuple[list, float]:
        seconds = max((s for _, s in outs), default=0.0)
        if self.activity is not None:
            self.activity.record(method, seconds)
        return [o for o, _ in outs], seconds


def _bundle_device(_: int) -> tuple[str, list[str]]:
    """(node id, GPU ids Ray assigns here): run inside a placement-group bundle."""
    return ray.get_runtime_context().get_node_id(), [str(i) for i in ray.get_gpu_ids()]


def bundle_devices(pg: PlacementGroup, bundles: list[int], gpu_fraction: float) -> list[tuple[str, str]]:
    """The (node id, GPU id) behind each of ``bundles``, found by a short task on each one.

    A bundle of ``{"GPU": 1}`` holds one device of its node for the placement group's life: every
    task or actor scheduled on it gets that device's id (``ray.get_gpu_ids()``, the ids Ray writes
    into ``CUDA_VISIBLE_DEVICES``).
    """
    probe = ray.remote(_bundle_device)
    refs = [probe.options(num_cpus=0, num_gpus=gpu_fraction, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=b)).remote(b) for b in bundles]
    found = []
    for b, (node, ids) in zip(bundles, ray.get(refs)):
        if len(ids) != 1:
            raise RuntimeError(f"placement-group bundle {b} gave {ids} GPU ids; expected one")
        found.append((node, ids[0]))
    return found


def spanning_env(pg: PlacementGroup, bundles: list[int], gpu_fraction: float) -> dict[str, str]:
    """Environment of an actor that drives one engine over the devices of ``bundles``.

    The actor itself takes ``gpu_fraction`` of the first bundle; Ray would make only that device
    visible to it (``CUDA_VISIBLE_DEVICES``). The engine starts one process per tensor-parallel rank
    on devices ``0 .. N-1`` of those the actor sees (vLLM's multiprocess executor: rank r on
    ``cuda:r``; SGLang: scheduler r on ``base_gpu_id + r``, ``base_gpu_id`` 0), so the actor is
    shown the N devices, in bundle order, and Ray is told to leave that alone
    (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``, read by Ray's NVIDIA accelerator manager
    in the worker process). The devices must be on one node.
    """
    found = bundle_devices(pg, bundles, gpu_fraction)
    nodes = {node for node, _ in found}
    if len(nodes) > 1:
        raise UserError(f"a tensor-parallel rollout replica needs its {len(bundles)} devices on one node, but "
                        f"placement-group bundles {bundles} landed on {len(nodes)} nodes. Use a "
                        "models.policy.tensor_model_parallel_size that divides the GPUs per node.")
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpu for _, gpu in found),
            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def start_actors(name: str, factory: str, *, num_actors: int, pg: PlacementGroup | None, bundles: list[int],
                 gpu_fraction: float, cpus: float, threads: int, env: dict[str, str] | None = None,
                 devices_per_actor: int = 1, place: str = "ray") -> list:
    """Start the processes of ``name``'s actors (see :func:`create_group`) without building the
    backend: each imports the backend's module and then waits for its ``setup``. Starting every
    model's processes at once overlaps their start-up while the models are still built one after
    another. ``place``: ``ray`` (Ray actors), ``process`` or ``inline`` (a run without Ray:
    :mod:`chatlearn.runtime.cluster.local`; inline, the actor is built in this process, whose
    environment ``env`` then updates)."""
    env = dict(env) if env is not None else worker_env("reward", "reward", threads)
    if place != "ray":
        return [_local_actor(name, i, factory, threads, env, place) for i in range(num_actors)]
    k = devices_per_actor
    if k > 1 and (pg is None or len(bundles) != num_actors * k):
        raise ValueError(f"{name}: {num_actors} actor(s) x {k} devices need a placement group and "
                         f"{num_actors * k} bundles, got {len(bundles)}")
    actors = []
    for i in range(num_actors):
        actor_env = env
        if k > 1:
            actor_env = {**env, **spanning_env(pg, bundles[i * k:(i + 1) * k], gpu_fraction)}
        # CHATLEARN_WORKER names the process's model and index (in `ps e`, /proc/<pid>/environ)
        opts = {"num_cpus": cpus, "num_gpus": gpu_fraction, "name": None,
                "runtime_env": {"env_vars": {**actor_env, "CHATLEARN_WORKER": f"{name}:{i}"}}}
        if pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundles[i * k])
        actor = ray.remote(Worker).options(**opts).remote(threads, factory.split(":")[0], name != "reward")
        register(actor, name, i)
        actors.append(actor)
    return actors


def _local_actor(name: str, index: int, factory: str, threads: int, env: dict[str, str], place: str):
    preload, uses_torch = factory.split(":")[0], name != "reward"
    if place == "inline":
        # vLLM's own console handler would print in the driver's console: its loggers then propagate to
        # the run's log routing (chatlearn.logging.console) instead
        os.environ.update({"VLLM_CONFIGURE_LOGGING": "0", **os.environ, **env})
        actor = InlineActor(name, threads, preload, uses_torch)
    else:
        actor = ProcessActor(name, threads, preload, uses_torch,
                             {**os.environ, **env, "CHATLEARN_WORKER": f"{name}:{index}"})
    register(actor, name, index)
    return actor


def create_group(name: str, factory: str, spec, *, num_actors: int, pg: PlacementGroup | None,
                 bundles: list[int], gpu_fraction: float, cpus: float, threads: int,
                 distributed: bool, env: dict[str, str] | None = None,
                 devices_per_actor: int = 1, actors: list | None = None, place: str = "ray") -> WorkerGroup:
    """Start ``num_actors`` actors (actor i on bundle ``bundles[i]``) and build the backend in each.

    ``distributed``: the actors form one torch.distributed world (trainer ranks); rank 0's node
    hosts the rendezvous. ``env``: the workers' environment (``chatlearn.runtime.cluster.worker_env.worker_env``;
    a plain CPU worker's when not given), set by Ray before each process starts.
    ``devices_per_actor`` > 1 (a tensor-parallel rollout engine per actor): ``bundles`` holds
    ``devices_per_actor`` bundles per actor, in actor order; actor i runs on the first of its
    bundles and sees the devices of all of them (:func:`spanning_env`). ``actors``: started
    earlier with the same arguments (:func:`start_actors`).
    """
    if actors is None:
        actors = start_actors(name, factory, num_actors=num_actors, pg=pg, bundles=bundles,
                              gpu_fraction=gpu_fraction, cpus=cpus, threads=threads, env=env,
                              devices_per_actor=devices_per_actor, place=place)
    envs: list[dict] = [{} for _ in actors]
    if distributed:
        addr, port = get(actors[0].address.remote())
        envs = [{"MASTER_ADDR": addr, "MASTER_PORT": str(port), "RANK": str(i), "WORLD_SIZE": str(num_actors),
                 "LOCAL_RANK": "0", **collective_env()} for i in range(num_actors)]
    get([a.setup.remote(factory, spec, e) for a, e in zip(actors, envs)])
    return WorkerGroup(name, actors)
