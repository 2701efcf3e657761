"""A real run whose trainer process is stopped (SIGSTOP, as a hung GPU collective or a frozen node looks
from the driver) ends by itself: the watchdog (runtime_args.stage_timeout_s) stops it with exit 1 and
one paragraph naming the model, rank and stage, and no process of the run is left behind."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from test_reliability_e2e import has_rows, session_processes, start, wait_for, worker_pid

pytestmark = pytest.mark.slow  # a whole run


@pytest.mark.timeout(600)
def test_a_stopped_worker_stops_the_run_naming_model_rank_and_stage(tmp_path):
    out = tmp_path / "out"
    # the trainer in a process of its own (Ray): without Ray it is the driver's process, which a SIGSTOP
    # stops whole (tests/runtime/cluster/test_watchdog.py: a stage that hangs in it meets the cap)
    proc = start(out, "runtime_args.num_episode=50", "runtime_args.stage_timeout_s=10", "runtime_args.single_process=false")
    try:
        wait_for(proc, lambda: has_rows(out / "metrics.jsonl"), "the first episode")
        pid = worker_pid(proc.pid, "policy_trainer:0")
        assert pid is not None, session_processes(proc.pid)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        proc.wait(timeout=240)
        waited = time.monotonic() - stopped
        err = " ".join(proc.stderr.read().split())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, err[-3000:]
    # the deadline (max(10 s, 5 x the stage's longest time)), 10 s of silence, and the way out
    assert waited < 150, (waited, err[-3000:])
    paragraph = re.search(r"error: (the policy_trainer rank 0 worker \(process (\d+).*)", err)
    assert paragraph, err[-3000:]
    text = paragraph.group(1)
    assert int(paragraph.group(2)) == pid
    assert "stopped answering: no heartbeat for 10 s" in text, text
    assert re.search(r"while (stage \w+ of \w+|the \w+ call of \w+|building \w+) waited \d+ s", text), text
    assert "raise runtime_args.stage_timeout_s" in text and "py-spy dump --pid" in text
    assert "Traceback" not in err and "class_name: Worker" not in err, err[-3000:]
    assert not (out / "run.lock").exists()
    deadline = time.time() + 30
    while session_processes(proc.pid) and time.time() < deadline:
        time.sleep(0.5)
    assert session_processes(proc.pid) == []
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
