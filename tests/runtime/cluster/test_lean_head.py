"""A run's own Ray head starts without the dashboard's API server, the autoscaler's monitor and (where
the workers write their output into the run's logs folder) the log monitor, and Ray's own methods are
back once it has started."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.parametrize("log_monitor", [False, True])
def test_the_local_head_has_no_dashboard_or_monitor_and_runs_actors(log_monitor):
    code = f"""
log_monitor = {log_monitor}
import os, psutil, ray
from ray._private.node import Node
from chatlearn.runtime.cluster.cluster import HEAD_EXTRAS, LOG_MONITOR, lean_local_head
names = [*HEAD_EXTRAS, *LOG_MONITOR]
before = {{name: getattr(Node, name) for name in names}}
with lean_local_head(log_monitor=log_monitor):
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")
assert {{name: getattr(Node, name) for name in names}} == before  # restored
@ray.remote
class A:
    def pid(self):
        return os.getpid()
assert ray.get(A.remote().pid.remote()) != os.getpid()
lines = []
for child in psutil.Process().children(recursive=True):
    try:
        lines.append(" ".join(child.cmdline()))
    except psutil.Error:
        pass
print("dashboard" if any("dashboard/dashboard.py" in ln for ln in lines) else "-",
      "monitor" if any("autoscaler/_private/monitor.py" in ln for ln in lines) else "-",
      "log_monitor" if any("_private/log_monitor.py" in ln for ln in lines) else "-",
      "raylet" if any("raylet" in ln for ln in lines) else "-")
ray.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["-", "-", "log_monitor" if log_monitor else "-", "raylet"], out.stdout
