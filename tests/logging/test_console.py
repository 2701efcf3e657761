"""A quiet console: third-party output goes to ``<output_dir>/logs/`` (``--verbose``: the console too),
chatlearn's own lines and failures stay visible; the end-of-run summary; ``chatlearn --version``."""
from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
import textwrap
from importlib.metadata import version

import pytest

from chatlearn.logging import console
from chatlearn.logging.metrics import WALL, MetricsWriter, run_summary
from conftest import REPO

# a worker process: what libraries write (Python print and logging, a C-level write to fd 2, a child
# process)
WORKER = textwrap.dedent("""
    import logging, os, subprocess, sys
    from chatlearn.logging.console import setup_worker

    setup_worker()
    print("library print on stdout")
    logging.getLogger("vllm.x").warning("library logging warning")
    os.write(2, b"C-level warning on fd 2\\n")
    subprocess.run([sys.executable, "-c", "print('child process line')"], check=True)
""")
THIRD_PARTY = ("library print on stdout", "library logging warning", "C-level warning on fd 2", "child process line")


def run_worker(tmp_path, **env):
    env = {**os.environ, "CHATLEARN_LOG_DIR": str(tmp_path), **env}
    proc = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=60, env=env,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    logs = {p.name: p.read_text() for p in tmp_path.glob("worker-*.log")}
    return proc.stdout + proc.stderr, logs


def test_worker_output_goes_to_its_log_file(tmp_path):
    shown, logs = run_worker(tmp_path, CHATLEARN_VERBOSE="")
    assert shown.strip() == ""
    (name, text), = logs.items()
    assert name.startswith("worker-")
    for line in THIRD_PARTY:
        assert line in text, (line, text)


def test_worker_lines_reach_the_log_before_the_worker_is_killed(tmp_path):
    """Workers end by ray.kill: a line a library printed before is in the log, not lost in the
    block buffer Python gives a standard output that is not a terminal."""
    script = textwrap.dedent("""
        import os, signal
        from chatlearn.logging.console import setup_worker

        setup_worker()
        print("print before the kill")
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
                               "CHATLEARN_LOG_DIR": str(tmp_path), "CHATLEARN_VERBOSE": ""})
    assert proc.returncode == -9
    (text,) = [p.read_text() for p in tmp_path.glob("worker-*.log")]
    assert "print before the kill" in text, text


def test_worker_output_on_the_console_with_verbose(tmp_path):
    shown, logs = run_worker(tmp_path, CHATLEARN_VERBOSE="1")
    for line in THIRD_PARTY:
        assert line in shown, (line, shown)
    assert not logs


def test_worker_env_carries_the_log_settings(monkeypatch):
    from chatlearn.runtime.cluster.worker_env import worker_env

    monkeypatch.setenv("CHATLEARN_LOG_DIR", "/runs/x/logs")
    monkeypatch.setenv("CHATLEARN_VERBOSE", "1")
    env = worker_env("rollout", "vllm", 2)
    assert env["CHATLEARN_LOG_DIR"] == "/runs/x/logs" and env["CHATLEARN_VERBOSE"] == "1"


@pytest.mark.parametrize("verbose", [False, True])
def test_driver_library_logging_goes_to_the_file(tmp_path, monkeypatch, capfd, verbose):
    """Lines logged before the folder is known are kept and written first; a library's own console
    handler (on a child logger that does not propagate) is replaced while the run lasts, then restored."""
    monkeypatch.delenv("CHATLEARN_LOG_DIR", raising=False)
    monkeypatch.setenv("CHATLEARN_VERBOSE", "1" if verbose else "0")
    child = logging.getLogger("transformers.tokenization_test")
    own = logging.StreamHandler(sys.stderr)
    child.addHandler(own)
    child.propagate = False
    try:
        with console.ThirdPartyLogs() as logs:
            logging.getLogger("ray.test").warning("ray before the folder is known")
            folder = logs.attach(str(tmp_path / "out"))
            assert os.environ["CHATLEARN_LOG_DIR"] == folder
            child.warning("tokenizer warning")
            logging.getLogger("vllm").error("vllm error")
            import warnings
            warnings.warn("a library's deprecation warning")
        assert "CHATLEARN_LOG_DIR" not in os.environ
        assert child.handlers == [own] and child.propagate is False
        text = (tmp_path / "out" / "logs" / "driver.log").read_text()
        for line in ("ray before the folder is known", "tokenizer warning", "vllm error",
                     "a library's deprecation warning"):
            assert line in text, (line, text)
        assert text.index("ray before") < text.index("tokenizer warning")
        err = capfd.readouterr().err
        assert ("tokenizer warning" in err and "vllm error" in err) == verbose, err
    finally:
        child.removeHandler(own)
        child.propagate = True


def test_failure_hint_shows_the_end_of_a_dead_workers_log(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "worker-4242.log").write_text("".join(f"line {i}\n" for i in range(100)) + "Fatal Python error: Aborted\n")
    error = RuntimeError("The actor died unexpectedly before finishing this task.\n\tclass_name: Worker\n\tpid: 4242")
    hint = console.failure_hint(error, str(tmp_path))
    assert f"third-party logs of this run: {logs}/" in hint
    assert "Fatal Python error: Aborted" in hint and "line 99" in hint and "line 10\n" not in hint
    assert console.failure_hint(RuntimeError("pid: 1"), str(tmp_path)).count("\n") == 0  # no such log


def test_metrics_rows_have_a_wall_clock_time(tmp_path):
    import time

    before = time.time()
    writer = MetricsWriter(str(tmp_path))
    writer.write(1, {"train/loss": 0.5})
    writer.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert before - 1 <= row[WALL] <= time.time() + 1 and row["train/loss"] == 0.5


def test_run_summary():
    rows = [{"episode": 0, WALL: 90.0, "eval/reward_mean": 0.2, "time/eval": 2.0},  # an earlier process
            {"episode": 1, WALL: 100.0, "time/episode": 10.0, "time/generate": 4.0, "time/train": 5.0,
             "time/weight_push": 1.0},
            {"episode": 2, WALL: 110.0, "time/episode": 10.0, "time/generate": 4.0, "time/train": 5.0,
             "time/weight_push": 1.0, "eval/reward_mean": 0.6, "time/eval": 2.0},
            {"episode": 3, WALL: 120.0, "time/episode": 10.0, "time/generate": 4.0, "time/train": 5.0,
             "time/weight_push": 1.0, "eval/reward_mean": 0.5, "time/eval": 2.0}]
    lines = run_summary(rows, wall_seconds=40.0, since=95.0,
                        outputs={"metrics": "/o/metrics.jsonl", "checkpoints": "/o/checkpoints/"})
    assert lines == [
        "[chatlearn] done: episodes 1..3 in 40s",
        "[chatlearn] eval reward: first 0.200 (episode 0), last 0.500 (episode 3), best 0.600 (episode 2)",
        "[chatlearn] time: generate 12.0s (30%) | train 15.0s (38%) | weight push 3.0s (8%) | eval 4.0s (10%) "
        "| start-up and other 6.0s (15%)",
        "[chatlearn] outputs: metrics /o/metrics.jsonl | checkpoints /o/checkpoints/"]


def test_version():
    proc = subprocess.run([sys.executable, "-m", "chatlearn.cli", "--version"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == f"chatlearn {version('chatlearn')}"


@pytest.mark.parametrize("log_dir, verbose, streams",
                         [("/x/logs", "", False), ("/x/logs", "1", True), (None, "", True)])
def test_workers_stream_to_the_driver_only_where_no_log_folder_takes_their_output(monkeypatch, log_dir, verbose,
                                                                                   streams):
    """A run writes its workers' output into <output_dir>/logs/: nothing streams through Ray (nor does its
    head start a log monitor); with --verbose, or without a log folder (a library use), Ray streams it."""
    if log_dir is None:
        monkeypatch.delenv(console.ENV_LOG_DIR, raising=False)
    else:
        monkeypatch.setenv(console.ENV_LOG_DIR, log_dir)
    monkeypatch.setenv(console.ENV_VERBOSE, verbose)
    assert console.workers_stream_to_driver() is streams
    assert console.ray_init_options()["log_to_driver"] is streams


# --------------------------------------------------------------------------- chatlearn's own lines
def test_info_and_warn_lines_go_to_the_stream_of_the_moment(capsys):
    console.info("resuming from /o/checkpoints/episode_2 (episode 2)")
    console.warn("rollout and trainer log-probs differ")
    console.info("eval all: reward 0.500 | pass@1 0.250", bare=True)
    console.info("a 100% literal line: %s %d", bare=True)  # no %-formatting of the message
    out = capsys.readouterr()
    assert out.out == ("[chatlearn] resuming from /o/checkpoints/episode_2 (episode 2)\n"
                       "[chatlearn] warning: rollout and trainer log-probs differ\n"
                       "eval all: reward 0.500 | pass@1 0.250\n"
                       "a 100% literal line: %s %d\n")
    assert out.err == ""
    console.warn("the lock /o/run.lock is no longer this run's; leaving it", stderr=True)
    console.info("error: models.policy.num_gpu: ...\nsecond line of the paragraph", stderr=True, bare=True)
    console.info("\n# plan", bare=True)
    out = capsys.readouterr()
    assert out.err == ("[chatlearn] warning: the lock /o/run.lock is no longer this run's; leaving it\n"
                       "error: models.policy.num_gpu: ...\nsecond line of the paragraph\n")
    assert out.out == "\n# plan\n"


def test_each_line_is_flushed_as_it_is_written(monkeypatch):
    """A line reaches a pipe or a file at once (as print(..., flush=True) did), not when a buffer fills."""
    class Stream:
        def __init__(self):
            self.parts = []

        def write(self, text):
            self.parts.append(text)

        def flush(self):
            self.parts.append("<flush>")

    out, err = Stream(), Stream()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    console.info("one")
    console.warn("two", stderr=True)
    assert out.parts == ["[chatlearn] one\n", "<flush>"]
    assert err.parts == ["[chatlearn] warning: two\n", "<flush>"]


def test_chatlearn_lines_stay_off_the_third_party_log(tmp_path, capsys, monkeypatch):
    """Under ``ThirdPartyLogs`` (``chatlearn run``) chatlearn's lines still reach the console, and only it."""
    monkeypatch.delenv("CHATLEARN_LOG_DIR", raising=False)
    monkeypatch.setenv("CHATLEARN_VERBOSE", "0")
    with console.ThirdPartyLogs() as logs:
        logs.attach(str(tmp_path))
        console.info("a line of chatlearn's")
    assert capsys.readouterr().out == "[chatlearn] a line of chatlearn's\n"
    assert "a line of chatlearn's" not in (tmp_path / "logs" / "driver.log").read_text()


def _binds_print(tree: ast.AST) -> bool:
    """Whether a module defines a name ``print`` of its own (then ``print`` there is not the builtin)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == "print":
            return True
        if isinstance(node, ast.Name) and node.id == "print" and isinstance(node.ctx, (ast.Store, ast.Del)):
            return True
        if isinstance(node, ast.arg) and node.arg == "print":
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == "print"
                                                                  for a in node.names):
            return True
    return False


def test_no_module_of_chatlearn_uses_the_builtin_print():
    """chatlearn's console lines go through chatlearn.logging.console (``info``, ``warn``): one stream
    rule, one prefix, flushed, routed under a live progress display. Neither a call to the builtin
    ``print`` nor ``print`` handed on as a callable (``log=print``) is allowed in any module."""
    found = []
    package = os.path.join(REPO, "chatlearn")
    for root, dirs, files in os.walk(package):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, REPO).replace(os.sep, "/")
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=path)
            if _binds_print(tree):
                continue
            found += [f"{rel}:{node.lineno}" for node in ast.walk(tree)
                      if isinstance(node, ast.Name) and node.id == "print" and isinstance(node.ctx, ast.Load)]
            found += [f"{rel}:{node.lineno}" for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and node.attr == "print"
                      and isinstance(node.value, ast.Name) and node.value.id == "builtins"]
    assert not found, ("the builtin print is used here; write through chatlearn.logging.console.info / warn "
                       "instead: " + ", ".join(found))


@pytest.mark.parametrize("verbose", [False, True])
def test_rays_raylet_error_lines_go_to_the_log(tmp_path, monkeypatch, capfd, verbose):
    """Ray's driver prints the cluster's error messages ("(raylet) A worker died ... OOM killer")
    through ``ray._private.worker.print_to_stdstream``; a run that writes its workers' output to its
    logs folder sends them to driver.log instead (chatlearn's own paragraph names the worker), and
    ``--verbose`` keeps them on the console. Other streams pass through unchanged."""
    import ray._private.worker as ray_worker

    monkeypatch.delenv("CHATLEARN_LOG_DIR", raising=False)
    monkeypatch.setenv("CHATLEARN_VERBOSE", "1" if verbose else "0")
    monkeypatch.setattr(ray_worker, "print_to_stdstream", ray_worker.print_to_stdstream)  # restored after
    with console.ThirdPartyLogs() as logs:
        logs.attach(str(tmp_path / "out"))
        console.raylet_lines_to_log()
        console.raylet_lines_to_log()  # once only
        ray_worker.print_to_stdstream({"lines": ["A worker died or was killed while executing a task "
                                                 "by an unexpected system error (OOM killer?)"],
                                       "pid": "raylet", "is_err": False}, ignore_prefix=False)
        ray_worker.print_to_stdstream({"lines": ["a worker's own line"], "pid": 1234, "ip": "10.0.0.1",
                                       "task_name": "Worker", "is_err": True}, ignore_prefix=False)
    out = capfd.readouterr()
    text = (tmp_path / "out" / "logs" / "driver.log").read_text()
    assert ("A worker died" in out.out + out.err) == verbose
    assert ("(raylet) A worker died" in text) != verbose
    assert "a worker's own line" in out.err
