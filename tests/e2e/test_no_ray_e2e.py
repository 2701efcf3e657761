"""End to end: the default run without Ray (runtime_args.single_process, the default where every model
fits in the driver's process) learns exactly as it does with Ray, and leaves nothing behind. The run
without Ray is the suite's shared ``short_vllm`` (tests/support/shared_runs.py), also read by
tests/e2e/test_train_e2e.py."""
from __future__ import annotations

import pytest
from shared_runs import finished

# what differs between two runs of the same math: times, memory, the bytes pushed (a copy in one process)
VOLATILE = ("time/", "perf/", "memory/", "sync/", "sched/")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_default_run_without_ray_equals_the_run_with_ray():
    from chatlearn.runtime.cluster.leftovers import orphaned_processes

    alone = finished("short_vllm").check()
    rows = alone.rows()
    assert "no Ray (runtime_args.single_process)" in alone.stdout
    start = rows[1]
    assert start["perf/startup/ray_s"] < 0.5 and start["perf/startup/policy_trainer/ray_worker_s"] == 0, start
    # the driver's log, its native output's (the models in it) and the reward worker's
    logs = sorted(p.name for p in (alone.out / "logs").iterdir())
    assert "driver.log" in logs and len([n for n in logs if n.startswith("worker-")]) == 2, logs
    # vLLM's console handler and the libraries' native warnings stay off the console: they are in the logs
    lines = (alone.stdout + alone.stderr).splitlines()
    assert not [ln for ln in lines if not ln.startswith(("[chatlearn] ", "episode "))], lines
    assert alone.left_temp_files == [] and orphaned_processes() == []

    ray = finished("short_vllm_on_ray").check()
    ray_rows = ray.rows()
    assert "no Ray" not in ray.stdout and ray_rows[1]["perf/startup/ray_s"] > 0.5
    assert len(rows) == len(ray_rows) == 4
    for a, b in zip(rows, ray_rows):
        learned = {k: v for k, v in a.items() if not k.startswith(VOLATILE)}
        assert learned == {k: v for k, v in b.items() if not k.startswith(VOLATILE)}
        assert "train/kl" not in a or a["episode"] == 0 or a["train/kl"] >= 0
    assert rows[2]["train/kl"] > 0 and "eval/reward_mean" in rows[2]
