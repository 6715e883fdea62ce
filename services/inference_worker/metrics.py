"""Request metrics of `flashmoe serve` on ``/metrics`` (Prometheus text format): time to first
token and inter-token latency as histograms (seconds), and, read from ``/stats`` at each
scrape, the engine's counters (requests, tokens) and the cache's (hits, misses, evictions,
bytes read)."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 30.0)

# /stats key -> (metric name, type, help)
FROM_STATS = {
    "requests": ("flashmoe_serve_requests_total", "counter", "Requests accepted."),
    "requests_finished": ("flashmoe_serve_requests_finished_total", "counter",
                          "Requests answered in full."),
    "requests_cancelled": ("flashmoe_serve_requests_cancelled_total", "counter",
                           "Requests whose client went away before the end."),
    "requests_failed": ("flashmoe_serve_requests_failed_total", "counter",
                        "Requests ended by an error."),
    "requests_rejected": ("flashmoe_serve_requests_rejected_total", "counter",
                          "Requests refused with 503 because the queue was full."),
    "experts_routed_around": ("flashmoe_serve_experts_routed_around", "gauge",
                              "Experts that cannot be loaded (a bad block), computed without."),
    "rows_routed_around": ("flashmoe_serve_rows_routed_around_total", "counter",
                           "Positions x layers computed without an expert routed around."),
    "tokens_generated": ("flashmoe_serve_generated_tokens_total", "counter",
                         "Tokens generated."),
    "prompt_tokens": ("flashmoe_serve_prompt_tokens_total", "counter",
                      "Prompt tokens of the requests answered."),
    "queue_length": ("flashmoe_serve_queue_length", "gauge",
                     "Requests waiting for the model loop."),
    "running": ("flashmoe_serve_running_sequences", "gauge", "Sequences being decoded."),
    "max_batch": ("flashmoe_serve_max_batch", "gauge",
                  "The most sequences decoded together so far."),
    "cache_hits": ("flashmoe_serve_cache_hits_total", "counter",
                   "Expert requests found resident."),
    "cache_misses": ("flashmoe_serve_cache_misses_total", "counter",
                     "Expert requests that waited for a read."),
    "evictions": ("flashmoe_serve_cache_evictions_total", "counter", "Experts evicted."),
    "bytes_read": ("flashmoe_serve_cache_read_bytes_total", "counter",
                   "Bytes read from the store."),
    "estimates_used": ("flashmoe_serve_cache_estimates_used_total", "counter",
                       "Evictions decided on the predictor's estimate."),
}


class RequestMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram("flashmoe_serve_time_to_first_token_seconds",
                              "From a request's arrival to its first token.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("flashmoe_serve_inter_token_latency_seconds",
                             "Between two tokens of one request.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.lock = threading.Lock()
        self.last: dict[int, float] = {}  # request id -> when its last token came

    def observe(self, request, kind: str, at: float) -> None:
        """A request's event (``kind`` as the engine emits it) at monotonic time ``at``."""
        with self.lock:
            if kind == "text":
                previous = self.last.get(request.id)
                if previous is None:
                    self.ttft.observe(max(at - request.arrived, 0.0))
                else:
                    self.itl.observe(max(at - previous, 0.0))
                self.last[request.id] = at
            else:
                self.last.pop(request.id, None)

    def render(self, stats: dict) -> str:
        lines = []
        for key, (name, kind, doc) in FROM_STATS.items():
            value = stats.get(key)
            if value is None:
                continue
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name} {value}"]
        return generate_latest(self.registry).decode() + "\n".join(lines) + "\n"
