"""Serving metrics: what the engine core reports per step, what the front end measures per request, and the
Prometheus exposition of both under vLLM v1's metric names (`vllm/v1/metrics/`)."""

from solutions.metrics.prometheus import PrometheusStatLogger
from solutions.metrics.stats import IterationStats, RequestStateStats, SchedulerStats

__all__ = ["IterationStats", "PrometheusStatLogger", "RequestStateStats", "SchedulerStats"]
