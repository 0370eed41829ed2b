"""`/metrics`: Prometheus metrics through `prometheus-client`, in a registry of the server's own.

Three sources, each measured where it happens:

- histograms of each engine request (time to first token, inter-token latency, end-to-end
  latency, queue time, prompt and output lengths), observed from its `RequestReport` when its
  scope closes;
- counters of HTTP requests by route and finish reason and of rejections by reason, counted by
  `Tracing` when each request ends;
- gauges and engine counters (running, waiting, active, KV pages, tokens, prefix cache,
  preemptions), read from the engine at scrape time by `EngineCollector`.

Every series is prefixed `ft_` and labelled with the served model's name; in router mode
(`ft.server.models`) each loaded model's engine gauges are one sample per `model` label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ft.engine.engine import Engine
from ft.engine.stats import RequestReport
from ft.server.edge.tracing import RequestRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
)
ITL_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class EngineCollector(Collector):
    """The engines' gauges and counters, read from their snapshots at each scrape: one family
    per metric, one sample per engine (labelled with its model)."""

    def __init__(self, engines: Callable[[], Iterable[Engine]]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for engine in list(self.engines()):
            for family in self._collect_one(engine):
                known = families.setdefault(family.name, family)
                if known is not family:
                    known.samples.extend(family.samples)
        yield from families.values()

    def _collect_one(self, engine: Engine) -> Iterator[Metric]:
        snap = engine.snapshot()
        model = snap.model.id
        req, kv, sched, spec = snap.requests, snap.kv, snap.scheduler, snap.speculative

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model"])
            family.add_metric([model], value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model"])
            family.add_metric([model], value)
            return family

        info = GaugeMetricFamily(
            "ft_info", "The serving instance and its engine state.", labels=["model", "instance_id", "state"]
        )
        info.add_metric([model, snap.instance_id, str(snap.state)], 1)
        yield info
        yield gauge("ft_requests_running", "Requests decoding in the running batch.", req.running)
        yield gauge("ft_requests_waiting", "Requests tokenizing or queued for a slot.", req.waiting)
        yield gauge(
            "ft_requests_sending",
            "Requests the engine is done with, their output still sending.",
            req.sending,
        )
        yield gauge(
            "ft_requests_preparing",
            "Admitted requests not yet queued (tokenizing, compiling).",
            req.preparing,
        )
        yield gauge(
            "ft_requests_active", "Requests with an open scope (running + waiting + sending).", req.active
        )
        yield gauge("ft_kv_used_pages", "KV cache pages held by requests.", kv.used_pages)
        yield gauge("ft_kv_total_pages", "KV cache pages in the pool.", kv.total_pages)
        yield gauge("ft_kv_cached_pages", "Free KV pages kept for prefix reuse.", kv.cached_pages)
        yield gauge("ft_kv_usage_ratio", "Fraction of the KV pages held by requests.", kv.usage)
        yield counter("ft_prompt_tokens", "Prompt tokens of finished requests.", req.prompt_tokens_total)
        yield counter(
            "ft_generation_tokens", "Output tokens of finished requests.", req.completion_tokens_total
        )
        yield counter(
            "ft_prefix_cache_queries", "Tokens looked up in the prefix cache.", sched.prefix_query_tokens
        )
        yield counter("ft_prefix_cache_hits", "Tokens the prefix cache supplied.", sched.prefix_hit_tokens)
        tiers = snap.prompt_cache
        ram, disk = tiers.ram, tiers.disk

        def per_tier(
            family: GaugeMetricFamily | CounterMetricFamily, ram_value: float, disk_value: float
        ) -> Metric:
            family.add_metric([model, "ram"], ram_value)
            if disk.enabled:
                family.add_metric([model, "disk"], disk_value)
            return family

        labels = ["model", "tier"]
        yield per_tier(
            CounterMetricFamily(
                "ft_prompt_cache_hit_tokens", "Prompt tokens each cache tier supplied.", labels=labels
            ),
            ram.hit_tokens,
            disk.hit_tokens,
        )
        yield per_tier(
            GaugeMetricFamily("ft_prompt_cache_bytes", "Bytes each cache tier holds now.", labels=labels),
            ram.bytes,
            disk.bytes,
        )
        if disk.enabled:
            yield gauge("ft_prompt_cache_disk_files", "Page files in --prompt-cache-dir.", disk.files)
            yield gauge("ft_prompt_cache_disk_max_bytes", "The bound of --prompt-cache-dir.", disk.max_bytes)
            yield counter("ft_prompt_cache_disk_hits", "Pages read back from disk.", disk.hits)
            yield counter("ft_prompt_cache_disk_misses", "Page reads that found no valid file.", disk.misses)
            yield counter("ft_prompt_cache_disk_read_bytes", "Bytes read from disk.", disk.bytes_read)
            yield counter("ft_prompt_cache_disk_written_bytes", "Bytes written to disk.", disk.bytes_written)
            yield counter("ft_prompt_cache_disk_writes", "Page files written.", disk.writes)
            yield counter(
                "ft_prompt_cache_disk_dropped", "Pages not written: the writer was busy.", disk.dropped
            )
            yield counter("ft_prompt_cache_disk_write_errors", "Page writes that failed.", disk.write_errors)
            yield counter(
                "ft_prompt_cache_disk_corrupt", "Page files that did not check out (deleted).", disk.corrupt
            )
            yield counter(
                "ft_prompt_cache_disk_evicted", "Page files deleted to stay within the bound.", disk.evicted
            )
        state = snap.recurrent_state
        if state.slots:  # a model with recurrent layers
            yield gauge("ft_state_slots", "Recurrent state slots (running + snapshots).", state.slots)
            yield gauge("ft_state_slots_in_use", "State slots held by running sequences.", state.in_use)
            yield gauge("ft_state_snapshots", "State snapshots held for prefix reuse.", state.snapshots)
            yield counter(
                "ft_state_snapshot_hits", "Prefix-cache hits that restored a snapshot.", state.snapshot_hits
            )
            yield counter("ft_state_snapshots_taken", "State snapshots taken.", state.snapshots_taken)
        yield counter("ft_preemptions", "Requests preempted to free KV pages.", sched.preemptions)
        yield counter("ft_recomputed_tokens", "Tokens recomputed after preemptions.", sched.recomputed_tokens)
        yield counter(
            "ft_spec_decode_draft_tokens", "Tokens drafted for speculative decoding.", spec.draft_tokens
        )
        yield counter(
            "ft_spec_decode_accepted_tokens", "Drafted tokens the model accepted.", spec.accepted_tokens
        )
        yield counter(
            "ft_spec_decode_verifications",
            "Decode steps of a sequence that verified drafts.",
            spec.verifications,
        )
        yield gauge(
            "ft_spec_decode_acceptance_ratio",
            "Accepted over drafted tokens since the start.",
            spec.acceptance_rate,
        )
        yield gauge(
            "ft_spec_decode_mean_accepted_length",
            "Tokens one verification gave on average (accepted drafts + 1).",
            spec.mean_accepted_length,
        )


class ServerMetrics:
    """The server's Prometheus registry and the metrics it observes from events."""

    def __init__(self, engines: Callable[[], Iterable[Engine]], default_model: str) -> None:
        self.engines = engines
        self.default_model = default_model  # the label of HTTP requests that named no model
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "ft_time_to_first_token_seconds",
            "From a request's arrival in the engine to its first output token.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "ft_inter_token_latency_seconds",
            "Between two steps that gave a request output tokens.",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "ft_e2e_request_latency_seconds",
            "From a request's arrival in the engine to the end of its scope.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "ft_request_queue_time_seconds",
            "From a request's arrival in the engine to its first scheduled step.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_len = Histogram(
            "ft_request_prompt_tokens",
            "Prompt tokens per request.",
            ["model"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.output_len = Histogram(
            "ft_request_generation_tokens",
            "Output tokens per request.",
            ["model"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "ft_requests",
            "Generation requests that ran, by route and finish reason.",
            ["model", "route", "finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "ft_requests_rejected",
            "Requests refused before they ran, by reason.",
            ["model", "reason"],
            registry=r,
        )
        r.register(EngineCollector(engines))

    def watch(self, engine: Engine) -> None:
        """Observe each request `engine` closes (its model labels them)."""
        engine.stats.observers.append(lambda report: self.observe_engine_request(report, engine.model_id))

    def observe_engine_request(self, report: RequestReport, model: str) -> None:
        """Observe one closed engine request's latencies and lengths (synchronous)."""
        self.e2e.labels(model).observe(report.e2e_s)
        if report.queue_s is not None:
            self.queue.labels(model).observe(report.queue_s)
        if report.ttft_s is not None:
            self.ttft.labels(model).observe(report.ttft_s)
        itl = self.itl.labels(model)
        for gap in report.token_gaps_s:
            itl.observe(gap)
        if report.num_prompt_tokens:
            self.prompt_len.labels(model).observe(report.num_prompt_tokens)
        if report.outcome == "completed":
            self.output_len.labels(model).observe(report.num_output_tokens)

    def observe_http_request(self, record: RequestRecord) -> None:
        """Count one ended HTTP request: a generation by finish reason, or a refused API call
        (a POST: probes and scrapes that get 503 are not rejections)."""
        model = record.model or self.default_model
        rejection = record.rejection
        if rejection is not None:
            if record.method == "POST":
                self.rejected.labels(model, rejection).inc()
        elif record.route is not None and record.finish_reason is not None:
            self.requests.labels(model, record.route, record.finish_reason).inc()

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)
