"""Ray metrics the extractor actors emit; Ray exports them (prefixed `ray_`) on its metrics endpoint,
where Prometheus and the dashboard's Grafana panels pick them up."""

from __future__ import annotations


class ExtractorMetrics:
    def __init__(self):
        from ray.util.metrics import Counter, Histogram

        self.samples = Counter(
            "harvest_samples", "Samples handled by extractor actors, by final status.", tag_keys=("status",)
        )
        self.tokens = Counter("harvest_tokens", "Tokens of samples committed to shards.")
        self.bytes = Counter("harvest_bytes_written", "Exact bytes of committed shards.")
        self.latency = Histogram(
            "harvest_request_latency_seconds",
            "Latency of one capture request to the engine (queueing included).",
            boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120],
        )

    def record(self, rows: list[dict]) -> None:
        for r in rows:
            self.samples.inc(1, tags={"status": r["status"]})
            if r["status"] == "ok":
                self.tokens.inc(r["num_tokens"])
                if r["latency_s"] > 0:
                    self.latency.observe(r["latency_s"])
        total = sum(r["bytes"] for r in rows)
        if total:
            self.bytes.inc(total)
