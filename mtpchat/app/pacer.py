"""Paces the UI's repaints while a reply streams, so the UI never slows the engine down.

The engine's worker and the UI share one interpreter: every millisecond the UI thread spends laying
out and rendering is a millisecond the decode loop may wait for the GIL (on the CPU it always does).
So paints are spaced to keep the UI thread's CPU time under `budget` of the wall time. The thread's
own CPU clock measures everything it did between two paints (handling messages, Markdown parsing,
layout, rendering), so the pacing follows the real cost on this terminal size and this machine:
a short reply on a fast machine paints at 30 Hz, a long one on a slow CPU a few times a second.
"""
from __future__ import annotations

import time

MIN_INTERVAL = 1 / 30
MAX_INTERVAL = 1 / 10   # slower than 10 Hz, streaming text reads as stutter
START_CAP = 0.25        # each reply starts at least this lively
PANE_INTERVAL = 0.5     # the telemetry pane while a reply streams: numbers change too fast to read faster


class Pacer:
    def __init__(self, budget: float = 0.02, cpu=time.thread_time, clock=time.perf_counter):
        self.budget, self.cpu, self.clock = budget, cpu, clock
        self.interval = MIN_INTERVAL
        self.reset()

    def reset(self) -> None:
        """A new reply: paint the first text at once, then re-learn the cost from there (a reply
        starts with one-off work, mounting its message, that says nothing about the cost of a paint)."""
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
        if self._fresh:
            self._fresh = False
            dt = 0.0
        else:
            dt, used = wall - self._last_wall, cpu - self._last_cpu
        self._last_wall, self._last_cpu = wall, cpu
        if dt > 0:
            share = used / dt
            # multiplicative: back off fast when over budget, recover gently when under
            factor = min(2.0, share / self.budget) if share > self.budget else 0.85
            self.interval = min(MAX_INTERVAL, max(MIN_INTERVAL, self.interval * factor))
        self.next_at = wall + self.interval
