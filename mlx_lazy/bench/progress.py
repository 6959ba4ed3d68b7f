"""A long run's progress on stderr: the stage, how far it is, the time spent and ETAs.

On a terminal one status line is rewritten in place; into a file or a pipe a line is written
at most every ``every_s`` seconds and at the end of each stage, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO


def duration(seconds: float) -> str:
    """``45s``, ``12m30s``, ``1h05m``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Rates:
    """Mean seconds of each kind of unit of work measured so far."""

    def __init__(self) -> None:
        self._total: dict[str, float] = {}
        self._count: dict[str, int] = {}

    def add(self, kind: str, seconds: float, units: int = 1) -> None:
        """Record ``units`` units of ``kind`` that took ``seconds`` together."""
        self._total[kind] = self._total.get(kind, 0.0) + seconds
        self._count[kind] = self._count.get(kind, 0) + units

    def mean(self, kind: str) -> Optional[float]:
        """Seconds per unit of ``kind``; None before one was measured."""
        n = self._count.get(kind, 0)
        return self._total[kind] / n if n else None


class Progress:
    """Status lines of a run that may have a time limit.

    ``update(stage, done, total, goal_s)`` reports ``done`` of ``total`` units of ``stage``,
    the stage's ETA (from its own pace so far) and, when the caller can estimate it, the
    time ``goal_s`` left until the run's ``goal`` (for calibration: its next schedule).
    """

    def __init__(self, limit_s: Optional[float] = None, goal: str = "done",
                 stream: Optional[TextIO] = None, clock: Callable[[], float] = time.monotonic,
                 every_s: float = 60.0):
        self.limit_s, self.goal, self.clock, self.every_s = limit_s, goal, clock, every_s
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = clock()
        self._stage: Optional[str] = None
        self._stage_start, self._stage_done = self.start, 0
        self._last_write = -float("inf")
        self._open_line = False

    def left_s(self) -> Optional[float]:
        """Seconds left of the time limit (None without one)."""
        return None if self.limit_s is None else self.limit_s - (self.clock() - self.start)

    def line(self, stage: str, done: int, total: int, goal_s: Optional[float] = None) -> str:
        """The status text (without writing it)."""
        now = self.clock()
        if stage != self._stage:  # a new stage: its pace counts from here
            self._stage, self._stage_start, self._stage_done = stage, now, done
        parts = [f"{stage}: {done}/{total}", f"{duration(now - self.start)} spent"]
        if self._stage_done < done < total:
            pace = (now - self._stage_start) / (done - self._stage_done)
            parts.append(f"stage ETA {duration(pace * (total - done))}")
        if goal_s is not None:
            parts.append(f"{self.goal} in ≈{duration(goal_s)}")
        left = self.left_s()
        if left is not None:
            parts.append(f"time limit: {duration(left)} left")
        return " · ".join(parts)

    def update(self, stage: str, done: int, total: int, goal_s: Optional[float] = None) -> None:
        """Report progress; written now on a terminal, else when due or at a stage's end."""
        text = self.line(stage, done, total, goal_s)
        now = self.clock()
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self._open_line = True
            self.stream.flush()
        elif done >= total or now - self._last_write >= self.every_s:
            self.log(text)
            self._last_write = now

    def log(self, msg: str) -> None:
        """One timestamped line, below the terminal's status line."""
        self.clear()
        self.stream.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
        self.stream.flush()

    def clear(self) -> None:
        """End the terminal's status line before other output."""
        if self._open_line:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._open_line = False
