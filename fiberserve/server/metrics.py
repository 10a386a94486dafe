"""Prometheus metrics (prometheus-client), one registry per app.

Counters and histograms are updated as requests end; gauges that mirror the
engine's state (queue, pages, fibers) are read at scrape time by a collector,
so they are never stale.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fiberserve.engine.sequence import Sequence

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, state) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "fiberserve_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("fiberserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("fiberserve_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("fiberserve_sequences_finished", "Finished sequences by reason", ["reason"], registry=r)
        self.ttft = Histogram(
            "fiberserve_time_to_first_token_seconds", "Time to first token", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.tpot = Histogram(
            "fiberserve_time_per_output_token_seconds",
            "Time per output token after the first",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "fiberserve_e2e_request_latency_seconds", "Arrival to finish", registry=r, buckets=_LATENCY_BUCKETS
        )
        r.register(_EngineCollector(state))

    def observe_sequence(self, seq: Sequence) -> None:
        self.generation_tokens.inc(len(seq.output_ids))
        self.finished.labels(seq.finish_reason.value if seq.finish_reason else "unknown").inc()
        if seq.output.first_token_time is not None:
            self.ttft.observe(seq.output.first_token_time - seq.arrival)
            if seq.output.finish_time and len(seq.output_ids) > 1:
                self.tpot.observe((seq.output.finish_time - seq.output.first_token_time) / (len(seq.output_ids) - 1))
        if seq.output.finish_time:
            self.e2e.observe(seq.output.finish_time - seq.arrival)


class _EngineCollector:
    def __init__(self, state) -> None:
        self.state = state

    def describe(self):
        return []

    def collect(self):
        service = self.state.service
        if service is None:
            return
        sched, pages = service.scheduler, service.pages

        def gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None):
            g = GaugeMetricFamily(name, doc, labels=list(labels) if labels else None)
            g.add_metric(list(labels.values()) if labels else [], value)
            return g

        yield gauge("fiberserve_queue_depth", "Sequences waiting for admission", len(sched.waiting))
        yield gauge("fiberserve_running_sequences", "Sequences admitted and running", len(sched.running))
        kv = GaugeMetricFamily("fiberserve_kv_pages", "KV cache pages by state", labels=["state"])
        kv.add_metric(["free"], pages.free_pages)
        kv.add_metric(["used"], pages.used_pages)
        kv.add_metric(["cached"], pages.cached_pages)
        yield kv
        quarantined = GaugeMetricFamily(
            "fiberserve_kv_pages_quarantined",
            "KV pages (counted in use) held for a timed-out model call that has not returned, by its fiber",
            labels=["fiber"],
        )
        for fiber, count in pages.quarantined.items():
            quarantined.add_metric([fiber], count)
        yield quarantined
        yield gauge(
            "fiberserve_prefix_cache_hit_rate",
            "Admissions that reused cached prefix pages",
            pages.hits / pages.queries if pages.queries else 0.0,
        )
        yield CounterMetricFamily(
            "fiberserve_spec_decode_draft_tokens",
            "Draft tokens computed (speculative decoding)",
            sched.speculation.draft_tokens,
        )
        yield CounterMetricFamily(
            "fiberserve_spec_decode_accepted_tokens",
            "Draft tokens kept (speculative decoding)",
            sched.speculation.accepted_tokens,
        )
        if service.pool is not None:
            s = service.pool.stats()
            fibers = GaugeMetricFamily("fiberserve_fibers", "Fibers by state per pool", labels=["pool", "state"])
            fibers.add_metric([service.pool.name, "idle"], s.idle)
            fibers.add_metric([service.pool.name, "busy"], s.busy)
            yield fibers
            yield gauge(
                "fiberserve_fiber_waiters", "Flights waiting for a fiber", s.waiters, {"pool": service.pool.name}
            )
            yield gauge(
                "fiberserve_fiber_acquire_wait_seconds_total",
                "Total time spent waiting for a fiber",
                s.total_wait_s,
                {"pool": service.pool.name},
            )
            yield gauge(
                "fiberserve_fiber_acquire_wait_seconds_max",
                "Longest wait for a fiber",
                s.max_wait_s,
                {"pool": service.pool.name},
            )
            yield gauge(
                "fiberserve_fiber_acquisitions", "Fiber acquisitions", s.acquisitions, {"pool": service.pool.name}
            )
