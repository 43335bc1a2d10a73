"""What `mtpchat serve` reports of its speculative decoding, under vLLM's names so that vLLM
dashboards and clients (and `mtpchat --server`) read it as they read vLLM:

- per request, in each response: `metrics.speculative_decoding` in the shape vLLM documents for
  `--per-request-spec-decode-metrics summary` (docs/features/speculative_decoding/acceptance_metrics.md,
  vLLM 0.32): `num_spec_steps`, `num_draft_tokens`, `num_accepted_draft_tokens`,
  `acceptance_histogram` ([j] = steps that accepted exactly j drafts), `num_spec_tokens`;
- for the server's life, on GET /metrics: Prometheus counters `vllm:spec_decode_num_drafts`,
  `..._num_draft_tokens`, `..._num_accepted_tokens` and `..._num_accepted_tokens_per_pos{position}`
  ([i] = steps that accepted at least i+1 drafts), as vLLM's V1 engine names them.
"""
from __future__ import annotations

FINISH = {"stop": "stop", "length": "length", "context": "length", "cancelled": "abort"}


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


def usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


class Counters:
    """/metrics: Prometheus counters under vLLM's names, in a registry of this server's own."""

    def __init__(self, model: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge
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
