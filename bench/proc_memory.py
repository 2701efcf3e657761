"""Peak memory of a run and every process it creates, summed, by polling /proc (psutil).

Which processes: the run's root process, every descendant of it (Ray's GCS server, raylet and
its workers, vLLM engine processes, ...), and every process of this user started after the run
began whose environment carries the run's marker variable (``ENV_MARKER``, which child
processes inherit; it catches a process that was re-parented away from the tree before a poll
saw it). A process once counted stays counted until it exits.

What: every ``interval`` seconds the resident set sizes (RSS) of all those processes are added
up (the set of processes is renewed every ``pss_interval`` seconds: walking all of the machine's
processes costs the run more CPU than the sums); the result is the largest such sum. Nothing is subtracted: pages shared between processes
(shared libraries, Ray's shared-memory object store) count once per process that maps them, so
the sum is an upper bound of the memory the run occupies. Every ``pss_interval`` seconds the
proportional set sizes (PSS: shared pages divided among their users) are summed as well, which
counts shared pages once; both peaks are reported. ``cpu_s`` adds up the CPU time (user + system)
of every counted process as last seen (a process's time after its last poll is missed).
"""
from __future__ import annotations

import os
import threading
import time

import psutil

ENV_MARKER = "GRPO_BENCH_RUN"


def _has_marker(proc: psutil.Process, value: str) -> bool:
    try:
        return proc.environ().get(ENV_MARKER) == value
    except (psutil.Error, OSError):
        return False


class RunMemory:
    """Polls in a background thread between ``start()`` and ``stop()``; ``result()`` gives
    ``{"peak_rss_mb", "peak_pss_mb", "cpu_s", "max_processes", "samples"}`` (MB = 10^6 bytes)."""

    def __init__(self, root_pid: int, marker: str, interval: float = 0.2, pss_interval: float = 1.0):
        self.root_pid, self.marker = root_pid, marker
        self.interval, self.pss_interval = interval, pss_interval
        self.uid = os.getuid()
        self.started = time.time() - 1.0  # create_time has a coarse clock
        self.tracked: dict[int, psutil.Process] = {}
        self.rejected: set[tuple[int, float]] = set()
        self.cpu: dict[tuple[int, float], float] = {}  # (pid, create time) -> CPU seconds
        self.peak_rss = self.peak_pss = 0
        self.max_procs = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "RunMemory":
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return self.result()

    def result(self) -> dict:
        return {"peak_rss_mb": self.peak_rss / 1e6, "peak_pss_mb": self.peak_pss / 1e6,
                "cpu_s": sum(self.cpu.values()), "max_processes": self.max_procs, "samples": self.samples}

    def _discover(self) -> None:
        children: dict[int, list[int]] = {}
        candidates = []
        for proc in psutil.process_iter(["pid", "ppid", "uids", "create_time"]):
            info = proc.info
            if info["ppid"] is not None:
                children.setdefault(info["ppid"], []).append(info["pid"])
            if (info["pid"] not in self.tracked and info["uids"] is not None and info["uids"].real == self.uid
                    and (info["create_time"] or 0) >= self.started):
                candidates.append(proc)
        # descendants of the root
        stack = [self.root_pid]
        seen = set()
        while stack:
            pid = stack.pop()
            if pid in seen:
                continue
            seen.add(pid)
            if pid not in self.tracked:
                try:
                    self.tracked[pid] = psutil.Process(pid)
                except psutil.Error:
                    continue
            stack += children.get(pid, [])
        # re-parented processes that carry the run's marker
        for proc in candidates:
            key = (proc.pid, proc.info["create_time"])
            if proc.pid in self.tracked or key in self.rejected:
                continue
            if _has_marker(proc, self.marker):
                self.tracked[proc.pid] = proc
            else:
                self.rejected.add(key)

    def poll(self, with_pss: bool) -> None:
        """One sample: discover the run's processes (with every PSS sample, and at the first: a walk
        over all the machine's processes costs more than the sums), add up their RSS (and PSS)."""
        if with_pss or not self.samples:
            self._discover()
        rss = pss = 0
        alive = 0
        for pid, proc in list(self.tracked.items()):
            try:
                if with_pss:
                    full = proc.memory_full_info()
                    rss += full.rss
                    pss += full.pss
                else:
                    rss += proc.memory_info().rss
                t = proc.cpu_times()
                self.cpu[(pid, proc.create_time())] = t.user + t.system
                alive += 1
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                del self.tracked[pid]
            except psutil.AccessDenied:
                pass
        self.samples += 1
        self.peak_rss = max(self.peak_rss, rss)
        if with_pss:
            self.peak_pss = max(self.peak_pss, pss)
        self.max_procs = max(self.max_procs, alive)

    def _loop(self) -> None:
        last_pss = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            with_pss = now - last_pss >= self.pss_interval
            if with_pss:
                last_pss = now
            self.poll(with_pss)
            self._stop.wait(self.interval)
