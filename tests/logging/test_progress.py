"""Console progress: a live status line on a terminal, plain episode lines anywhere else."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap

import pytest

from chatlearn.logging.progress import RunProgress, live_wanted

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")

# one short "run" through every stage, the way the engine drives the progress object (each stage is drawn
# as it begins: a pause of a few refreshes is enough)
SCRIPT = textwrap.dedent("""
    import time
    from chatlearn.logging.progress import RunProgress

    p = RunProgress(2)
    p.begin(0); p.stage("eval"); time.sleep(0.1); p.finish(0, "episode 0/2 | eval 0.100")
    for e in (1, 2):
        p.begin(e)
        for s in ("generate", "reward", "ref_logprobs", "old_logprobs"):
            p.stage(s); time.sleep(0.06)
        for i in (1, 2):
            p.stage("train", f"step {i}/2"); time.sleep(0.06)
        p.stage("weight_push"); time.sleep(0.06)
        print("a worker log line")
        p.finish(e, f"episode {e}/2 | reward 0.{e}00")
    p.close()
    print("[chatlearn] done")
""")

STAGES = ("eval", "generate", "reward", "ref log-probs", "old log-probs", "train step 1/2", "train step 2/2",
          "weight push")


def run_in_pty(env_extra: dict) -> str:
    """Run SCRIPT with its stdout and stderr on a pseudo-terminal; everything it wrote there."""
    pty = pytest.importorskip("pty")
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "CHATLEARN_PROGRESS"}
    env.update({"TERM": "xterm-256color", "COLUMNS": "120", **env_extra})
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdin=follower, stdout=follower, stderr=follower,
                            env=env, close_fds=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    return b"".join(chunks).decode("utf-8", errors="replace")


def test_live_status_on_a_terminal():
    raw = run_in_pty({})
    assert ANSI.search(raw) and "\r" in raw  # redrawn in place
    plain = ANSI.sub("", raw)
    for stage in STAGES:
        assert re.search(rf"episode \d/2 .*{re.escape(stage)} \d+s", plain), stage
    # the summary lines and other output stay in the scrollback, each on a line of its own
    lines = [ln.split("\r")[-1].strip() for ln in plain.replace("\r\n", "\n").split("\n")]
    for kept in ("episode 0/2 | eval 0.100", "episode 1/2 | reward 0.100", "episode 2/2 | reward 0.200",
                 "a worker log line", "[chatlearn] done"):
        assert kept in lines, (kept, lines)


# the end of a plain episode line: the elapsed time, and an estimate of the time left while episodes remain
TIMING = re.compile(r" \| \d+(?:h\d\dm|m\d\ds|s) elapsed(?:, eta \d+(?:h\d\dm|m\d\ds|s))?$")


def without_timing(lines: list[str]) -> list[str]:
    """The lines with the timing suffix of the episode lines removed (each episode line must have one)."""
    out = []
    for ln in lines:
        if ln.startswith("episode "):
            assert TIMING.search(ln), ln
            ln = TIMING.sub("", ln)
        out.append(ln)
    return out


def test_plain_lines_when_forced_on_a_terminal():
    raw = run_in_pty({"CHATLEARN_PROGRESS": "plain"})
    assert not ANSI.search(raw)
    assert without_timing(raw.replace("\r\n", "\n").splitlines()) == [
        "episode 0/2 | eval 0.100", "a worker log line", "episode 1/2 | reward 0.100", "a worker log line",
        "episode 2/2 | reward 0.200", "[chatlearn] done"]


def test_plain_lines_in_a_pipe():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items() if k != "CHATLEARN_PROGRESS"})
    assert proc.returncode == 0, proc.stderr
    assert "\x1b" not in proc.stdout and "\r" not in proc.stdout
    lines = proc.stdout.splitlines()
    # an estimate once a training episode is done, none after the last one
    assert "eta" not in lines[0] and ", eta " in lines[2] and "eta" not in lines[4], lines
    assert without_timing(lines) == [
        "episode 0/2 | eval 0.100", "a worker log line", "episode 1/2 | reward 0.100", "a worker log line",
        "episode 2/2 | reward 0.200", "[chatlearn] done"]


def test_plain_stream_gets_only_finished_episodes(monkeypatch):
    monkeypatch.delenv("CHATLEARN_PROGRESS", raising=False)
    stream = io.StringIO()
    p = RunProgress(3, stream=stream)
    assert not p.live
    p.begin(1)
    p.stage("generate")
    p.stage("train", "step 1/2")
    p.finish(1, "episode 1/3 | reward 0.5")
    p.close()
    assert without_timing(stream.getvalue().splitlines()) == ["episode 1/3 | reward 0.5"]


def test_plain_lines_estimate_the_time_left(monkeypatch):
    """The estimate is the mean time of the episodes run so far times the episodes left; a resumed run
    counts only its own episodes (clock faked: 10 s per episode after 100 s of start-up)."""
    import chatlearn.logging.progress as progress

    monkeypatch.delenv("CHATLEARN_PROGRESS", raising=False)
    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    stream = io.StringIO()
    p = RunProgress(10, stream=stream)
    now[0] += 100
    for e in (5, 6, 7):  # resumed after episode 4
        p.begin(e)
        now[0] += 10
        p.finish(e, f"episode {e}/10")
    p.begin(10)
    p.finish(10, "episode 10/10")
    assert stream.getvalue().splitlines() == [
        "episode 5/10 | 1m50s elapsed, eta 50s", "episode 6/10 | 2m00s elapsed, eta 40s",
        "episode 7/10 | 2m10s elapsed, eta 30s", "episode 10/10 | 2m10s elapsed"]


@pytest.mark.parametrize("isatty, term, env, live", [
    (True, "xterm", None, True), (False, "xterm", None, False), (True, "dumb", None, False),
    (True, "xterm", "plain", False), (False, "xterm", "live", True),
])
def test_live_wanted(monkeypatch, isatty, term, env, live):
    monkeypatch.setenv("TERM", term)
    if env is None:
        monkeypatch.delenv("CHATLEARN_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("CHATLEARN_PROGRESS", env)

    class Stream(io.StringIO):
        def isatty(self):
            return isatty

    assert live_wanted(Stream()) is live
