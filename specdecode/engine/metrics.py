"""What the serving engine measures, and its Prometheus text form (`/metrics`).

Written by the engine thread, read by the server; every update and the rendering hold one lock, so a scrape
never sees a half-recorded round.
"""

import bisect
import threading
from dataclasses import dataclass, field

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class Histogram:
    """Cumulative-bucket histogram, as Prometheus expects."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    observations: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.observations += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip(self.buckets, self.counts, strict=True):
            running += count
            out.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.observations}', f"{name}_sum {round(self.total, 6)}"]
        return out + [f"{name}_count {self.observations}"]


class EngineMetrics:
    """Counters and histograms of one engine since it started."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = {"finished": 0, "cancelled": 0, "failed": 0, "refused": 0}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.rounds = 0  # request-rounds: one per request per verify pass
        self.accepted_tokens = 0  # sum of accepted lengths (drafts kept + the target's own token)
        self.position_attempts: list[int] = []
        self.position_accepts: list[int] = []
        self.verify_rows = Histogram(BATCH_BUCKETS)
        self.verify_tokens = Histogram(BATCH_BUCKETS)
        self.time_to_first_token = Histogram(LATENCY_BUCKETS_S)
        self.inter_token_latency = Histogram(LATENCY_BUCKETS_S)
        self.queue_length = 0
        self.running = 0
        self.kv_cache_bytes = 0

    def record_round(self, verified: int, accepted: int) -> None:
        """One request's round: `verified` drafts went into the pass, `accepted` of them survived."""
        self.rounds += 1
        self.accepted_tokens += accepted + 1
        missing = verified - len(self.position_attempts)
        if missing > 0:
            self.position_attempts += [0] * missing
            self.position_accepts += [0] * missing
        for j in range(min(accepted + 1, verified)):
            self.position_attempts[j] += 1
            self.position_accepts[j] += int(j < accepted)

    def render(self) -> str:
        """Prometheus text exposition format (version 0.0.4)."""
        with self.lock:
            lines = ["# TYPE specdecode_requests_total counter"]
            lines += [f'specdecode_requests_total{{status="{k}"}} {v}' for k, v in self.requests.items()]
            counters = {
                "specdecode_prompt_tokens_total": self.prompt_tokens,
                "specdecode_generation_tokens_total": self.generated_tokens,
                "specdecode_verify_rounds_total": self.rounds,
                "specdecode_accepted_tokens_total": self.accepted_tokens,
            }
            for name, value in counters.items():
                lines += [f"# TYPE {name} counter", f"{name} {value}"]
            gauges = {
                "specdecode_mean_accepted_length": self.accepted_tokens / self.rounds if self.rounds else 0.0,
                "specdecode_queue_length": self.queue_length,
                "specdecode_running_requests": self.running,
                "specdecode_kv_cache_bytes": self.kv_cache_bytes,
            }
            for name, value in gauges.items():
                lines += [f"# TYPE {name} gauge", f"{name} {round(value, 6)}"]
            lines.append("# TYPE specdecode_position_acceptance gauge")
            for j, (tries, hits) in enumerate(zip(self.position_attempts, self.position_accepts, strict=True)):
                lines.append(f'specdecode_position_acceptance{{position="{j + 1}"}} {round(hits / max(tries, 1), 6)}')
            histograms = {
                "specdecode_verify_batch_requests": self.verify_rows,
                "specdecode_verify_batch_tokens": self.verify_tokens,
                "specdecode_time_to_first_token_seconds": self.time_to_first_token,
                "specdecode_inter_token_latency_seconds": self.inter_token_latency,
            }
            for name, histogram in histograms.items():
                lines += [f"# TYPE {name} histogram", *histogram.lines(name)]
        return "\n".join(lines) + "\n"
