"""Faults with real runs of the embedded default (shortened): a SIGKILL after a checkpoint with
rows past it and a torn last line, then resume; two runs into one folder at once (and Ctrl-C);
--overwrite."""
from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from shared_runs import finished

from conftest import REPO

pytestmark = pytest.mark.slow  # every test starts whole runs

RUN = ["runtime_args.num_episode=4", "runtime_args.sample_per_episode=16", "runtime_args.train_global_batch_size=16",
       "runtime_args.train_micro_batch_size=16", "models.policy.num_inference_per_prompt=4",
       "runtime_args.enable_eval_before_training=False", "runtime_args.eval_episode_interval=0",
       "runtime_args.save_episode_interval=2", "runtime_args.rollout_backend=hf",
       "models.policy_trainer.save_hf=false"]


def command(out, *extra):
    return [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *RUN,
            f"runtime_args.output_dir={out}", *extra]


def ctrl_c_reaches_it():
    """For a child the tests stop with SIGINT: a shell that starts a job in the background ignores
    SIGINT for it (and Python then never raises KeyboardInterrupt), so a suite started that way would
    see exit 0 instead of 130. The child gets the default disposition back."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(out, *extra, env=None):
    return subprocess.Popen(command(out, *extra), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})}, start_new_session=True,
                            preexec_fn=ctrl_c_reaches_it)


def episodes(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["episode"] for line in f]


def has_rows(path) -> bool:
    """Whether the metrics file holds a row (it is created with the models, before the run's first stage)."""
    return path.exists() and path.stat().st_size > 0


def wait_for(proc, cond, what):
    deadline = time.time() + 300
    while not cond():
        assert proc.poll() is None, f"the run ended before {what}: " + proc.stderr.read()[-3000:]
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def finish(out, *extra):
    proc = subprocess.run(command(out, *extra), cwd=REPO, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kill_after_a_checkpoint_torn_rows_then_resume(tmp_path):
    """Killed in episode 4 (checkpoint 2 complete, episode 3 logged, checkpoint 4 not yet written),
    with a torn last line in metrics.jsonl and timeline.jsonl: the rerun takes the stale lock over,
    resumes from episode 2, and every episode appears once in both files. Then a damaged newest
    checkpoint: the next run falls back to the one before it."""
    out = tmp_path / "out"
    metrics, timeline = out / "metrics.jsonl", out / "timeline.jsonl"
    # a pause inside the save of episode 4 keeps its checkpoint incomplete while we kill, as soon as episode 3 is
    # logged (episode 4 trains in about a second, then its save waits 8 s)
    proc = start(out, env={"CHATLEARN_CHECKPOINT_TEST_DELAY": "8@4"})
    try:
        wait_for(proc, lambda: metrics.exists() and 3 in episodes(metrics), "episode 3 was logged")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (out / "checkpoints" / "latest").read_text().strip() == "episode_000002"
    assert (out / "run.lock").exists()  # a SIGKILL leaves the lock behind
    for path in (metrics, timeline):
        with open(path, "a", encoding="utf-8") as f:
            f.write('{"episode": 4, "train/rew')  # power loss in the middle of a row

    proc = finish(out)
    assert "resuming from" in proc.stdout and "(episode 2)" in proc.stdout
    assert "taking over the lock" in proc.stderr and "no longer running" in proc.stderr
    assert episodes(metrics) == [1, 2, 3, 4]
    stages = collections.Counter((e["episode"], e["stage"]) for e in map(json.loads, open(timeline))
                                 if e["kind"] == "stage")
    for episode in (1, 2, 3, 4):
        assert stages[(episode, "generate")] == 1, stages
    assert not (out / "run.lock").exists()

    # then a shard of the newest checkpoint is truncated (a copy cut short): the next run, two episodes
    # more, names the damage, resumes from the checkpoint before it and logs every episode once
    shard = sorted((out / "checkpoints" / "episode_000004" / "trainer").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    proc = finish(out, "runtime_args.num_episode=6")
    text = " ".join(proc.stdout.split())
    assert f"checkpoint {out / 'checkpoints' / 'episode_000004'} is damaged: trainer/{shard.name}" in text
    assert "(truncated)" in text and "resuming from" in text and "(episode 2)" in text
    assert "Traceback" not in proc.stderr
    assert episodes(metrics) == [1, 2, 3, 4, 5, 6]
    from chatlearn.checkpoint.manager import manifest_problems

    assert manifest_problems(str(out / "checkpoints" / "episode_000004")) == []  # written again, whole


def session_processes(sid):
    """Processes still alive in the run's session (the driver and everything it started)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid=,stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if int(line.split()[1]) == sid and not line.split()[2].startswith("Z")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("to", ["driver", "job"])
def test_sigterm_stops_like_ctrl_c(tmp_path, to):
    """SIGTERM to the driver (Kubernetes: the container's first process) or to every process of the
    job (Slurm) stops the run like Ctrl-C: exit 143, no traceback, the lock released, no process of
    the run left behind, the last complete checkpoint kept."""
    out = tmp_path / "out"
    proc = start(out, "runtime_args.num_episode=50", "runtime_args.save_episode_interval=1")
    try:
        wait_for(proc, lambda: (out / "checkpoints" / "latest").exists(), "the first checkpoint")
        (os.kill if to == "driver" else os.killpg)(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err[-3000:]
    assert "terminated (SIGTERM)" in err and "Traceback" not in err, err[-3000:]
    assert not (out / "run.lock").exists()
    deadline = time.time() + 30
    while session_processes(proc.pid) and time.time() < deadline:
        time.sleep(0.5)
    assert session_processes(proc.pid) == []
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert (out / "checkpoints" / latest / "state.json").exists()


def worker_pid(sid, who):
    """The pid of the run's worker ``who`` ("policy_trainer:0"): its environment names it."""
    for line in session_processes(sid):
        pid = int(line.split()[0])
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"CHATLEARN_WORKER={who}".encode() in f.read().split(b"\0"):
                    return pid
        except OSError:
            continue
    return None


@pytest.mark.timeout(900)
def test_a_dead_worker_is_named_by_model_and_rank(tmp_path):
    """A trainer process killed mid-run (as the kernel's OOM killer would): the run stops with exit 1
    and one paragraph naming the model, rank and process, then the end of that worker's log."""
    out = tmp_path / "out"
    # the trainer in a process of its own (Ray): without Ray it is the driver's process (a reward worker's
    # process that ends is named by test_a_reward_function_that_calls_os_exit_is_named)
    proc = start(out, "runtime_args.num_episode=50", "runtime_args.single_process=false")
    try:
        wait_for(proc, lambda: has_rows(out / "metrics.jsonl"), "the first episode")
        pid = worker_pid(proc.pid, "policy_trainer:0")
        assert pid is not None, session_processes(proc.pid)
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=180)
        err = " ".join(proc.stderr.read().split())
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, err[-3000:]
    assert f"error: the policy_trainer rank 0 worker (process {pid}" in err, err[-3000:]
    assert "class_name: Worker" not in err and "Traceback" not in err, err[-3000:]
    assert f"worker-{pid}.log" in err
    assert not (out / "run.lock").exists()


@pytest.mark.timeout(900)
def test_overwrite_moves_the_old_run_aside(tmp_path):
    """--no-resume into a used folder is refused; --overwrite moves the old run aside, whole, and the
    new run's keep-last-N and ``latest`` see only its own checkpoints."""
    out = finished("lora").check().copy_to(tmp_path / "out")  # a finished run (the suite's shared LoRA run)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["episode_000001", "episode_000002", "latest"]
    old_files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    refused = subprocess.run(command(out, "--no-resume"), cwd=REPO, capture_output=True, text=True, timeout=200)
    assert refused.returncode == 2 and "already holds a run" in refused.stderr, refused.stderr[-3000:]
    proc = finish(out, "--overwrite", "runtime_args.num_episode=1", "runtime_args.keep_last_checkpoints=1")
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("out.old-")]
    assert len(moved) == 1 and f"moved the previous run in {out} to {moved[0]}" in proc.stdout
    assert sorted(p.relative_to(moved[0]).as_posix() for p in moved[0].rglob("*")) == old_files
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["episode_000001", "latest"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "episode_000001"
    assert episodes(out / "metrics.jsonl") == [1]


# ------------------------------------------------------------------ non-finite steps, stuck rewards
NAN_SITE = os.path.join(REPO, "tests", "reliability", "nan_site")


def checkpoint_model(path):
    """The model tensors of a run's checkpoint folder (DCP, read without a process group)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = path.parent / (path.name + ".pt")
    dcp_to_torch_save(str(path / "trainer"), str(flat))
    return torch.load(flat, weights_only=True)["model"]


@pytest.mark.timeout(600)
def test_nonfinite_steps_are_skipped_then_the_run_stops(tmp_path):
    """Gradients and loss made nan from optimizer step 2 on (tests/reliability/nan_site): steps 2
    and 3 (one per episode) are skipped with a warning, their checkpoints hold the weights of
    episode 1, and the third skipped step in a row stops the run with exit 2 before episode 4's
    checkpoint."""
    import torch

    out = tmp_path / "out"
    env = {"CHATLEARN_TEST_NAN_FROM_STEP": "2",
           "PYTHONPATH": os.pathsep.join(p for p in (NAN_SITE, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(command(out, "runtime_args.num_episode=5", "runtime_args.save_episode_interval=1"),
                          cwd=REPO, capture_output=True, text=True, timeout=500, env={**os.environ, **env})
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for word in ("training diverged", "not finite in 3 optimizer steps in a row", "episode 4, optimizer step 1/1",
                 "max_nonfinite_steps: 3", "models.policy_trainer.optimizer.lr",
                 f"the last checkpoint saved, {out / 'checkpoints' / 'episode_000003'} (episode 3)"):
        assert word in err, err
    warned = " ".join(proc.stdout.split())
    assert "warning: episode 2, optimizer step 1/1: loss nan" in warned and "the step was skipped" in warned
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["episode"] for r in rows] == [1, 2, 3]
    assert [r["train/skipped_steps"] for r in rows] == [0.0, 1.0, 1.0]
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["episode_000001", "episode_000002", "episode_000003", "latest"]
    first, last = (checkpoint_model(out / "checkpoints" / f"episode_00000{e}") for e in (1, 3))
    assert first.keys() == last.keys()
    for name, tensor in last.items():
        assert torch.isfinite(tensor).all() and torch.equal(tensor, first[name]), name


STUCK_REWARD = ("import os, time\n\n"
                "def score(*, prompts, responses, ground_truths, data_sources, extra, marker):\n"
                "    open(marker, 'a').close()\n"
                "    while True:\n"
                "        time.sleep(0.1)\n")


def stuck_reward(tmp_path):
    path = tmp_path / "stuck_reward.py"
    path.write_text(STUCK_REWARD)
    marker = tmp_path / "reward_called"
    return f"models.reward.functions=[{{name: stuck, path: '{path}:score', kwargs: {{marker: '{marker}'}}}}]", marker


# a regular expression that backtracks for ages, inside the C code of `re` (which holds the
# interpreter lock: no Python-level timeout or signal gets in)
RUNAWAY_REGEX = ("import re\n\n"
                 "def score(*, prompts, responses, ground_truths, data_sources, extra):\n"
                 "    re.match(r'(a+)+$', 'a' * 64 + 'b')\n"
                 "    return [0.0 for _ in responses]\n")


@pytest.mark.timeout(600)
def test_a_reward_function_that_never_returns_times_out(tmp_path):
    """models.reward.timeout_s: the run stops with exit 2 naming the function (the second of two, stuck in
    C code) and the samples."""
    out = tmp_path / "out"
    path = tmp_path / "stuck_reward.py"
    path.write_text(RUNAWAY_REGEX)
    reward = f"models.reward.functions=[{{name: math, path: 'builtin:math'}}, {{name: stuck, path: '{path}:score'}}]"
    proc = subprocess.run(command(out, reward, "models.reward.timeout_s=5", "runtime_args.num_episode=1"),
                          cwd=REPO, capture_output=True, text=True, timeout=500)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for word in ("reward function 'stuck' (models.reward.functions[1],", "stuck_reward.py:score",
                 "did not return within 5 s (models.reward.timeout_s)", "the rollouts of episode 1",
                 "samples 0-15 of 16 on reward worker 0",
                 "raise models.reward.timeout_s"):
        assert word in err, err
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    assert not (out / "run.lock").exists()


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_a_reward_function_that_calls_os_exit_is_named(tmp_path):
    """A reward function that ends its process: exit 2 naming the function and the exit code; no word of
    the OOM killer and no line of Ray's on the console."""
    out = tmp_path / "out"
    path = tmp_path / "quitting_reward.py"
    path.write_text("import os\n\n\ndef score(*, prompts, responses, ground_truths, data_sources, extra):\n"
                    "    os._exit(3)\n")
    reward = f"models.reward.functions=[{{name: quits, path: '{path}:score'}}]"
    proc = subprocess.run(command(out, reward, "runtime_args.num_episode=1"), cwd=REPO, capture_output=True,
                          text=True, timeout=500)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    for word in ("the reward worker exited while scoring", "reward function 'quits' (models.reward.functions[0],",
                 "quitting_reward.py:score", "called os._exit(3)", "exit code 3"):
        assert word in err, err
    console = proc.stdout + proc.stderr
    assert "OOM" not in console and "(raylet)" not in console and "Traceback" not in console, console[-3000:]


@pytest.mark.timeout(900)
def test_a_second_run_into_a_folder_in_use_and_ctrl_c_while_a_reward_function_is_stuck(tmp_path):
    """A second run into a folder in use is refused naming the first (held in its reward function, no
    time limit, for as long as that takes); then the first Ctrl-C stops the first run: exit 130, the lock
    released."""
    out = tmp_path / "out"
    reward, marker = stuck_reward(tmp_path)
    proc = start(out, reward, "models.reward.timeout_s=0")
    try:
        wait_for(proc, marker.exists, "the reward function was called")
        lock = json.loads((out / "run.lock").read_text())
        assert lock["pid"] == proc.pid and lock["host"] == socket.gethostname()
        second = subprocess.run(command(out), cwd=REPO, capture_output=True, text=True, timeout=200)
        assert second.returncode == 2, second.stderr[-3000:]
        err = " ".join(second.stderr.split())
        assert "Traceback" not in err
        for word in (str(out), f"in use by process {proc.pid} on host {socket.gethostname()}",
                     f"started {lock['started']}", "Wait for that run to finish"):
            assert word in err, err
        assert proc.poll() is None  # still in the reward function
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, proc.stderr.read()[-3000:]
    assert not (out / "run.lock").exists()

