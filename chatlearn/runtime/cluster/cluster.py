"""Ray start-up and placement: one placement group of device bundles, models placed on it.

On a machine without a GPU, devices are Ray's *logical* GPUs: the same placement code runs,
actors get fractional GPU shares and torch runs on the CPU. With ``RAY_ADDRESS`` set, chatlearn
joins that cluster instead of starting a local one.
"""
from __future__ import annotations

import contextlib
import gc
import os
import socket
import sys
import urllib.parse

import ray
from omegaconf import DictConfig
from ray.util.placement_group import placement_group, remove_placement_group

from chatlearn.calls import get
from chatlearn.config import registry
from chatlearn.config.plan import Plan
from chatlearn.errors import UserError
from chatlearn.logging.console import (NativeOutputToLog, info, ray_init_options, raylet_lines_to_log, reroute_logs,
                                       workers_stream_to_driver)
from chatlearn.logging.gpu_memory import visible_gpu_count
from chatlearn.models.specs import JudgeSpec, RewardModelSpec, RewardSpec, RolloutSpec, TrainerSpec
from chatlearn.runtime.cluster import local
from chatlearn.runtime.cluster.group import WorkerGroup, create_group, start_actors
from chatlearn.runtime.cluster.leftovers import clean_leftovers, mark_driver
from chatlearn.runtime.cluster.local import InlineActor, ProcessActor, kill
from chatlearn.runtime.cluster.signals import stop_on_sigterm, terminated
from chatlearn.runtime.cluster.worker_env import worker_env

BACKENDS = registry.backend_factories()  # backend name -> "module:Class" (declared in chatlearn.config.registry)


def use_auth_token_if_present() -> None:
    """Send Ray's authentication token when one is available and the mode is not chosen.

    ``ray start --head`` turns token authentication on and stores the token (by default in
    ``~/.ray/auth_token``), but a driver that connects by address sends it only in token mode
    (``RAY_AUTH_MODE=token``); clusters without authentication accept such a driver too.
    Ray's own helper does that (it also refreshes Ray's cached config, which has read the
    environment at import).
    """
    if os.environ.get("RAY_AUTH_MODE"):
        return
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available)
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


START_A_CLUSTER = ("Start it first (`ray start --head` on the head node, `ray start --address=HEAD:PORT` on the "
                   "others) and use the address it prints, or unset RAY_ADDRESS to run on this machine alone.")


def check_ray_address(address: str, timeout_s: float) -> None:
    """Refuse, within ``timeout_s``, a ``RAY_ADDRESS`` (``host:port`` or ``ray://host:port``) at which
    nothing accepts a connection: Ray's own connect retries for minutes before it gives up. ``auto``,
    ``local`` and addresses without a port are left to ``ray.init``. A port that accepts but is not a
    Ray cluster is still Ray's to time out."""
    target = address[len("ray://"):] if address.startswith("ray://") else address
    if target in ("auto", "local"):
        return
    try:
        parts = urllib.parse.urlsplit("//" + target)
        host, port = parts.hostname, parts.port
    except ValueError:
        return  # ray.init names what is wrong with it
    if not host or port is None:
        return
    # ray.init connects to this node's IP for a local host name: either answering will do
    hosts = [host] + ([ray.util.get_node_ip_address()] if host in ("localhost", "127.0.0.1", "::1") else [])
    failures = []
    for candidate in hosts:
        try:
            with socket.create_connection((candidate, port), timeout=timeout_s):
                return
        except socket.timeout:
            failures.append(f"no answer within {timeout_s:g} s (runtime_args.ray_connect_timeout_s)")
        except OSError as err:
            why = err.strerror or type(err).__name__
            failures.append(f"{why[0].lower()}{why[1:]}")
    why = failures[0]  # the address as given
    raise UserError(f"could not reach the Ray cluster at RAY_ADDRESS={address!r} (host {host}, port {port}): "
                    f"{why}. {START_A_CLUSTER}")


def _no_api_server(node, **_):
    node._webui_url = None  # what Ray records when its dashboard did not come up


def _not_started(node):
    pass


# the processes of a Ray head that a run of its own never uses, and what Ray starts them with
# (ray._private.node.Node, Ray 2.40 to 2.60): the dashboard's API server (ray.init starts it even with
# include_dashboard=False, for job submission and the state API, and waits for it) and the autoscaler's
# monitor (nothing to scale on a cluster of one node); and the log monitor, which streams the workers'
# standard output to the driver, where they write it into <output_dir>/logs/ instead
# (chatlearn.logging.console.workers_stream_to_driver: not with --verbose, nor without a logs folder)
HEAD_EXTRAS = {"start_api_server": _no_api_server, "start_monitor": _not_started}
LOG_MONITOR = {"start_log_monitor": _not_started}


@contextlib.contextmanager
def lean_local_head(log_monitor: bool = False):
    """While it is open, ``ray.init`` starts a local head without the processes of ``HEAD_EXTRAS``
    (and of ``LOG_MONITOR`` unless ``log_monitor``): about 1.7 s less start-up, 1.2 s less shutdown and
    200 MB less memory for every run. A Ray whose ``Node`` lacks those methods starts as it is. A run
    that wants the dashboard joins a cluster started with ``ray start --head`` (``RAY_ADDRESS``)."""
    try:
        from ray._private.node import Node
    except ImportError:
        Node = None
    extras = {**HEAD_EXTRAS, **({} if log_monitor else LOG_MONITOR)}
    saved = {name: getattr(Node, name) for name in extras if Node is not None and hasattr(Node, name)}
    try:
        for name in saved:
            setattr(Node, name, extras[name])
        yield
    finally:
        for name, method in saved.items():
            setattr(Node, name, method)


class Cluster:
    """Starts (or joins) Ray, reserves the devices of the plan, and creates each model's actors; with
    ``plan.single_process``, no Ray: the models are built in this process and the reward workers in
    processes of their own (:mod:`chatlearn.runtime.cluster.local`)."""

    def __init__(self, cfg: DictConfig, plan: Plan):
        self.cfg, self.plan = cfg, plan
        self.started_ray = False
        self.pg = None
        self.groups: dict[str, WorkerGroup] = {}
        self.specs: dict[str, object] = {}  # the spec each created model was built from
        # prestart: (group arguments, actors) of models whose processes run ahead of their creation
        self._started: dict[str, tuple] = {}
        self.local = plan.single_process
        self._restore: tuple | None = None  # a run without Ray: the environment and threads to put back
        self._native_output = NativeOutputToLog()

    def __enter__(self) -> "Cluster":
        plan, m = self.plan, self.cfg.models
        reward_cpus = m.reward.num_cpu
        if self.local:
            clean_leftovers()  # of earlier runs whose driver was killed
            mark_driver()  # the reward workers' processes carry this driver's pid
            torch = sys.modules.get("torch")
            self._restore = (dict(os.environ), torch.get_num_threads() if torch is not None else None)
            stop_on_sigterm()
            # what the driver holds so far (the prompts, the config, its imports) lives through the run:
            # the collector stops scanning it, as it would in a process of the models' own (vLLM's
            # engine collects twice while it loads, seconds over a driver's heap)
            gc.freeze()
            # the models' native output (C/C++ warnings) to the run's logs, as a worker process's
            self._native_output = NativeOutputToLog().__enter__()
            return self
        if not ray.is_initialized():
            clean_leftovers()  # of earlier runs whose driver was killed
            os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # plain "(Worker pid=...)" prefixes in logs
            if os.environ.get("RAY_ADDRESS"):
                info(f"joining the Ray cluster at {os.environ['RAY_ADDRESS']}")
                check_ray_address(os.environ["RAY_ADDRESS"], self.cfg.runtime_args.ray_connect_timeout_s)
                use_auth_token_if_present()
                try:
                    ray.init(address=os.environ["RAY_ADDRESS"], **ray_init_options())
                except (ConnectionError, RuntimeError, ValueError) as err:
                    raise UserError(
                        f"could not join the Ray cluster at RAY_ADDRESS={os.environ['RAY_ADDRESS']!r} ({err}). "
                        f"{START_A_CLUSTER}") from err
            else:
                gpus = visible_gpu_count() or plan.total_devices  # logical devices without a GPU
                mark_driver()  # the local Ray processes carry this driver's pid: orphans can be found
                # "local": a new cluster of this run's own, even where `ray start` ran before
                # no idle workers started ahead: every actor of a run has an environment of its own
                # (runtime_env), so a prestarted default worker is never used, only held in memory
                with lean_local_head(log_monitor=workers_stream_to_driver()):
                    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, reward_cpus), num_gpus=gpus,
                             include_dashboard=False, _system_config={"enable_worker_prestart": False,
                                                                      "prestart_worker_first_driver": False},
                             **ray_init_options())
            self.started_ray = True
            stop_on_sigterm()  # ray.init replaced the driver's SIGTERM handler with its own
            raylet_lines_to_log()  # Ray's "(raylet) A worker died ..." beside chatlearn's own paragraph: to the log
        have = {"GPU": 0, "CPU": 0, **ray.cluster_resources()}
        if have["GPU"] < plan.total_devices:
            raise UserError(
                f"the placement needs {plan.total_devices} devices ({'; '.join(plan.describe()[:len(plan.device_groups)])}) "
                f"but the Ray cluster has {have['GPU']:g} GPUs. Lower models.*.num_gpu, colocate models "
                "(runtime_args.colocation), or add nodes.")
        if have["CPU"] < reward_cpus:
            raise UserError(f"models.reward.num_cpu ({reward_cpus}) exceeds the {have['CPU']:g} CPUs of "
                            "the Ray cluster. Lower it.")
        self.pg = placement_group([{"GPU": 1}] * plan.total_devices, strategy="PACK")
        ray.get(self.pg.ready(), timeout=300)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:  # a normal end: workers remove their temporary files (vLLM's rendezvous files)
            try:
                get([a.release_temp_files.remote() for g in self.groups.values() for a in g.actors],
                    timeout=30)
            except Exception:  # noqa: BLE001 - cleanup only; a later start removes what is left
                pass
        for actor in [a for g in self.groups.values() for a in g.actors] + [
                a for _, started in self._started.values() for a in started]:
            if isinstance(actor, ProcessActor) and exc is None:
                actor.stop()
            elif isinstance(actor, InlineActor) and not local.PROCESS_ENDS_WITH_RUN:
                # its engines shut down before the process group goes (_leave_process): vLLM's own
                # teardown at the interpreter's exit would find the group gone
                with contextlib.suppress(Exception) if exc is not None else contextlib.nullcontext():
                    actor.stop()
            else:
                kill(actor)
        if self.local:
            self._native_output.__exit__(exc_type, exc, tb)
            if not local.PROCESS_ENDS_WITH_RUN:
                self._leave_process()
            return
        # Removing the placement group is a call to the GCS that blocks until Ray gives up on it
        # (60 s, then the process is killed) when the GCS is gone, as after a SIGTERM to the whole
        # job. A local Ray we started goes with ray.shutdown(), and Ray removes a job's placement
        # groups when its driver leaves, so it is only removed explicitly where that is safe.
        if self.pg is not None and not self.started_ray and not terminated():
            remove_placement_group(self.pg)
        if self.started_ray:
            ray.shutdown()

    def _leave_process(self) -> None:
        """A run without Ray ends: its process group goes, its models are freed, and the environment
        and torch's threads are what they were before it (the driver may run more)."""
        self.groups.clear()
        self._started.clear()
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        gc.unfreeze()
        gc.collect()
        env, threads = self._restore
        os.environ.clear()
        os.environ.update(env)
        if threads is not None:
            sys.modules["torch"].set_num_threads(threads)

    def device_offset(self, group_index: int) -> int:
        return sum(self.plan.devices_per_group[:group_index])

    def _group_args(self, name: str) -> tuple[str, object, dict]:
        """(backend factory, its spec, the keyword arguments of ``start_actors``) of ``name``."""
        cfg, plan = self.cfg, self.plan
        pl = plan.placements[name]
        threads = max(1, (os.cpu_count() or 1) // max(1, plan.total_devices))
        kind = plan.kind(name)
        if kind.backend == "reward":
            per = cfg.models.reward.cpu_per_process or 1
            return BACKENDS["reward"], RewardSpec.from_config(cfg), dict(
                num_actors=pl.num_actors, pg=None, bundles=[], gpu_fraction=0, cpus=per, threads=per,
                env=worker_env(kind.worker, "reward", per), place="process" if self.local else "ray")
        sharing = len([x for x in plan.device_groups[pl.device_group] if x in plan.placements
                       and plan.placements[x].device_group == pl.device_group])
        frac = round(1.0 / sharing - 0.005, 2) if sharing > 1 else 1.0
        bundles = [self.device_offset(pl.device_group) + d for d in pl.devices]
        if kind.backend == "rollout":
            backend = cfg.runtime_args.rollout_backend
            spec, env = RolloutSpec.from_config(cfg), worker_env(kind.worker, backend, threads)
        elif kind.backend == "judge":  # a causal LM on a rollout engine of its own
            backend = "judge"
            spec, env = JudgeSpec.from_config(cfg, name), worker_env(kind.worker, cfg.models[name].backend, threads)
        elif kind.backend == "reward_model":  # FSDP2 inference, whatever the training backend
            backend = "reward_model"
            spec, env = RewardModelSpec.from_config(cfg, name), worker_env(kind.worker, "fsdp", threads)
        else:
            backend = cfg.runtime_args.train_backend
            spec = TrainerSpec.from_config(cfg, name, plan)
            env = worker_env(kind.worker, backend, threads, cfg.models[name].use_expandable_segments)
        return BACKENDS[backend], spec, dict(num_actors=pl.num_actors, pg=self.pg, bundles=bundles,
                                            gpu_fraction=frac, cpus=0, threads=threads, env=env,
                                            devices_per_actor=pl.devices_per_actor,
                                            place="inline" if self.local else "ray")

    def prestart(self, names) -> None:
        """Start the processes of every model in ``names`` now (each imports its backend and waits):
        their start-up overlaps, while :meth:`create` still builds the models one after another
        (on shared devices the order matters: the rollout engine sizes its cache from what is left).
        Without Ray, the reward workers' processes start first: the models' imports in this process
        then overlap them."""
        if self.local:
            names = sorted(names, key=lambda n: n != "reward")
        for name in names:
            if name == "policy" and self.plan.fused_rollout:
                continue  # built in the trainer's processes
            if name not in self._started:
                args = self._group_args(name)
                self._started[name] = (args, start_actors(name, args[0], **args[2]))

    def create(self, name: str) -> WorkerGroup:
        if name == "policy" and self.plan.fused_rollout:
            return self._create_fused_rollout()
        (factory, spec, kwargs), actors = self._started.pop(name, None) or (self._group_args(name), None)
        group = create_group(name, factory, spec, distributed=self.plan.kind(name).distributed,
                             actors=actors, **kwargs)
        self.groups[name], self.specs[name] = group, spec
        if self.local:
            reroute_logs()  # the loggers of what the model imported into this process
        return group

    def startup_times(self) -> dict[str, list[dict]]:
        """Per model, each process's :meth:`~chatlearn.runtime.cluster.worker.Worker.startup_times`."""
        refs = {name: [a.startup_times.remote(g.target) for a in g.actors] for name, g in self.groups.items()}
        return {name: get(r, timeout=60) for name, r in refs.items()}

    def _create_fused_rollout(self) -> WorkerGroup:
        """``runtime_args.fuse_rollout``: rollout replica i built in policy trainer rank i's process (the
        trainer is built first), reached through the trainer's actors as their object ``policy``."""
        factory, spec, _ = self._group_args("policy")
        actors = self.groups["policy_trainer"].actors
        get([a.setup.remote(factory, spec, None, "policy") for a in actors])
        group = WorkerGroup("policy", actors, target="policy")
        self.groups["policy"], self.specs["policy"] = group, spec
        if self.local:
            reroute_logs()
        return group
