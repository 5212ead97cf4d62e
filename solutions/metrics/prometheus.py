"""Serving metrics in Prometheus's text format, under vLLM v1's names, for the server's `/metrics`.

- gauges (the latest value): `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
  (a fraction 0..1, as in vLLM v1), `vllm:num_requests_swapped` (vLLM v0's, chapter 11), `vllm:num_dead_replicas`
  (ours: data-parallel replicas whose process died);
- counters (exposed with `_total`; rates come from two scrapes): `vllm:prompt_tokens`, `vllm:generation_tokens`,
  `vllm:prefix_cache_queries`, `vllm:prefix_cache_hits` (in tokens), `vllm:num_preemptions`, and the host tier's
  `vllm:external_prefix_cache_queries`, `vllm:external_prefix_cache_hits` (chapter 11);
- histograms: `vllm:time_to_first_token_seconds` (arrival → first token), `vllm:inter_token_latency_seconds`.

With speculative decoding on (only then, as in vLLM): `vllm:spec_decode_num_drafts`,
`vllm:spec_decode_num_draft_tokens`, `vllm:spec_decode_num_accepted_tokens` and
`vllm:spec_decode_num_accepted_tokens_per_pos` (label `position`). Acceptance rate: accepted / draft tokens; mean
acceptance length: 1 + accepted / drafts.

Every metric carries a `model_name` label. The logger owns its `CollectorRegistry`, not `prometheus_client`'s
global one, so two engines in one process keep separate books.

Where this lives in vLLM: `vllm/v1/metrics/loggers.py` (`PrometheusStatLogger`) and
`vllm/v1/spec_decode/metrics.py` (`SpecDecodingProm`).
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from solutions.config import SpeculativeConfig
from solutions.metrics.stats import IterationStats, SchedulerStats

# Bucket upper bounds in seconds. On 2 CPU cores a step takes tens of milliseconds and a first token under load
# can take many seconds, so both ranges reach far further than a GPU server would need.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
# The metrics a `SchedulerStats` sets: (name, kind, help, the field it reads)
SCHEDULER_METRICS = (
    ("vllm:num_requests_running", Gauge, "Sequences in the running batch.", "num_running"),
    ("vllm:num_requests_waiting", Gauge, "Sequences waiting to be scheduled.", "num_waiting"),
    ("vllm:kv_cache_usage_perc", Gauge, "Fraction of the KV blocks in use (1 = full).", "kv_cache_usage"),
    ("vllm:prefix_cache_queries", Counter, "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", Counter, "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("vllm:num_preemptions", Counter, "Sequences preempted (by recompute or swapping).", "num_preemptions"),
    ("vllm:num_requests_swapped", Gauge, "Sequences swapped out to host memory.", "num_swapped"),
    ("vllm:num_dead_replicas", Gauge, "Data-parallel replicas whose process died (their requests run on the others).",
     "num_dead_replicas"),
    ("vllm:external_prefix_cache_queries", Counter,
     "Prompt tokens looked up in the host tier (past the device's hits).", "external_prefix_cache_queries"),
    ("vllm:external_prefix_cache_hits", Counter, "Prompt tokens found in the host tier and loaded back.",
     "external_prefix_cache_hits"),
)


class PrometheusStatLogger:
    """Turns the core's `SchedulerStats` and the front end's `IterationStats` into Prometheus metrics.

    `record` is called from the front end's output thread; `render` from the server's event loop.
    `prometheus_client` metrics are thread-safe, so the two need no lock of ours.
    """

    def __init__(self, model_name: str, speculative_config: SpeculativeConfig | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = dict(labelnames=["model_name"], registry=self.registry)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, **labels).labels(model_name)

        # each scheduler metric's update: a gauge's `set`, a counter's `inc`, with its `SchedulerStats` field
        self.scheduler_updates = []
        for name, kind, documentation, stats_field in SCHEDULER_METRICS:
            metric = kind(name, documentation, **labels).labels(model_name)
            self.scheduler_updates.append((metric.set if kind is Gauge else metric.inc, stats_field))
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests that produced a first token.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Seconds from a request's arrival to its first token.",
            buckets=TTFT_BUCKETS, **labels,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Seconds between a request's consecutive outputs.",
            buckets=ITL_BUCKETS, **labels,
        ).labels(model_name)
        self.spec_decoding = None if speculative_config is None else SpecDecodingProm(
            self.registry, model_name, speculative_config.num_speculative_tokens
        )

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        """Add one message's statistics (either may be None: a message with nothing of that kind)."""
        if scheduler_stats is not None:
            for update, stats_field in self.scheduler_updates:
                update(getattr(scheduler_stats, stats_field))
            if self.spec_decoding is not None:
                self.spec_decoding.observe(scheduler_stats)
        if iteration_stats is not None:
            self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
            self.generation_tokens.inc(iteration_stats.num_generation_tokens)
            for seconds in iteration_stats.time_to_first_tokens:
                self.time_to_first_token.observe(seconds)
            for seconds in iteration_stats.inter_token_latencies:
                self.inter_token_latency.observe(seconds)

    def render(self) -> bytes:
        """The registry in Prometheus's text exposition format (serve it as `prometheus_client.CONTENT_TYPE_LATEST`)."""
        return generate_latest(self.registry)


class SpecDecodingProm:
    """Speculative decoding's counters, under vLLM's names: registered only when speculation is on, so a
    scrape shows whether it is. One per-position counter for each draft position the config allows."""

    def __init__(self, registry: CollectorRegistry, model_name: str, num_speculative_tokens: int) -> None:
        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, labelnames=["model_name"], registry=registry).labels(model_name)

        self.num_drafts = counter("vllm:spec_decode_num_drafts", "Sequences' drafts verified.")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Drafts accepted at least up to this position.",
            labelnames=["model_name", "position"], registry=registry,
        )
        self.num_accepted_tokens_per_pos = [per_pos.labels(model_name, str(j)) for j in range(num_speculative_tokens)]

    def observe(self, scheduler_stats: SchedulerStats) -> None:
        self.num_drafts.inc(scheduler_stats.num_drafts)
        self.num_draft_tokens.inc(scheduler_stats.num_draft_tokens)
        self.num_accepted_tokens.inc(scheduler_stats.num_accepted_tokens)
        per_pos = zip(self.num_accepted_tokens_per_pos, scheduler_stats.num_accepted_tokens_per_pos, strict=False)
        for counter, num_accepted in per_pos:  # a step's list stops at its longest draft
            counter.inc(num_accepted)
