"""How many drafts the next step should carry: the k that maximises expected tokens per unit of time,
from the acceptance seen so far and the measured step times; 0 turns MTP off.

With c_i the chance that draft i is accepted given drafts 1..i-1 were, P_i = c_1 ... c_i is the
chance that a step accepts at least i drafts, and a step with k drafts emits on average
    E_k = 1 + P_1 + ... + P_k  tokens  in  T_k = draft + verify + accept time of a k-draft step.
The policy picks the k in 0..k_user with the largest E_k / T_k (ties: the smaller k), and MTP off
unless that k beats it by ON_MARGIN (see there). One more
draft pays when P_{k+1} > E_k (T_{k+1} / T_k - 1): that threshold and the P_{k+1} seen are what
`why` reports, as a sentence the app shows (a threshold past 100% is said as a draft that costs
more than it can gain).

c_i is a running rate per position (a step that drafted k and accepted a tested positions
1..min(a+1, k)), an exponential average so that it follows the reply (thinking, code, prose) and
falls with the context as acceptance does. T_k is the running mean of the measured phase times of
k-draft steps; a k not run yet is interpolated (or extrapolated) from the ones that were, with
PRIOR_SLOPE of a step per draft where only one is known (so one step without drafts is timed
early on). Positions past the chosen k (and
acceptance itself once MTP is off) are only seen by probing: every `probe_every` steps one step
runs with one more draft; each probe that does not change the choice doubles the wait, up to
MAX_PROBE_EVERY steps.

The choice is made on the host, which picks the graphs of the k it launches anyway (a choice made
on the device would have to be read back before the launch: a sync per step). It uses the accepted
counts and phase times of the steps already read (with two steps in flight, one step behind), a few
dozen float operations per step: no device sync, no device memory.
"""
from __future__ import annotations

PRIOR = (0.8, 0.75, 0.7, 0.65)   # conditional acceptance assumed before any step (then per position: last)
PRIOR_WEIGHT = 2.0              # ... worth this many observed steps
DECAY = 1 / 16                  # weight of the newest observation in the running rates
TIME_DECAY = 1 / 8              # ... and in the running step times
PRIOR_SLOPE = 0.05              # one more draft costs this share of a step, until measured
# Drafting must beat MTP off by this share of its rate to be chosen: the step times are measured
# (on a CPU shared with other work they wander by more than the few percent drafting would gain
# there), and drafting pays costs T_k leaves out (probes, the head's catch-up when it resumes), so a
# gain within this margin is as likely a loss. On a GPU drafting gains 50% and more: untouched.
ON_MARGIN = 0.05
PROBE_EVERY = 16
MAX_PROBE_EVERY = 128


class AdaptiveK:
    """The draft-length policy of one engine. `costs`: fixed step times per k (tests, a model of
    another device) instead of the measured ones."""

    def __init__(self, k_max: int, probe_every: int = PROBE_EVERY, costs=None):
        self.k_max, self.base_probe, self.costs = k_max, probe_every, costs
        self.step_ms: dict[int, float] = {}
        self.forget()

    def forget(self):
        """Back to the prior acceptance (the measured times are kept: they belong to the device)."""
        prior = [PRIOR[min(i, len(PRIOR) - 1)] for i in range(self.k_max)]
        self.hits = [p * PRIOR_WEIGHT for p in prior]
        self.trials = [PRIOR_WEIGHT] * self.k_max
        self.probe_every, self.since_probe, self.probing = self.base_probe, 0, 0
        self.why = ""

    # --- the model -----------------------------------------------------------------------------
    def at_least(self) -> list[float]:
        """[P_1..P_k_max]: the chance a step accepts at least i drafts."""
        out, p = [], 1.0
        for h, n in zip(self.hits, self.trials):
            p *= h / n
            out.append(p)
        return out

    def time(self, k: int) -> float:
        """T_k in ms (or relative units before any measurement)."""
        if self.costs is not None:
            return self.costs[k]
        if k in self.step_ms:
            return self.step_ms[k]
        known = sorted(self.step_ms)
        if not known:
            return 1.0 + PRIOR_SLOPE * k
        if len(known) == 1:
            k0 = known[0]
            base = self.step_ms[k0] / (1.0 + PRIOR_SLOPE * k0)
            return base * (1.0 + PRIOR_SLOPE * k)
        lo = max([j for j in known if j < k], default=None)
        hi = min([j for j in known if j > k], default=None)
        if lo is None:
            lo, hi = known[0], known[1]
        elif hi is None:
            lo, hi = known[-2], known[-1]
        slope = (self.step_ms[hi] - self.step_ms[lo]) / (hi - lo)
        return max(self.step_ms[lo] + slope * (k - lo), 1e-6)

    def best(self, k_user: int) -> tuple[int, str]:
        """The k in 0..k_user with the most expected tokens per ms, and why it stops there."""
        P = self.at_least()
        rate = lambda k: (1.0 + sum(P[:k])) / self.time(k)
        k = max(range(k_user + 1), key=lambda j: (rate(j), -j))
        if k and rate(k) < (1.0 + ON_MARGIN) * rate(0):
            k = 0
        if k == k_user:
            return k, f"all {k} drafts pay off" if k > 1 else "the draft pays off"
        # what draft k+1 would need to reach the rate of k drafts, and what it gets
        need = ((1.0 + sum(P[:k])) * (self.time(k + 1) / self.time(k) - 1.0) if k else
                (1.0 + ON_MARGIN) * self.time(1) / self.time(0) - 1.0)
        head = "MTP off: a draft" if k == 0 else f"{k} of {k_user} drafts: draft {k + 1}"
        if need >= 1.0:
            return k, f"{head} costs more than it can gain"
        return k, f"{head} would need {_pct(need)} acceptance to pay, and gets {_pct(P[k])}"

    # --- the host's side of a step -------------------------------------------------------------
    def choose(self, k_user: int) -> tuple[int, str]:
        """The k for the next step (no side effects: call `launched` with what was launched)."""
        k_user = min(k_user, self.k_max)
        k, why = self.best(k_user)
        if self.since_probe >= self.probe_every:
            if k < k_user:
                return k + 1, f"probing: one step with draft {k + 1}, to see whether it pays now"
            if k and self.costs is None and 0 not in self.step_ms:
                return 0, "timing a step without drafts"     # T_0 anchors the times of every k
        return k, why

    def launched(self, k: int, why: str):
        self.why = why
        if why.startswith(("probing", "timing")):
            self.since_probe, self.probing = 0, k
        else:
            self.since_probe += 1

    def observe(self, k: int, accepted: int | None, times=None, k_user: int | None = None):
        """A step read back: k drafts, `accepted` of them kept (None where a stop id or the token
        limit cut the window short, so it says nothing of acceptance), its PhaseTimes."""
        for i in range(min(accepted + 1, k) if accepted is not None else 0):
            self.trials[i] = self.trials[i] * (1 - DECAY) + 1.0
            self.hits[i] = self.hits[i] * (1 - DECAY) + (1.0 if i < accepted else 0.0)
        if times is not None:
            ms = times.draft + times.verify + times.accept
            if ms > 0:
                old = self.step_ms.get(k)
                self.step_ms[k] = ms if old is None else old + TIME_DECAY * (ms - old)
        if self.probing and k == self.probing:
            chosen, _ = self.best(k_user if k_user is not None else self.k_max)
            # a probe that changed nothing makes the next one wait longer
            self.probe_every = self.base_probe if chosen >= k else min(2 * self.probe_every, MAX_PROBE_EVERY)
            self.probing = 0


def _pct(x: float) -> str:
    return f"{max(0.0, min(x, 1.0)) * 100:.0f}%"
