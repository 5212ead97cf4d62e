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

from dataclasses import dataclass, field, fields

from solutions.outputs import RequestOutput


# where a step's time goes (postprocess: update_from_output)
STEP_STAGES = ("schedule", "prepare", "forward", "sample", "postprocess")


@dataclass(slots=True)
class SchedulerStats:
    """The engine core's state after one step (or between steps: then `seconds` is empty). The one record of
    what a step did: the terminal table, `/metrics`, the benchmarks and the chapters' timelines all read it."""

    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences queued (new or preempted)
    num_blocks_used: int  # KV blocks held by sequences (cached free blocks count as free)
    kv_cache_usage: float  # num_blocks_used / the pool's blocks, 0..1
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache since the last report
    prefix_cache_hits: int  # of those, tokens found cached
    num_preemptions: int = 0  # sequences preempted in this step
    num_scheduled_seqs: int = 0  # the step's batch size
    num_prefill_tokens: int = 0  # scheduled tokens catching up with a prompt (or a recompute)
    num_decode_tokens: int = 0  # scheduled tokens that are a sequence's newest, sampled token (or its drafts)
    num_cached_tokens: int = 0  # found in the prefix cache by the sequences admitted in this step
    num_drafts: int = 0  # speculative decoding: sequences whose drafts were verified in this step
    num_draft_tokens: int = 0  # their draft tokens
    num_accepted_tokens: int = 0  # of those, accepted (vLLM's spec_decode num_accepted_tokens)
    # position j (0-based): drafts whose token j was accepted (a draft is accepted up to its first rejection)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # chapter 11: sequences swapped out now (their blocks in host memory); of this step's preemptions, those by
    # swapping; blocks copied to and from the swap pool in this step
    num_swapped: int = 0
    num_swapped_out: int = 0
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    # the prefix cache's host tier since the last report, in tokens: looked up past the device's hits, found there
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    num_dead_replicas: int = 0  # data parallelism: replicas whose process died (their sequences were requeued)
    seconds: dict[str, float] = field(default_factory=dict)  # per stage of STEP_STAGES

    @property
    def step_seconds(self) -> float | None:
        """Wall time of the step; None for a report made between steps."""
        return sum(self.seconds.values()) if self.seconds else None


@dataclass
class EngineStats:
    """A stat logger that keeps every step's `SchedulerStats` and a few totals: `LLMEngine.stats`."""

    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_drafts: int = 0  # speculative decoding, over every step: sequences' drafts verified,
    num_draft_tokens: int = 0  # their tokens,
    num_accepted_tokens: int = 0  # those accepted,
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # and those accepted per position
    num_preemptions: int = 0  # sequences preempted, by either mode,
    num_swapped_out: int = 0  # of them by swapping (chapter 11), and the blocks swapped out and in
    num_blocks_swapped_out: int = 0
    num_blocks_swapped_in: int = 0
    # prompt tokens found on the device, and in the host tier (chapter 11), per lookup: a request that waits for
    # memory is looked up again at each step it tries (as vLLM counts its prefix-cache queries)
    prefix_cache_hits: int = 0
    external_prefix_cache_hits: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # sequences per step
    peak_blocks_used: int = 0
    steps: list[SchedulerStats] = field(default_factory=list)

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: "IterationStats | None" = None) -> None:
        if scheduler_stats is None or not scheduler_stats.seconds:
            return  # a refusal, or a report between steps
        self.num_steps += 1
        for f in fields(self):  # the counts a step's record has too: summed over the steps
            total = getattr(self, f.name)
            if isinstance(total, int) and hasattr(scheduler_stats, f.name):
                setattr(self, f.name, total + getattr(scheduler_stats, f.name))
        self.num_accepted_tokens_per_pos = add_per_pos(self.num_accepted_tokens_per_pos,
                                                       scheduler_stats.num_accepted_tokens_per_pos)
        self.batch_sizes.append(scheduler_stats.num_scheduled_seqs)
        self.peak_blocks_used = max(self.peak_blocks_used, scheduler_stats.num_blocks_used)
        self.steps.append(scheduler_stats)

    def spec_decoding_summary(self) -> str | None:
        """vLLM's spec-decoding log line over every step: mean acceptance length (the bonus token included),
        acceptance rate, and per position the fraction of drafts accepted that far; None if nothing was drafted."""
        if self.num_drafts == 0:
            return None
        per_pos = ", ".join(f"{n / self.num_drafts:.2f}" for n in self.num_accepted_tokens_per_pos)
        return (
            f"mean acceptance length {1 + self.num_accepted_tokens / self.num_drafts:.2f}, acceptance rate "
            f"{self.num_accepted_tokens / self.num_draft_tokens:.1%} ({self.num_accepted_tokens} of "
            f"{self.num_draft_tokens} draft tokens), per position {per_pos}"
        )


def add_per_pos(total: list[int], step: list[int]) -> list[int]:
    """Two per-position counts added position by position (the shorter one counts 0 past its end)."""
    longer, shorter = (total, step) if len(total) >= len(step) else (step, total)
    return [n + (shorter[j] if j < len(shorter) else 0) for j, n in enumerate(longer)]


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
