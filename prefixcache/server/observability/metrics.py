"""Prometheus metrics at ``GET /metrics``, named in vLLM's style (``prefixcache:...``).

Counters and gauges the engine already keeps (tokens, cache queries and hits, queue lengths,
KV usage, evictions, preemptions) are read from ``engine.engine_stats()`` at scrape time by a
collector, so they can never drift from the engine's own numbers. Latency histograms are
observed here, once per finished request, from the timestamps the engine put on it.

Each server owns its registry (not the process-global one), so several apps can live in one
process (tests) without "duplicated timeseries" errors.

``/metrics`` is open by default, as vLLM's is; it shows aggregate traffic of every tenant (no
per-tenant labels). ``--metrics-key`` makes it require that key or an admin key.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from prefixcache.api.request import StreamDelta

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0)  # fmt: skip

# (metric name without "_total", EngineStats attribute, help)
_COUNTERS = (
    ("prefixcache:prompt_tokens", "prompt_tokens_total", "Prefill tokens processed (requested)."),
    ("prefixcache:generation_tokens", "generation_tokens_total", "Generated tokens."),
    (
        "prefixcache:prefix_cache_queries",
        "prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache.",
    ),
    (
        "prefixcache:prefix_cache_hits",
        "prefix_cache_hits_total",
        "Prompt tokens served from the prefix cache.",
    ),
    (
        "prefixcache:prefix_cache_evicted_blocks",
        "evicted_blocks_total",
        "Cached blocks evicted to make room.",
    ),
    ("prefixcache:num_preemptions", "num_preemptions_total", "Requests preempted."),
    (
        "prefixcache:num_fairness_preemptions",
        "num_fairness_preemptions_total",
        "Requests preempted to give a tenant under its fair share a slot.",
    ),
    (
        "prefixcache:num_shared_steps",
        "num_shared_steps_total",
        "Steps shortened to --shared-step-ms because several tenants were active.",
    ),
)
_GAUGES = (
    ("prefixcache:num_requests_running", "num_running", "Requests in the running batch."),
    ("prefixcache:num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    (
        "prefixcache:kv_cache_usage_perc",
        "kv_cache_usage",
        "Share of KV blocks held by live requests (0..1); unreferenced cached blocks count as free.",
    ),
)

# Per persistent tier (label "tier": disk, redis): (name without "_total", TierStats attribute, help)
_TIER_COUNTERS = (
    ("prefixcache:tier_hit_tokens", "hit_tokens", "Prompt tokens restored from the tier."),
    ("prefixcache:tier_miss_blocks", "miss_blocks", "Blocks looked up in the tier and missing."),
    ("prefixcache:tier_read_bytes", "read_bytes", "Bytes read from the tier (verified blocks)."),
    ("prefixcache:tier_written_blocks", "written_blocks", "Blocks written to the tier."),
    ("prefixcache:tier_written_bytes", "written_bytes", "Bytes written to the tier."),
    (
        "prefixcache:tier_rejected_blocks",
        "rejected_blocks",
        "Blocks found corrupt, forged (MAC), truncated or foreign: removed, never served.",
    ),
    (
        "prefixcache:tier_dropped_writes",
        "dropped_writes",
        "Blocks not written (queue full, tier off or unreachable).",
    ),
    ("prefixcache:tier_errors", "errors", "I/O or connection errors of the tier."),
    (
        "prefixcache:tier_oversize_writes",
        "oversize_writes",
        "Records not sent: larger than the tier's record size cap (Redis).",
    ),
    ("prefixcache:tier_restores", "restores", "Restore reads from the tier."),
    ("prefixcache:tier_expired", "expired", "Records removed when their retention ran out."),
    ("prefixcache:tier_restore_seconds", "restore_seconds_total", "Time spent in restore reads."),
    ("prefixcache:tier_reconnects", "reconnects", "Times the tier came back after a failure."),
    (
        "prefixcache:tier_segment_hit_tokens",
        "segment_hit_tokens",
        "Tokens of segments (cache_mode segments) restored from the tier.",
    ),
    ("prefixcache:tier_segment_written", "segment_written", "Segments written to the tier."),
    (
        "prefixcache:tier_skipped_slow",
        "skipped_slow",
        "Restores that skipped the tier: measured slower than prefilling.",
    ),
)
_TIER_GAUGES = (
    ("prefixcache:tier_enabled", "enabled", "1 unless the tier paused its writes (disk full...)."),
    ("prefixcache:tier_available", "available", "1 when the tier is reachable now."),
    ("prefixcache:tier_stored_bytes", "stored_bytes", "Bytes the tier holds (disk only)."),
)


def _tier_families(model: str, tiers):
    for name, attr, doc in _TIER_COUNTERS:
        m = CounterMetricFamily(name, doc, labels=["model_name", "tier"])
        for t in tiers:
            m.add_metric([model, t.name], float(getattr(t, attr)))
        yield m
    for name, attr, doc in _TIER_GAUGES:
        m = GaugeMetricFamily(name, doc, labels=["model_name", "tier"])
        for t in tiers:
            value = getattr(t, attr)
            if value is not None:
                m.add_metric([model, t.name], float(value))
        yield m


class _EngineCollector:
    def __init__(self, engine, model_name: str, request_log=None) -> None:
        self._engine = engine
        self._model = model_name
        self._request_log = request_log

    def describe(self):
        return []  # collected lazily: nothing to check at registration

    def collect(self):
        stats = self._engine.engine_stats()
        for name, attr, doc in _COUNTERS:
            m = CounterMetricFamily(name, doc, labels=["model_name"])
            m.add_metric([self._model], float(getattr(stats, attr)))
            yield m
        for name, attr, doc in _GAUGES:
            m = GaugeMetricFamily(name, doc, labels=["model_name"])
            m.add_metric([self._model], float(getattr(stats, attr)))
            yield m
        if stats.tiers:
            yield from _tier_families(self._model, stats.tiers)
        extra = [
            ("prefixcache:slow_consumers", "Streams cancelled because the reader fell behind.",
             self._engine.slow_consumers_total),
        ]  # fmt: skip
        if self._request_log is not None:
            extra += [
                ("prefixcache:request_log_errors", "Request-log lines that failed to write.",
                 self._request_log.errors_total),
                ("prefixcache:request_log_dropped", "Request-log lines dropped (queue full).",
                 self._request_log.dropped_total),
            ]  # fmt: skip
        for name, doc, value in extra:
            m = CounterMetricFamily(name, doc, labels=["model_name"])
            m.add_metric([self._model], float(value))
            yield m


class ServerMetrics:
    def __init__(self, engine, model_name: str, request_log=None) -> None:
        disable_created_metrics()  # no "_created" series, as in vLLM
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name, request_log))
        labels = ["model_name"]
        self.ttft = Histogram(
            "prefixcache:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "prefixcache:time_per_output_token_seconds",
            "Time per output token after the first.",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "prefixcache:e2e_request_latency_seconds",
            "Arrival to last token.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            "prefixcache:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )

    def observe_finished(self, delta: StreamDelta) -> None:
        """Record one finished engine request (one choice) from its final delta."""
        m = delta.metrics
        label = self.model_name
        if m.first_token_time is not None:
            self.ttft.labels(label).observe(max(0.0, m.first_token_time - m.arrival_time))
            if m.finished_time is not None and delta.num_output_tokens > 1:
                per_token = (m.finished_time - m.first_token_time) / (delta.num_output_tokens - 1)
                self.tpot.labels(label).observe(max(0.0, per_token))
        if m.finished_time is not None:
            self.e2e.labels(label).observe(max(0.0, m.finished_time - m.arrival_time))
        self.finished.labels(label, delta.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
