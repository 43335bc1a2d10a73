"""What `Engine.generate` yields: plain frozen dataclasses, no torch, safe to pass between threads.

A generation is `Prefilled`, then one `Step` per decode or speculative step, then `Finished`.
Definitions follow the serving engines so numbers compare:
  mean acceptance length = tokens emitted per target forward = 1 + accepted / verify steps
  draft acceptance rate  = accepted / drafted
  per-position acceptance[i] = share of speculative steps that accepted at least i+1 drafts
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LoadProgress:
    """How far one stage of `Engine.load` is, passed to its `progress` callback after each piece.
    stage: "weights" (read and copied; `quantizing` names the format, "fp8" or "int4", that the
    weights are quantized to as they are read, "" where none is) or "capture" (CUDA graphs). `done` / `total` count bytes of weights read, or steps of
    the capture (each phase warmed up, then captured); `tensors` / `tensors_total` count checkpoint
    tensors (weights only)."""
    stage: str
    done: int
    total: int
    tensors: int = 0
    tensors_total: int = 0
    quantizing: str = ""

    @property
    def unit(self) -> str:
        return "B" if self.stage == "weights" else "steps"


@dataclass(frozen=True)
class PhaseTimes:
    """Milliseconds spent in each phase of one step (0.0 where the phase did not run)."""
    draft: float = 0.0
    verify: float = 0.0     # the target forward (decode when MTP is off)
    accept: float = 0.0     # acceptance, bonus token, commit of lengths and of the GDN fold
    host: float = 0.0       # the device-to-host copy and the bookkeeping on the host

    @property
    def total(self) -> float:
        return self.draft + self.verify + self.accept + self.host


@dataclass(frozen=True)
class Prefilled:
    prompt_tokens: int
    prefill_ms: float
    cached_tokens: int = 0  # prompt tokens reused from the state of an earlier turn


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target's raw distribution (the log-softmax of
    its logits, before the presence penalty, temperature and truncation), and the `top` most likely
    tokens there, most likely first: ((token id, logprob), ...)."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Step:
    """One target forward: the tokens it emitted, and where each came from."""
    token_ids: tuple[int, ...]
    from_draft: tuple[bool, ...]  # per token: True = an accepted draft, False = the target's own token
    drafted: int                  # drafts proposed this step (0 with MTP off)
    accepted: int                 # drafts accepted this step
    mtp: bool                     # whether this step was speculative
    times: PhaseTimes
    elapsed_ms: float             # since the generation started (for tokens/s over time)
    why: str = ""                 # why this step has `drafted` drafts (adaptive k; engine/policy.py)
    experts_read: int = 0         # an MoE model: distinct experts read, summed over the target's layers
    draft_experts_read: int = 0   # the same for the MTP head's layer over the step's drafts
    logprobs: tuple[TokenLogprob, ...] | None = None   # per token, where SamplingParams.logprobs asks for them


@dataclass
class Stats:
    """Running totals of one generation; `Finished` carries the final copy."""
    prompt_tokens: int = 0
    reused_tokens: int = 0        # prompt tokens resumed from an earlier turn's state, not prefilled
    new_tokens: int = 0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0          # time to first token: prefill plus the first sample
    decode_ms: float = 0.0        # wall time from the first token to the last
    steps: int = 0                # target forwards after prefill
    verify_steps: int = 0         # speculative steps among them
    drafted: int = 0
    accepted: int = 0
    accepted_at_least: list[int] = field(default_factory=list)  # [i] = steps that accepted >= i+1 drafts
    k_histogram: dict[int, int] = field(default_factory=dict)   # {k: steps with k drafts}; 0 = MTP off
    phase_ms: PhaseTimes = field(default_factory=PhaseTimes)     # summed over steps
    # an MoE model (moe_layers > 0): distinct experts read, summed over layers and steps, apart
    # for plain decode steps, speculative verify steps, and the head over the drafts
    moe_layers: int = 0
    experts_read_decode: int = 0
    experts_read_verify: int = 0
    experts_read_draft: int = 0

    def count_experts(self, k: int, target: int, head: int):
        if k:
            self.experts_read_verify += target
            self.experts_read_draft += head
        else:
            self.experts_read_decode += target

    @property
    def experts_per_layer(self) -> dict[str, float]:
        """Mean distinct experts a step reads per MoE layer: a plain decode step, a verify step
        (all its k+1 rows), and the head's layer over a step's drafts."""
        if not self.moe_layers:
            return {}
        plain = self.steps - self.verify_steps
        per = lambda total, steps, layers: round(total / steps / layers, 3) if steps else 0.0
        return {"decode": per(self.experts_read_decode, plain, self.moe_layers),
                "verify": per(self.experts_read_verify, self.verify_steps, self.moe_layers),
                "draft": per(self.experts_read_draft, self.verify_steps, 1)}

    @property
    def tokens_per_s(self) -> float:
        # the first token comes from prefill; the rest from decode time
        return (self.new_tokens - 1) / (self.decode_ms / 1e3) if self.decode_ms > 0 and self.new_tokens > 1 else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else 1.0

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [n / self.verify_steps for n in self.accepted_at_least] if self.verify_steps else []

    def as_dict(self) -> dict:
        p = self.phase_ms
        return {
            "prompt_tokens": self.prompt_tokens, "reused_tokens": self.reused_tokens, "new_tokens": self.new_tokens,
            "prefill_ms": round(self.prefill_ms, 3), "ttft_ms": round(self.ttft_ms, 3),
            "decode_ms": round(self.decode_ms, 3), "tokens_per_s": round(self.tokens_per_s, 3),
            "steps": self.steps, "verify_steps": self.verify_steps,
            "drafted": self.drafted, "accepted": self.accepted,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "draft_acceptance_rate": round(self.draft_acceptance_rate, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "k_histogram": {str(k): n for k, n in sorted(self.k_histogram.items())},
            "phase_ms": {"draft": round(p.draft, 3), "verify": round(p.verify, 3),
                         "accept": round(p.accept, 3), "host": round(p.host, 3)},
            **({"experts_per_layer": self.experts_per_layer} if self.moe_layers else {}),
        }


@dataclass(frozen=True)
class Finished:
    reason: str                   # "stop" (EOS or a stop id), "length", "cancelled", "context" (context full)
    stats: Stats
    token_ids: tuple[int, ...]    # everything generated, in order
