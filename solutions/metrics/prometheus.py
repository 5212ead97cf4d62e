"""Serving metrics in Prometheus's text format, under vLLM v1's names, for the server's `/metrics`.

Three kinds of metric, as Prometheus defines them:
- gauges hold the latest value: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc` (a fraction 0..1, as in vLLM v1, despite the name);
- counters only grow (the exposition adds `_total`): `vllm:prompt_tokens`, `vllm:generation_tokens`,
  `vllm:prefix_cache_queries`, `vllm:prefix_cache_hits` (both in tokens), `vllm:num_preemptions`;
  a rate (tokens/s, hit rate) is computed by whoever scrapes them, from two scrapes;
- histograms count observations per bucket, so percentiles can be estimated later:
  `vllm:time_to_first_token_seconds` (arrival in `generate` → first token) and
  `vllm:inter_token_latency_seconds` (between one request's consecutive outputs).

Every metric carries a `model_name` label, as vLLM's do. The logger owns its own `CollectorRegistry`, not
`prometheus_client`'s global one: two engines in one process (tests, a benchmark) keep separate books.

Where this lives in vLLM: `vllm/v1/metrics/loggers.py` (`PrometheusStatLogger`).
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from solutions.metrics.stats import IterationStats, SchedulerStats

# Bucket upper bounds in seconds. On 2 CPU cores a step takes tens of milliseconds and a first token under load
# can take many seconds, so both ranges reach far further than a GPU server would need.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)


class PrometheusStatLogger:
    """Turns the core's `SchedulerStats` and the front end's `IterationStats` into Prometheus metrics.

    `record` is called from the front end's output thread; `render` from the server's event loop.
    `prometheus_client` metrics are thread-safe, so the two need no lock of ours.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = dict(labelnames=["model_name"], registry=self.registry)

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, **labels).labels(model_name)

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, **labels).labels(model_name)

        self.num_requests_running = gauge("vllm:num_requests_running", "Sequences in the running batch.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of the KV blocks in use (1 = full).")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("vllm:num_preemptions", "Sequences preempted (by recompute).")
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

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        """Add one message's statistics (either may be None: a message with nothing of that kind)."""
        if scheduler_stats is not None:
            self.num_requests_running.set(scheduler_stats.num_running)
            self.num_requests_waiting.set(scheduler_stats.num_waiting)
            self.kv_cache_usage.set(scheduler_stats.kv_cache_usage)
            self.prefix_cache_queries.inc(scheduler_stats.prefix_cache_queries)
            self.prefix_cache_hits.inc(scheduler_stats.prefix_cache_hits)
            self.num_preemptions.inc(scheduler_stats.num_preemptions)
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
