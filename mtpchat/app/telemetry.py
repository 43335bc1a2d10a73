"""What the telemetry pane shows, kept as running totals and ring buffers on the UI thread.

Definitions are the serving engines' (and engine/events.py's):
  mean acceptance length = 1 + accepted / verify steps
  draft acceptance rate  = accepted / drafted
  per-position rate[i]   = share of verify steps that accepted at least i+1 drafts
Every number is a function of the engine's own step records (simulated time in the fake engine),
never of when the UI happened to refresh, so screenshots are reproducible.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from mtpchat.app.gpu import GpuSample, energy_per_token

WINDOW = 8        # steps per point of the sparklines and the phase split
HISTORY = 240     # points kept per sparkline


class StepRecord(NamedTuple):
    """The part of an engine Step the pane needs (no token ids); a tuple: one is made per step."""
    tokens: int
    drafted: int
    accepted: int
    mtp: bool
    draft_ms: float
    verify_ms: float
    accept_ms: float
    host_ms: float
    elapsed_ms: float
    why: str = ""          # why the step had `drafted` drafts, where the engine chose k (adaptive)
    experts: int = 0       # an MoE model: distinct experts the step read, summed over layers

    @classmethod
    def of(cls, step) -> "StepRecord":
        t = step.times
        return cls(len(step.token_ids), step.drafted, step.accepted, step.mtp,
                   t.draft, t.verify, t.accept, t.host, step.elapsed_ms, step.why,
                   step.experts_read)


@dataclass
class Totals:
    """Acceptance counters, summed over steps (a reply) or over replies (a session)."""
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    at_least: list[int] = field(default_factory=list)

    def add(self, verify_steps: int, drafted: int, accepted: int, at_least) -> None:
        self.verify_steps += verify_steps
        self.drafted += drafted
        self.accepted += accepted
        for i, n in enumerate(at_least):
            if i == len(self.at_least):
                self.at_least.append(0)
            self.at_least[i] += n

    @property
    def mean_length(self) -> float | None:
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else None

    @property
    def rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def per_position(self) -> list[float]:
        return [n / self.verify_steps for n in self.at_least] if self.verify_steps else []


class Telemetry:
    def __init__(self):
        self.session = Totals()
        self.tps_history: deque[float] = deque(maxlen=HISTORY)
        self.acc_history: deque[float] = deque(maxlen=HISTORY)
        self.recent: deque[StepRecord] = deque(maxlen=WINDOW)
        self.gpu: GpuSample | None = None
        self.gpu_prev: GpuSample | None = None
        self.joules_per_token: float | None = None
        self.memory: dict[str, int] = {}
        self.version = 0            # bumped on every change; the pane redraws only when it moved
        self.new_reply()

    # --- one reply ---
    def new_reply(self) -> None:
        self.reply = Totals()
        self.tokens = 0
        self.steps = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.prefill_ms: float | None = None
        self.ttft_ms: float | None = None
        self.first_elapsed: float | None = None
        self.last_elapsed: float | None = None
        self.tokens_per_s: float | None = None
        self._folded = False        # whether `reply` is already counted in `session`
        self.chosen_k: int | None = None   # the last step's k where the engine chose it, and why
        self.chosen_why = ""
        self.recent.clear()
        self._window_tokens = 0
        self.version += 1

    def prefilled(self, prompt_tokens: int, prefill_ms: float, cached_tokens: int = 0) -> None:
        self.prompt_tokens, self.prefill_ms, self.cached_tokens = prompt_tokens, prefill_ms, cached_tokens
        self.version += 1

    def add_steps(self, records) -> None:
        # runs on the UI thread for every step: plain arithmetic, running sums, no lists
        recent, reply = self.recent, self.reply
        for r in records:
            self.steps += 1
            self.tokens += r.tokens
            if self.first_elapsed is None:
                self.first_elapsed = self.ttft_ms = r.elapsed_ms
            self.last_elapsed = r.elapsed_ms
            if r.why:
                self.chosen_k, self.chosen_why = r.drafted, r.why
            if r.mtp:
                reply.verify_steps += 1
                reply.drafted += r.drafted
                reply.accepted += r.accepted
                at_least = reply.at_least
                if len(at_least) < r.drafted:
                    at_least.extend([0] * (r.drafted - len(at_least)))
                for i in range(r.accepted):
                    at_least[i] += 1
            if len(recent) == WINDOW:
                self._window_tokens -= recent[0].tokens
            recent.append(r)
            self._window_tokens += r.tokens
            if self.steps > 1:   # the first step is prefill's token, not decode speed
                self.tps_history.append(self._window_tps(r))
                self.acc_history.append(self._window_tokens / len(recent))
        if self.tokens > 1 and self.last_elapsed > self.first_elapsed:
            self.tokens_per_s = (self.tokens - 1) / ((self.last_elapsed - self.first_elapsed) / 1e3)
        self.version += 1

    def experts_per_layer(self, kind: str, layers: int) -> float | None:
        """Mean distinct experts a recent decode (1 row) or verify step read per layer."""
        steps = [r for r in self.recent if r.experts and r.mtp == (kind == "verify")]
        return sum(r.experts for r in steps) / len(steps) / layers if steps and layers else None

    def _window_tps(self, last: StepRecord) -> float:
        """Tokens/s over the window: the tokens after its first step, over the time since that step."""
        first = self.recent[0]
        if first is last:
            dt, n = last.elapsed_ms - (self.first_elapsed or 0.0), last.tokens
        else:
            dt, n = last.elapsed_ms - first.elapsed_ms, self._window_tokens - first.tokens
        return n / (dt / 1e3) if dt > 0 else 0.0

    def finished(self, stats) -> None:
        """Take the engine's own totals for the reply and fold them into the session."""
        if stats is not None:
            if not self.reply.verify_steps and stats.verify_steps:
                # a server reports its speculative counts once, at the end, not with each step
                self.reply.add(stats.verify_steps, stats.drafted, stats.accepted, stats.accepted_at_least)
            self.ttft_ms = stats.ttft_ms
            self.tokens_per_s = stats.tokens_per_s or self.tokens_per_s
            # the engine's count wins over the steps seen: a server streams pieces, not tokens,
            # and says how many tokens (and prompt tokens) there were only in its final usage
            self.tokens = stats.new_tokens or self.tokens
            if stats.prompt_tokens and not self.prompt_tokens:
                self.prompt_tokens = stats.prompt_tokens
            self.session.add(stats.verify_steps, stats.drafted, stats.accepted, stats.accepted_at_least)
            self._folded = True
        self.version += 1

    @property
    def session_live(self) -> Totals:
        """The session's totals including the reply that is still streaming."""
        if self._folded or not self.reply.verify_steps:
            return self.session
        live = Totals()
        for t in (self.session, self.reply):
            live.add(t.verify_steps, t.drafted, t.accepted, t.at_least)
        return live

    def load_session(self, stats_dicts) -> None:
        """Session totals from stored replies (a reloaded chat)."""
        self.session = Totals()
        for s in stats_dicts:
            n = s.get("verify_steps", 0)
            at_least = [round(p * n) for p in s.get("per_position_acceptance", [])]
            self.session.add(n, s.get("drafted", 0), s.get("accepted", 0), at_least)
        self.version += 1

    # --- phases (mean over the last WINDOW steps) ---
    def phase_ms(self) -> dict[str, float] | None:
        steps = [s for s in self.recent if s.verify_ms > 0]
        if not steps:
            return None
        n = len(steps)
        return {"draft": sum(s.draft_ms for s in steps) / n, "verify": sum(s.verify_ms for s in steps) / n,
                "accept": sum(s.accept_ms for s in steps) / n, "host": sum(s.host_ms for s in steps) / n}

    # --- device ---
    def gpu_sampled(self, s: GpuSample) -> None:
        j = energy_per_token(self.gpu_prev, s)
        if j is not None:
            self.joules_per_token = j
        self.gpu_prev = self.gpu = s   # idle windows emit no tokens: the last value stays
        self.version += 1
