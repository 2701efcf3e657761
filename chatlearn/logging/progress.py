"""Progress of a run on the console.

On a terminal a live status line (rich) sits under the output: the episode, a bar over the
episodes, the stage running now (generate, reward, ref log-probs, old log-probs, train step i/N,
checkpoint, weight push, eval) with its elapsed time, the run's elapsed time and an estimate of
the time left. The per-episode summary lines scroll above it, as do the workers' log lines.

Anywhere else (a pipe, a log file, CI) there is no live status: only the summary line of each
episode is printed, plain text without escape codes or carriage returns, ending with the run's
elapsed time and an estimate of the time left (``| 1m05s elapsed, eta 12m30s``: the mean time of
the episodes this process ran, times the episodes left).

``CHATLEARN_PROGRESS=plain`` forces plain lines on a terminal; ``CHATLEARN_PROGRESS=live``
forces the live status (for terminals that do not report themselves as such).
"""
from __future__ import annotations

import os
import sys
import time

from rich.console import Console
from rich.progress import (BarColumn, Progress, ProgressColumn, SpinnerColumn, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.text import Text

from chatlearn.config.names import Stage

STAGE_VALUES = {s.value for s in Stage}



def live_wanted(stream) -> bool:
    choice = os.environ.get("CHATLEARN_PROGRESS", "").strip().lower()
    if choice in ("plain", "live"):
        return choice == "live"
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and os.environ.get("TERM", "") not in ("dumb", "unknown")


class RunProgress:
    """The console view of a run: ``begin(episode)``, ``stage(name, detail)``, ``finish(episode, line)``."""

    def __init__(self, num_episodes: int, *, stream=None, live: bool | None = None):
        self.stream = stream if stream is not None else sys.stdout
        self.total = num_episodes
        self.live = live_wanted(self.stream) if live is None else live
        self._progress = None
        self._task = None
        self._episode = 0
        self._started = time.monotonic()
        self._first: tuple[int, float] | None = None  # (first training episode, when it began)

    # ------------------------------------------------------------------ events
    def begin(self, episode: int) -> None:
        """Episode ``episode`` starts (0 is the evaluation before training)."""
        self._episode = episode
        if episode > 0 and self._first is None:
            self._first = (episode, time.monotonic())
        self._update(episode=episode, stage="", since=time.monotonic())

    def stage(self, stage: str, detail: str = "") -> None:
        """A stage of the current episode starts; ``detail`` such as ``step 1/4``."""
        label = Stage(stage).label if stage in STAGE_VALUES else str(stage).replace("_", " ")
        self._update(stage=f"{label} {detail}".strip(), since=time.monotonic())

    def finish(self, episode: int, line: str) -> None:
        """Episode ``episode`` is done; ``line`` is its summary, kept in the output."""
        if not self.live:
            self.stream.write(line + self.timing(episode) + "\n")
            self.stream.flush()
            return
        self._start()
        self._progress.console.print(line, markup=False, highlight=False, soft_wrap=True, emoji=False)
        self._progress.update(self._task, completed=min(episode, self.total), stage="", since=time.monotonic())

    def timing(self, episode: int) -> str:
        """`` | <elapsed> elapsed, eta <left>`` for the plain line of ``episode`` (no estimate before
        the first training episode is done, nor after the last)."""
        now = time.monotonic()
        text = f" | {format_seconds(now - self._started)} elapsed"
        if self._first is not None and episode >= self._first[0] and episode < self.total:
            done = episode - self._first[0] + 1
            text += f", eta {format_seconds((now - self._first[1]) / done * (self.total - episode))}"
        return text

    def close(self) -> None:
        if self._progress is not None:
            progress, self._progress = self._progress, None
            progress.stop()

    # ------------------------------------------------------------------ rich
    def _update(self, **fields) -> None:
        if not self.live:
            return
        self._start()
        self._progress.update(self._task, refresh=True, **fields)  # drawn now: a stage may last a moment

    def _start(self) -> None:
        if self._progress is not None:
            return
        console = Console(file=self.stream, force_terminal=True, highlight=False, emoji=False)
        stderr_tty = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
        self._progress = Progress(
            SpinnerColumn(), TextColumn("episode {task.fields[episode]}/{task.total:.0f}"),
            BarColumn(bar_width=20), _StageColumn(), TextColumn("[dim]|[/dim]"), TimeElapsedColumn(),
            TextColumn("[dim]left[/dim]"), TimeRemainingColumn(),
            console=console, transient=True, refresh_per_second=4, speed_estimate_period=3600.0,
            redirect_stdout=self.stream is sys.stdout, redirect_stderr=stderr_tty)
        # a resumed run starts with its finished episodes done, so they do not count as speed
        self._task = self._progress.add_task("run", total=self.total, completed=max(self._episode - 1, 0),
                                             episode=self._episode, stage="", since=time.monotonic())
        self._progress.start()


def format_seconds(seconds: float, tenths: bool = False) -> str:
    """``42s``, ``3m05s``, ``2h07m`` (``tenths``: ``4.2s`` under a minute)."""
    if tenths and seconds < 59.95:
        return f"{max(0.0, seconds):.1f}s"
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class _StageColumn(ProgressColumn):
    """The running stage and how long it has been running."""

    def render(self, task) -> Text:
        stage = task.fields.get("stage", "")
        if not stage:
            return Text("")
        return Text(f"{stage} {time.monotonic() - task.fields['since']:.0f}s", style="cyan")
