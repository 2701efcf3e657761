"""The workers' side of the heartbeats: a thread in every Ray worker process that writes, every
``HEARTBEAT_S`` seconds, a counter, its process id, node and the method it is running into Ray's
key-value store, which the driver's watchdog (:mod:`chatlearn.runtime.cluster.watchdog`) reads once a
stage is overdue to tell a slow worker from a stopped one."""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable

HEARTBEAT_S = 2.0
NAMESPACE = "chatlearn_heartbeat"


def start_heartbeat(doing: Callable[[], tuple[str | None, float]]) -> threading.Thread | None:
    """In a worker: a daemon thread writing this process's heartbeat every ``HEARTBEAT_S`` seconds;
    ``doing()`` gives the method running now and for how long. None outside a Ray actor."""
    import ray
    from ray.experimental import internal_kv

    actor = ray.get_runtime_context().get_actor_id()
    if actor is None:
        return None
    key, pid, node = f"{actor}".encode(), os.getpid(), ray.util.get_node_ip_address()

    def beat() -> None:
        count = 0
        while True:
            count += 1
            method, running = doing()
            value = json.dumps({"n": count, "pid": pid, "node": node, "method": method, "running_s": running})
            try:
                internal_kv._internal_kv_put(key, value.encode(), overwrite=True, namespace=NAMESPACE)
            except Exception:  # noqa: BLE001 - Ray going away: the run is ending
                return
            time.sleep(HEARTBEAT_S)

    thread = threading.Thread(target=beat, name="chatlearn-heartbeat", daemon=True)
    thread.start()
    return thread
