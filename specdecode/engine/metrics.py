"""What the serving engine measures, exposed through `prometheus_client` (`/metrics`).

Names follow vLLM's where vLLM has the metric, with our prefix in place of `vllm:`: requests, prompt and
generation tokens, time to first token, inter-token latency, and the speculative-decoding counters
`spec_decode_num_drafts` / `num_draft_tokens` / `num_accepted_tokens` / `num_accepted_tokens_per_pos`
(position 0 is the first draft). Written by the engine thread, read by the server; every update and each
scrape hold one lock, so a scrape never sees a half-recorded round.
"""

import threading

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "specdecode:"
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class EngineMetrics:
    """Counters and histograms of one engine since it started, in a registry of its own."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = {"finished": 0, "cancelled": 0, "failed": 0, "refused": 0}
        self.prompt_tokens = 0
        self.prefix_cached_tokens = 0  # prompt tokens whose prefill a kept KV slot saved
        self.generated_tokens = 0
        self.rounds = 0  # request-rounds: one per request per verify pass
        self.drafts = 0  # request-rounds that verified at least one draft
        self.draft_tokens = 0  # drafts verified
        self.steps_without_drafting = 0  # verify passes in which the drafting gate skipped drafting
        self.accepted_tokens = 0  # sum of accepted lengths (drafts kept + the target's own token)
        self.position_attempts: list[int] = []
        self.position_accepts: list[int] = []
        self.queue_length = 0
        self.running = 0
        self.kv_cache_bytes = 0
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=self.registry)

        self.verify_rows = histogram("verify_batch_requests", "Requests in a verify pass", BATCH_BUCKETS)
        self.verify_tokens = histogram("verify_batch_tokens", "Tokens in a verify pass", BATCH_BUCKETS)
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time to first token in seconds", LATENCY_BUCKETS_S
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Inter-token latency in seconds", LATENCY_BUCKETS_S
        )

    def record_round(self, verified: int, accepted: int) -> None:
        """One request's round: `verified` drafts went into the pass, `accepted` of them survived."""
        self.rounds += 1
        self.accepted_tokens += accepted + 1
        if verified:
            self.drafts += 1
            self.draft_tokens += verified
        missing = verified - len(self.position_attempts)
        if missing > 0:
            self.position_attempts += [0] * missing
            self.position_accepts += [0] * missing
        for j in range(min(accepted + 1, verified)):
            self.position_attempts[j] += 1
            self.position_accepts[j] += int(j < accepted)

    def collect(self):
        """The counters and gauges as metric families (prometheus_client calls this on every scrape)."""

        def counter(name: str, doc: str, value: float, labels: dict | None = None) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=list(labels or {}))
            family.add_metric(list((labels or {}).values()), value)
            return family

        requests = CounterMetricFamily(PREFIX + "requests", "Requests by how they ended", labels=["status"])
        for status, count in self.requests.items():
            requests.add_metric([status], count)
        yield requests
        yield counter("prompt_tokens", "Prefill tokens processed", self.prompt_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens a kept KV slot held", self.prefix_cached_tokens)
        yield counter("generation_tokens", "Generation tokens processed", self.generated_tokens)
        yield counter("verify_rounds", "Request-rounds (one per request per verify pass)", self.rounds)
        yield counter("spec_decode_num_drafts", "Request-rounds that verified drafts", self.drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified", self.draft_tokens)
        yield counter(
            "spec_decode_steps_without_drafting",
            "Verify passes the drafting gate ran without drafts",
            self.steps_without_drafting,
        )
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted", self.accepted_tokens - self.rounds)
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Accepted drafts by position", labels=["position"]
        )
        for j, hits in enumerate(self.position_accepts):
            per_position.add_metric([str(j)], hits)
        yield per_position
        gauges = {
            "mean_accepted_length": self.accepted_tokens / self.rounds if self.rounds else 0.0,
            "num_requests_waiting": self.queue_length,
            "num_requests_running": self.running,
            "kv_cache_bytes": self.kv_cache_bytes,
        }
        for name, value in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, name.replace("_", " "), value=value)

    def render(self) -> bytes:
        """Prometheus text exposition format."""
        with self.lock:
            return generate_latest(self.registry)
