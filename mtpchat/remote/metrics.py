"""A server's speculative decoding figures, in the engine's own terms (engine/events.py).

Three sources, best first:
- per request, in the response: vLLM's `metrics.speculative_decoding` (`num_spec_steps`,
  `num_draft_tokens`, `num_accepted_draft_tokens`, `acceptance_histogram`: vLLM 0.32 with
  `--per-request-spec-decode-metrics summary`; also what `mtpchat serve` sends), SGLang's `meta_info`
  (`spec_verify_ct` with the accepted and proposed draft counts, or with `completion_tokens`);
- the server's Prometheus /metrics read before and after the request: vLLM's counters
  `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
  `..._num_accepted_tokens_per_pos{position}` (vLLM 0.9+, the V1 engine) give this request's exact
  counts when it ran alone; SGLang's gauges `sglang:spec_accept_length` / `sglang:spec_accept_rate`
  are the server's recent average, not this request's: an estimate, and `source` says so;
- none: the panels say N/A.
"""
from __future__ import annotations

from dataclasses import dataclass, field

VLLM = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted"}
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SGLANG = {"sglang:spec_accept_length": "accept_length", "sglang:spec_accept_rate": "accept_rate"}
# SGLang's meta_info counts (accepted drafts, proposed drafts) under the names its releases have used,
# newest first; the histogram is `spec_correct_drafts_histogram`, earlier `spec_accept_histogram`
SGLANG_COUNTS = (("spec_num_correct_drafts", "spec_num_proposed_drafts"),
                 ("spec_accepted_drafts", "spec_proposed_drafts"),
                 ("spec_accept_token_num", "spec_draft_token_num"))


@dataclass
class Spec:
    """Speculative decoding counts of one request. `exact` is False for a server-wide average."""
    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    at_least: list[int] = field(default_factory=list)
    source: str = ""
    exact: bool = True

    @property
    def mean_length(self) -> float | None:
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else None


@dataclass
class Snapshot:
    """The figures of one /metrics read: vLLM's counters summed over engines, SGLang's gauges averaged
    over ranks."""
    counters: dict[str, float] = field(default_factory=dict)
    per_pos: dict[int, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.counters or self.per_pos or self.gauges)


def parse(text: str) -> Snapshot:
    """Prometheus text -> the figures we read; a page that does not parse reads as none."""
    from prometheus_client.parser import text_string_to_metric_families
    snap, gauges = Snapshot(), {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:
        return snap
    for family in families:
        name = family.name.removesuffix("_total")
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket", "_sum", "_count")):
                continue
            if name in VLLM:
                snap.counters[VLLM[name]] = snap.counters.get(VLLM[name], 0.0) + sample.value
            elif name == VLLM_PER_POS and "position" in sample.labels:
                pos = int(sample.labels["position"])
                snap.per_pos[pos] = snap.per_pos.get(pos, 0.0) + sample.value
            elif name in SGLANG:
                gauges.setdefault(SGLANG[name], []).append(sample.value)
    snap.gauges = {k: sum(v) / len(v) for k, v in gauges.items() if v}
    return snap


def between(before: Snapshot | None, after: Snapshot | None, new_tokens: int) -> Spec | None:
    """This request's counts from two reads of /metrics around it, or None where there are none."""
    if before is None or after is None or after.empty:
        return None
    if "drafts" in after.counters:
        d = {k: after.counters[k] - before.counters.get(k, 0.0) for k in after.counters}
        per = [after.per_pos[p] - before.per_pos.get(p, 0.0) for p in sorted(after.per_pos)]
        if d.get("drafts", 0) < 0:     # the server restarted in between
            return None
        return Spec(round(d.get("drafts", 0)), round(d.get("draft_tokens", 0)), round(d.get("accepted", 0)),
                    [round(x) for x in per], source="vLLM /metrics")
    return from_average(after.gauges.get("accept_length"), after.gauges.get("accept_rate"), new_tokens,
                        "SGLang /metrics (server average)")


def from_average(length: float | None, rate: float | None, new_tokens: int, source: str) -> Spec | None:
    """Counts that reproduce an average acceptance length over this reply's tokens: an estimate."""
    if not length or length < 1 or not new_tokens:
        return None
    steps = max(round(new_tokens / length), 1)
    accepted = max(new_tokens - steps, 0)
    drafted = round(accepted / rate) if rate else 0
    return Spec(steps, drafted, accepted, [], source=source, exact=False)


def at_least(histogram) -> list[int]:
    """[i] = steps that accepted at least i+1 drafts, from [j] = steps that accepted exactly j."""
    hist = [int(x) for x in histogram or []]
    return [sum(hist[i + 1:]) for i in range(len(hist) - 1)]


def from_response(event: dict) -> Spec | None:
    """Per-request counts carried by a response or a stream event, where the server sends them."""
    try:
        return _per_request(event)
    except (TypeError, ValueError):
        return None    # figures in a shape we do not know: none, rather than a failed reply


def _per_request(event: dict) -> Spec | None:
    metrics = event.get("metrics")
    spec = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if isinstance(spec, dict) and "num_spec_steps" in spec:
        return Spec(int(spec["num_spec_steps"]), int(spec.get("num_draft_tokens") or 0),
                    int(spec.get("num_accepted_draft_tokens") or 0), at_least(spec.get("acceptance_histogram")),
                    source="per request")
    meta = event.get("meta_info")
    if isinstance(meta, dict) and meta.get("spec_verify_ct"):
        steps, source = int(meta["spec_verify_ct"]), "per request (SGLang meta_info)"
        for accepted, drafted in SGLANG_COUNTS:
            if meta.get(accepted) is not None:
                hist = meta.get("spec_correct_drafts_histogram", meta.get("spec_accept_histogram"))
                return Spec(steps, int(meta.get(drafted) or 0), int(meta[accepted]), at_least(hist), source=source)
        tokens = int(meta.get("completion_tokens", 0))
        if tokens:   # each verify step emits its accepted drafts and one token of its own
            return Spec(steps, 0, max(tokens - steps, 0), [], source=source)
    return None
