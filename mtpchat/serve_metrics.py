"""What `mtpchat serve` reports of its speculative decoding, under vLLM's names so that vLLM
dashboards and clients (and `mtpchat --server`) read it as they read vLLM:

- per request, in each response: `metrics.speculative_decoding` in the shape vLLM documents for
  `--per-request-spec-decode-metrics summary` (docs/features/speculative_decoding/acceptance_metrics.md,
  vLLM 0.32): `num_spec_steps`, `num_draft_tokens`, `num_accepted_draft_tokens`,
  `acceptance_histogram` ([j] = steps that accepted exactly j drafts), `num_spec_tokens`;
- for the server's life, on GET /metrics: Prometheus counters `vllm:spec_decode_num_drafts`,
  `..._num_draft_tokens`, `..._num_accepted_tokens` and `..._num_accepted_tokens_per_pos{position}`
  ([i] = steps that accepted at least i+1 drafts), as vLLM's V1 engine names them;
- the per-request histograms a vLLM dashboard plots (time to first token, end-to-end latency,
  inter-token latency, queue, prefill and decode time, prompt and generation tokens), with vLLM's
  names, buckets and `model_name` label (vllm/v1/metrics/loggers.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

FINISH = {"stop": "stop", "length": "length", "context": "length", "cancelled": "abort", "tool_calls": "tool_calls"}


def histogram(steps: int, at_least: list[int], k: int) -> list[int]:
    """[j] = steps that accepted exactly j of their drafts, j = 0..k, from [i] = steps that accepted
    at least i+1 (acceptance stops at the first rejected draft, so the two say the same)."""
    at = list(at_least) + [0] * (k + 1 - len(at_least))    # (k+1,): at[k] = 0, none took more than k
    return [steps - at[0]] + [at[j - 1] - at[j] for j in range(1, k + 1)]


def spec_metrics(stats) -> dict:
    """The request's own speculative decoding figures, as vLLM's per-request metrics carry them."""
    k = max([len(stats.accepted_at_least), *stats.k_histogram])   # the most drafts a step carried
    return {"speculative_decoding": {
        "mean_acceptance_length": stats.mean_acceptance_length,
        "draft_acceptance_rate": stats.draft_acceptance_rate,
        "acceptance_histogram": histogram(stats.verify_steps, stats.accepted_at_least, k),
        "num_spec_steps": stats.verify_steps, "num_accepted_draft_tokens": stats.accepted,
        "num_draft_tokens": stats.drafted, "num_spec_tokens": k}}


def usage(stats, reasoning_tokens: int = 0) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.reused_tokens},
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}


# vLLM's buckets: seconds to the first token, between tokens, and for whole requests
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


def token_buckets(most: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `most` (vLLM's build_1_2_5_buckets of the context length)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > most:
                return out
            out.append(m * scale)
        scale *= 10


@dataclass
class Timing:
    """Seconds of one request's life, as the histograms take them."""
    queue: float = 0.0          # arrival to its turn
    prefill: float = 0.0        # its turn to the first token
    ttft: float = 0.0           # arrival to the first token
    decode: float = 0.0         # the first token to the last
    e2e: float = 0.0            # arrival to the end
    gaps: list[float] = field(default_factory=list)   # between successive steps' tokens


class Counters:
    """/metrics: Prometheus counters under vLLM's names, in a registry of this server's own."""

    def __init__(self, model: str, max_context: int = 8192):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = r = CollectorRegistry()
        self.model = model
        c = lambda name, doc, *labels: Counter(name, doc, ["model_name", *labels], registry=r)
        self.drafts = c("vllm:spec_decode_num_drafts", "Speculative steps (one per verify forward).")
        self.draft_tokens = c("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.accepted = c("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.per_pos = c("vllm:spec_decode_num_accepted_tokens_per_pos",
                         "Steps that accepted the draft at this position.", "position")
        self.prompt = c("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generated = c("vllm:generation_tokens", "Tokens generated.")
        self.requests = c("vllm:request_success", "Finished requests, by how they finished.", "finished_reason")
        self.running = Gauge("vllm:num_requests_running", "Requests generating.", ["model_name"], registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting their turn.", ["model_name"], registry=r)
        h = lambda name, doc, buckets: Histogram(name, doc, ["model_name"], buckets=buckets, registry=r)
        tokens = token_buckets(max_context)
        self.ttft = h("vllm:time_to_first_token_seconds", "Time to the first token.", TTFT_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds", "Whole request latency.", REQUEST_BUCKETS)
        self.queue = h("vllm:request_queue_time_seconds", "Time waiting for the engine.", REQUEST_BUCKETS)
        self.prefill = h("vllm:request_prefill_time_seconds", "Prefill time.", REQUEST_BUCKETS)
        self.decode = h("vllm:request_decode_time_seconds", "Decode time.", REQUEST_BUCKETS)
        self.prompt_hist = h("vllm:request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.generation_hist = h("vllm:request_generation_tokens", "Generated tokens per request.", tokens)

    def observe(self, stats, t: Timing) -> None:
        """One finished request's histograms."""
        m = self.model
        for hist, value in ((self.ttft, t.ttft), (self.e2e, t.e2e), (self.queue, t.queue),
                            (self.prefill, t.prefill), (self.decode, t.decode)):
            hist.labels(m).observe(value)
        for gap in t.gaps:
            self.itl.labels(m).observe(gap)
        self.prompt_hist.labels(m).observe(stats.prompt_tokens)
        self.generation_hist.labels(m).observe(stats.new_tokens)

    def count(self, stats, reason: str) -> None:
        m = self.model
        self.drafts.labels(m).inc(stats.verify_steps)
        self.draft_tokens.labels(m).inc(stats.drafted)
        self.accepted.labels(m).inc(stats.accepted)
        for i, n in enumerate(stats.accepted_at_least):
            self.per_pos.labels(m, str(i)).inc(n)
        self.prompt.labels(m).inc(stats.prompt_tokens)
        self.generated.labels(m).inc(stats.new_tokens)
        self.requests.labels(m, FINISH.get(reason, reason)).inc()

    def text(self) -> bytes:
        from prometheus_client import generate_latest
        return generate_latest(self.registry)
