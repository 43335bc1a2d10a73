"""Paces the UI's repaints while a reply streams, so the UI slows the engine down as little as it can.

The engine's worker and the UI share one interpreter: every millisecond the UI thread spends laying
out and rendering is a millisecond the decode loop waits for the GIL (on the CPU it always does).
The thread's own CPU clock measures everything it did between two paints (handling messages,
Markdown parsing, layout, rendering): that is the cost of a paint on this terminal size and this
machine. Paints are spaced so the UI takes at most `budget` of the wall time, but never further
apart than LIVE_INTERVAL (slower, streaming text reads as stutter) unless even that would take more
than `cap` (a long code block re-rendered every frame, a slow CPU), when they spread out to hold `cap`.
"""
from __future__ import annotations

import time

MIN_INTERVAL = 1 / 30    # smoother than this adds nothing to reading text
LIVE_INTERVAL = 1 / 10
MAX_INTERVAL = 1.0
START_CAP = 0.25         # each reply starts at least this lively
PANE_INTERVAL = 0.5      # the telemetry pane while a reply streams: numbers change too fast to read faster


class Pacer:
    def __init__(self, budget: float = 0.02, cap: float = 0.04, cpu=time.thread_time, clock=time.perf_counter):
        self.budget, self.cap, self.cpu, self.clock = budget, cap, cpu, clock
        self.cost: float | None = None      # CPU seconds of the UI per paint, smoothed
        self.paints = 0
        self.interval = MIN_INTERVAL
        self.reset()

    def interval_for(self, cost: float) -> float:
        interval = min(max(cost / self.budget, MIN_INTERVAL), LIVE_INTERVAL)
        return min(max(interval, cost / self.cap), MAX_INTERVAL)

    def reset(self) -> None:
        """A new reply: paint the first text at once, then measure from there (a reply starts with
        one-off work, mounting its message, that says nothing about the cost of a paint)."""
        self.interval = min(self.interval, START_CAP)
        self._fresh = True
        self.next_at = self.clock()

    def due(self) -> bool:
        # the worker posts at `interval` too: a batch that comes a little early still paints now
        return self.clock() >= self.next_at - self.interval / 4

    def delay(self) -> float:
        return max(0.0, self.next_at - self.clock())

    def painted(self) -> None:
        """Call right after a paint was requested; sets when the next may happen."""
        wall, cpu = self.clock(), self.cpu()
        self.paints += 1
        if not self._fresh:
            used = cpu - self._last_cpu
            self.cost = used if self.cost is None else 0.7 * self.cost + 0.3 * used
            self.interval = self.interval_for(self.cost)
        self._fresh = False
        self._last_cpu = cpu
        self.next_at = wall + self.interval
