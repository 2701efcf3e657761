"""A short run with TensorBoard and W&B (offline) on: what it writes reads back, every metric is
documented, ``chatlearn plot`` draws it, and the console output suits a pipe and a terminal. The run
is the suite's shared ``short_hf`` (tests/support/shared_runs.py); the terminal needs a run of its own."""
from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import shared_runs
from conftest import REPO
from metrics_doc import undocumented

# the run on a terminal: the shared runs' settings, the rollout on transformers
SHORT = ["runtime_args.sample_per_episode=64", "runtime_args.train_global_batch_size=32",
         "runtime_args.train_micro_batch_size=16", "models.policy.num_inference_per_prompt=4",
         "models.policy.eval_num_inference_per_prompt=1", "models.policy_trainer.kl_coef=0.01",
         "runtime_args.rollout_backend=hf"]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def env_without_wandb_credentials(tmp) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "CHATLEARN_PROGRESS", "WANDB_DIR")}
    empty = os.path.join(tmp, "netrc")
    open(empty, "w").close()
    env.update({"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "NETRC": empty,
                "WANDB_CONFIG_DIR": os.path.join(tmp, "wandb-config")})
    return env


@pytest.fixture(scope="module")
def run():
    """The suite's shared ``short_hf`` run (tests/support/shared_runs.py: 3 episodes, eval before training
    and at episodes 2 and 3, TensorBoard and W&B offline on, stdout and stderr piped)."""
    finished = shared_runs.finished("short_hf").check()
    return {"out": finished.out, "stdout": finished.stdout, "rows": finished.rows()}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tensorboard_event_files_read_back(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = glob.glob(str(run["out"] / "tensorboard" / "events.out.tfevents.*"))
    assert files
    acc = EventAccumulator(str(run["out"] / "tensorboard"))
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    logged = {k for r in run["rows"] for k, v in r.items() if k not in ("episode", "time/wall") and v is not None}
    assert logged == scalars
    assert [e.step for e in acc.Scalars("eval/reward_mean")] == [0, 2, 3]
    assert [e.step for e in acc.Scalars("train/reward_mean")] == [1, 2, 3]
    values = [e.value for e in acc.Scalars("train/kl")]
    assert values == pytest.approx([r["train/kl"] for r in run["rows"][1:]], rel=1e-6)
    assert "config/text_summary" in acc.Tags()["tensors"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wandb_offline_run_folder(run):
    folders = glob.glob(str(run["out"] / "wandb" / "offline-run-*-monitoring-test"))
    assert len(folders) == 1
    data = open(glob.glob(os.path.join(folders[0], "run-*.wandb"))[0], "rb").read()
    for key in (b"train/reward_mean", b"eval/reward_mean", b"perf/train_tokens_per_s", b"max_prompt_tokens_length"):
        assert key in data, key


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_logged_metric_is_documented(run):
    keys = {k for r in run["rows"] for k in r}
    for expected in ("train/entropy", "perf/generate_tokens_per_s", "perf/train_tokens_per_s",
                     "memory/policy_peak_mb", "memory/policy_trainer_peak_mb", "memory/ref_policy_peak_mb",
                     "eval/arith/reward_mean", "time/generate", "sched/transitions"):
        assert expected in keys, expected
    assert not undocumented(keys), "add these to docs/metrics.md"
    for r in run["rows"][1:]:
        assert r["perf/generate_tokens_per_s"] > 0 and r["perf/train_tokens_per_s"] > 0
        assert 10 < r["memory/policy_trainer_peak_mb"] < 100_000
        # no GPU: the colocated models' turns move nothing (runtime_args.offload_without_gpu is off)
        assert r["sched/transitions"] == 0 and r["sched/bytes_moved"] == 0
    assert "no GPU: colocated models keep" in run["stdout"]
    # where the start-up went: the first training episode's row only, phases that add up to the total
    first, second = run["rows"][1], run["rows"][2]
    phases = {k for k in first if k.startswith("perf/startup/")}
    assert {f"perf/startup/{p}_s" for p in ("imports", "config", "data", "ray", "models", "eval_before",
                                            "first_episode", "total")} <= phases, phases
    assert {"perf/startup/policy_trainer/process_s", "perf/startup/policy_trainer/build_s",
            "perf/startup/reward/process_s"} <= phases
    consecutive = [v for k, v in first.items() if k.startswith("perf/startup/") and k.count("/") == 2
                   and k != "perf/startup/total_s"]
    assert sum(consecutive) == pytest.approx(first["perf/startup/total_s"], abs=0.01)
    assert first["perf/startup/first_episode_s"] > 0 and first["perf/startup/models_s"] > 0
    assert not any(k.startswith("perf/startup/") for k in second)
    assert "start-up to the end of the first episode" in run["stdout"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_piped_output_is_plain_lines(run):
    stdout = run["stdout"]
    assert "\x1b" not in stdout and "\r" not in stdout
    lines = stdout.splitlines()
    assert all(ln.startswith(("[chatlearn] ", "episode ")) or ln.startswith("(") for ln in lines if ln), lines
    episodes = [ln for ln in lines if ln.startswith("episode")]
    assert [ln.split(" |")[0] for ln in episodes] == ["episode 0/3", "episode 1/3", "episode 2/3", "episode 3/3"]
    assert "[chatlearn] wandb" not in stdout  # WANDB_MODE=offline is a choice, not a fallback
    assert any(ln.startswith("[chatlearn] plots: ") for ln in lines)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_plot_command_writes_nontrivial_pngs(run):
    from matplotlib.image import imread

    written_by_run = sorted(os.listdir(run["out"] / "plots"))
    proc = subprocess.run([sys.executable, "-m", "chatlearn.cli", "plot", str(run["out"])], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    files = proc.stdout.split()
    assert sorted(os.path.basename(f) for f in files) == written_by_run
    for name in ("reward.png", "response_length.png", "kl.png", "entropy.png", "grad_norm.png",
                 "time_per_stage.png"):
        assert name in written_by_run
    for f in files:
        pixels = imread(f)
        colours = len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0))
        assert os.path.getsize(f) > 5000 and colours > 10, (f, colours)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_live_progress_on_a_terminal(tmp_path):
    pty = pytest.importorskip("pty")
    cmd = [sys.executable, "-m", "chatlearn.cli", "run", "template/grpo_fsdp.yaml", *SHORT,
           "runtime_args.num_episode=1", "runtime_args.eval_episode_interval=0",
           "runtime_args.enable_eval_before_training=False", f"runtime_args.output_dir={tmp_path / 'out'}"]
    leader, follower = pty.openpty()
    env = {**env_without_wandb_credentials(str(tmp_path)), "TERM": "xterm-256color", "COLUMNS": "160"}
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=follower, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO once the run has closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    raw = b"".join(chunks).decode("utf-8", errors="replace")
    assert ANSI.search(raw) and "\r" in raw
    plain = ANSI.sub("", raw)
    for stage in ("generate", "reward", "ref log-probs", "old log-probs", "train step 1/2", "train step 2/2",
                  "weight push"):
        assert re.search(rf"episode 1/1 .*{re.escape(stage)} \d+s", plain), stage
    lines = [ln.split("\r")[-1] for ln in plain.replace("\r\n", "\n").split("\n")]
    assert any(ln.startswith("episode 1/1 | reward ") for ln in lines), lines
    assert any(ln.startswith("[chatlearn] done: ") for ln in lines)
