"""The records behind the serving metrics, split by who can observe them.

- `SchedulerStats` is made by the engine core after each step: only the core sees its queues, its KV cache and
  its step time. It travels to the front end inside the step's message (so it must stay small and picklable).
- `IterationStats` is made by the front end from the same message's outputs: token counts, and the latencies a
  client feels — time to first token, time between tokens — which must be measured where the client's request
  arrived and where its tokens leave, not inside the core.
- `RequestStateStats` is the front end's clock for one request between messages.

Counts here are per message ("in this step"); the Prometheus logger adds them up into counters.

Where this lives in vLLM: `vllm/v1/metrics/stats.py` (`SchedulerStats`, `IterationStats`, `RequestStateStats`).
"""

from dataclasses import dataclass, field

from solutions.outputs import RequestOutput


@dataclass(slots=True)
class SchedulerStats:
    """The engine core's state after one step (or between steps, when `step_seconds` is None)."""

    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences queued (new or preempted)
    kv_cache_usage: float  # fraction of the KV blocks in use, 0..1 (cached free blocks count as free)
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache since the last report
    prefix_cache_hits: int  # of those, tokens found cached
    num_preemptions: int  # sequences preempted in this step
    step_seconds: float | None  # wall time of `engine.step()`; None for a report made between steps


@dataclass(slots=True)
class RequestStateStats:
    """One request's timestamps (`time.monotonic()`), from its arrival in `generate` to its latest token."""

    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass(slots=True)
class IterationStats:
    """What the front end saw in one message from the core: tokens, and the latencies they imply."""

    num_prompt_tokens: int = 0  # prompts of the requests that got their first token in this message
    num_generation_tokens: int = 0  # tokens generated in this message, every request and sample
    time_to_first_tokens: list[float] = field(default_factory=list)  # seconds, one per request started here
    inter_token_latencies: list[float] = field(default_factory=list)  # seconds since that request's last tokens
    transfer_seconds: float = 0.0  # from the core putting the message on its queue to the front end reading it

    def update_from_output(self, output: RequestOutput, request_stats: RequestStateStats, now: float) -> None:
        """Count `output`'s tokens and time them against its request's clock (which is advanced)."""
        num_new_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        if num_new_tokens == 0:
            return  # e.g. only a finish reason: no token, no latency
        self.num_generation_tokens += num_new_tokens
        if request_stats.first_token_time is None:
            request_stats.first_token_time = now
            self.num_prompt_tokens += len(output.prompt_token_ids)
            self.time_to_first_tokens.append(now - request_stats.arrival_time)
        else:
            self.inter_token_latencies.append(now - request_stats.last_token_time)
        request_stats.last_token_time = now
