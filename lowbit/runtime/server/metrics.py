"""Prometheus text exposition (format 0.0.4), written by hand: a few counters and histograms.

Histograms and request counters are updated on the server's event-loop thread only; engine
figures come from the snapshot of `Engine.stats()` the engine thread publishes after each step,
so rendering /metrics never touches the engine.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from lowbit.runtime.process_memory import resident_bytes

# Latency buckets in seconds: from a fast GPU decode step to a long CPU request.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(slots=True)
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last = +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.total += value * times
        self.count += times

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {self.total}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


# (metric name, type, help, EngineStats attribute)
ENGINE_METRICS = (
    ("lowbit_requests_running", "gauge", "Requests in the running batch.", "running"),
    ("lowbit_requests_waiting", "gauge", "Requests in the engine's waiting queue.", "waiting"),
    ("lowbit_kv_cache_usage_ratio", "gauge", "Fraction of KV cache blocks in use (0..1).", "kv_usage"),
    ("lowbit_kv_cache_blocks_used", "gauge", "KV cache blocks in use.", "kv_blocks_used"),
    ("lowbit_kv_cache_blocks_total", "gauge", "KV cache blocks in the pool.", "kv_blocks_total"),
    ("lowbit_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
     "prefix_cache_queries"),
    ("lowbit_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("lowbit_prompt_tokens_total", "counter", "Prompt tokens processed.", "prompt_tokens_total"),
    ("lowbit_generation_tokens_total", "counter", "Tokens generated.", "generation_tokens_total"),
    ("lowbit_preemptions_total", "counter", "Sequences preempted for lack of KV blocks.", "preemptions_total"),
    ("lowbit_spec_draft_tokens_total", "counter", "Draft tokens proposed by speculative decoding.",
     "spec_draft_tokens"),
    ("lowbit_spec_accepted_tokens_total", "counter", "Draft tokens accepted by the target model.",
     "spec_accepted_tokens"),
    ("lowbit_spec_mean_accepted_length", "gauge", "Tokens emitted per target pass under speculation.",
     "spec_mean_accepted_length"),
)


class Metrics:
    def __init__(self) -> None:
        self.ttft = Histogram("lowbit_time_to_first_token_seconds", "Time from request arrival to its first token.",
                              TTFT_BUCKETS)
        self.itl = Histogram("lowbit_inter_token_latency_seconds", "Time between consecutive output tokens.",
                             ITL_BUCKETS)
        self.e2e = Histogram("lowbit_e2e_request_latency_seconds", "Time from request arrival to its last token.",
                             E2E_BUCKETS)
        self.finished: Counter[str] = Counter()  # by finish reason
        self.errors: Counter[int] = Counter()  # HTTP error responses by status
        self.in_flight = 0  # requests accepted and not yet answered

    def render(self, engine_stats) -> str:
        lines: list[str] = []
        for name, kind, help_text, attr in ENGINE_METRICS:
            value = getattr(engine_stats, attr, None) if engine_stats is not None else None
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {_number(value)}"]
        lines += ["# HELP lowbit_requests_in_flight Requests accepted by the server and not yet answered.",
                  "# TYPE lowbit_requests_in_flight gauge", f"lowbit_requests_in_flight {self.in_flight}"]
        lines += ["# HELP lowbit_requests_finished_total Finished requests by finish reason.",
                  "# TYPE lowbit_requests_finished_total counter"]
        for reason in ("stop", "length", "abort"):
            lines.append(f'lowbit_requests_finished_total{{finish_reason="{reason}"}} {self.finished[reason]}')
        lines += ["# HELP lowbit_http_errors_total Error responses by HTTP status.",
                  "# TYPE lowbit_http_errors_total counter"]
        for status in sorted(self.errors):
            lines.append(f'lowbit_http_errors_total{{status="{status}"}} {self.errors[status]}')
        for hist in (self.ttft, self.itl, self.e2e):
            lines += hist.render()
        resident, _ = resident_bytes()
        if resident is not None:  # the name Prometheus' process collectors use
            lines += ["# HELP process_resident_memory_bytes Resident memory of the server process.",
                      "# TYPE process_resident_memory_bytes gauge", f"process_resident_memory_bytes {resident}"]
        return "\n".join(lines) + "\n"


def _number(value) -> str:
    if value is None:
        return "0"
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def parse_metrics(text: str) -> dict[str, float]:
    """{'name{labels}': value} for every sample line: what tests and the load bench read back."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
