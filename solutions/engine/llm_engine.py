"""The engine: requests in, one step at a time, outputs back.

    engine.add_request("r1", "Once upon a time", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for output in engine.step():   # what each request produced in this step
            ...

A step (`engine_step`, at the bottom) is three stages, each owned by one object:
    schedule     Scheduler.schedule()            which sequences compute how many tokens (and what is preempted);
                                                  advances their computed tokens, forks `n > 1` samples
    execute      ModelRunner.execute_model()      one forward pass over the flattened batch → logits
    postprocess  pick the rows of the sequences that sample, mask them by their grammars (structured output),
                 sample, check stops, free the finished, detokenise (OutputProcessor)

Where this lives in vLLM: `vllm/v1/engine/llm_engine.py` (`add_request`, `step`, `abort_request`), with the
engine core's step in `vllm/v1/engine/core.py` (`EngineCore.step`) and `Scheduler.update_from_output`.
"""

import itertools
import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from solutions.baselines.reserving_kv_cache_manager import ReservingKVCacheManager, reservation_policy
from solutions.beam_search import BeamSearchParams, BeamSearchSequence, run_beam_search
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sched.output import SchedulerOutput
from solutions.core.sched.request_queue import SchedulingPolicy
from solutions.core.sched.scheduler import Scheduler
from solutions.core.sched.stop import check_stop
from solutions.core.sequence import Sequence, SequenceStatus
from solutions.engine.output_processor import RequestState
from solutions.engine.processor import Processor, Request
from solutions.model.llama import LlamaForCausalLM
from solutions.outputs import FinishReason, RequestOutput
from solutions.sample.sampler import SamplerOutput, sample
from solutions.sampling_params import SamplingParams
from solutions.structured_output import StructuredOutputGrammar, apply_token_bitmask
from solutions.worker.model_runner import ModelRunner

_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


STEP_STAGES = ("schedule", "prepare", "forward", "sample", "postprocess")  # where a step's time goes


@dataclass
class StepStats:
    """What one step did, for the live display and the chapter's timelines."""

    num_prefill_tokens: int
    num_decode_tokens: int
    num_running: int
    num_waiting: int
    num_blocks_used: int
    num_preempted: int
    num_cached_tokens: int  # found in the prefix cache by the sequences admitted in this step
    seconds: dict[str, float]  # per stage: schedule, prepare, forward, sample, postprocess


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # sequences per step
    peak_blocks_used: int = 0
    steps: list[StepStats] = field(default_factory=list)


class LLMEngine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer: PreTrainedTokenizerBase | None,
        *,
        block_size: int,
        num_kv_blocks: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        long_prefill_token_threshold: int,
        enable_prefix_caching: bool = True,
        scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS,
        attention_backend: str = "torch",
        seed: int = 0,
        enforce_eager: bool = False,
        kv_reservation: str | None = None,
        tensor_parallel_size: int = 1,
        model_name: str | None = None,
        distributed_executor_backend: str = "mp",
        worker_multiproc_method: str = "spawn",
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.block_size, self.max_model_len = block_size, max_model_len
        self.processor = Processor(
            tokenizer, vocab_size=model.config.vocab_size, max_model_len=max_model_len, num_blocks=num_kv_blocks,
            block_size=block_size, seed=seed, max_num_seqs=max_num_seqs, eos_token_id=model.config.eos_token_id,
        )
        self.structured_output_manager = self.processor.structured_output_manager
        self.kv_reservation = kv_reservation  # None: paged; "max" / "pow2" / "oracle": Orca's whole-length admission
        if kv_reservation is None:
            self.kv_cache_manager = KVCacheManager(num_kv_blocks, block_size, enable_prefix_caching)
        else:
            self.kv_cache_manager = ReservingKVCacheManager(
                num_kv_blocks, block_size, enable_prefix_caching, policy=reservation_policy(kv_reservation),
                max_model_len=max_model_len,
            )
        self.scheduler = Scheduler(
            self.kv_cache_manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold, policy=scheduling_policy,
        )
        runner_kwargs = dict(
            num_blocks=num_kv_blocks, block_size=block_size, attention_backend=attention_backend,
            enforce_eager=enforce_eager, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
        )
        if tensor_parallel_size == 1:
            self.model_runner = ModelRunner(model, **runner_kwargs)
        elif distributed_executor_backend == "external_launcher":  # torchrun started every rank's engine
            from solutions.executor.external_launcher import ExecutorWithExternalLauncher

            self.model_runner = ExecutorWithExternalLauncher(model, tensor_parallel_size, runner_kwargs)
        else:  # this process drives worker processes it starts (solutions/executor/multiproc_executor.py)
            from solutions.executor.multiproc_executor import MultiprocExecutor

            self.model_runner = MultiprocExecutor(
                model_name, model, tensor_parallel_size, runner_kwargs, start_method=worker_multiproc_method
            )
        self.requests: dict[str, RequestState] = {}
        self._owner: dict[int, tuple[RequestState, int]] = {}  # seq_id -> (its request, its sample index)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self.stats = EngineStats()
        self._seconds: dict[str, float] = {}  # the current step's seconds per stage: its one timing ledger

    # --- requests in and out ---------------------------------------------------------------------------------

    def process_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> Request:
        """Validate and tokenise one request without queuing it (ValueError, and no change, if it is bad)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        return self.processor.process_inputs(request_id, prompt, params, priority, arrival=next(self._arrivals))

    def add_request(
        self, request_id: str | Request, prompt: str | list[int] | None = None, params: SamplingParams | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request: `add_request(id, prompt, params, priority)`, or a `Request` from `process_request`."""
        request = request_id if isinstance(request_id, Request) else self.process_request(
            request_id, prompt, SamplingParams() if params is None else params, priority
        )
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use by an unfinished request")
        state = RequestState(request, self.tokenizer)
        seq = Sequence(next(self._seq_ids), request.prompt_token_ids, priority=request.priority, arrival=request.arrival)
        seq.fork_seq_ids = [next(self._seq_ids) for _ in range(request.params.n - 1)]  # forked once the prompt is in
        if self.kv_reservation is not None:  # the reservation is sized from the request's max_tokens
            self.kv_cache_manager.reserve(seq, request.params.max_tokens, request.params.n)
        request.seqs.append(seq)
        self.requests[request.request_id] = state
        self._owner[seq.seq_id] = (state, 0)
        self.scheduler.add_seq(seq)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Finish requests now, whatever their state, and free every block they hold. Unknown ids raise
        ValueError before anything is aborted."""
        request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        unknown = [r for r in request_ids if r not in self.requests]
        if unknown:
            raise ValueError(f"abort_request: unknown request ids {unknown}; unfinished requests: {sorted(self.requests)}")
        for request_id in request_ids:
            state = self.requests.pop(request_id)
            for index, seq in enumerate(state.request.seqs):
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                    state.finish(index, FinishReason.ABORT)
                del self._owner[seq.seq_id]
            for index in range(len(state.request.seqs), state.request.params.n):  # samples never forked
                state.finish(index, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def beam_search(self, prompts: list[str | list[int]], params: BeamSearchParams) -> list[list[BeamSearchSequence]]:
        """The beams of each prompt, best first (text not filled in): the engine's door for beam search, which
        runs outside the scheduler, as vLLM's does, on this engine's KV cache manager and model runner
        (`solutions/beam_search.py`). The engine must be idle. Each prompt is validated and tokenised as for
        `add_request` (same checks, same messages) before anything runs."""
        if self.has_unfinished_requests():
            raise ValueError("beam_search needs an idle engine: finish or abort the unfinished requests first")
        limits = SamplingParams(max_tokens=params.max_tokens)
        token_ids = [
            self.processor.process_inputs(f"beam-{i}", prompt, limits, priority=0, arrival=0).prompt_token_ids
            for i, prompt in enumerate(prompts)
        ]
        return run_beam_search(
            self.kv_cache_manager, self.model_runner, token_ids, params, eos_token_id=self.model.config.eos_token_id,
            max_model_len=self.max_model_len, seq_ids=self._seq_ids,
        )

    # --- one step: `engine_step(self)`, made of the stages below ------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, postprocess; return the outputs this step produced."""
        return engine_step(self)

    def schedule(self) -> SchedulerOutput:
        """Stage 1: the scheduler decides which sequences compute how many tokens (and what is preempted)."""
        start = time.perf_counter()
        self._seconds = dict.fromkeys(STEP_STAGES, 0.0)  # a step starts here
        scheduler_output = self.scheduler.schedule()
        for parent_id, samples in scheduler_output.forked_seqs.items():  # n > 1: the request's other samples
            state, _ = self._owner[parent_id]
            for sample in samples:
                self._owner[sample.seq_id] = (state, len(state.request.seqs))
                state.request.seqs.append(sample)
        grammars = [g for seq in sampling_seqs(scheduler_output) if (g := self._grammar(seq)) is not None]
        self.structured_output_manager.submit_bitmask(grammars)  # filled while the forward pass runs
        self._seconds["schedule"] += time.perf_counter() - start
        return scheduler_output

    def execute_model(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        """Stage 2: one forward pass over the flattened batch -> logits (B, V), row b at sequence b's last
        scheduled token (an empty (0, V) when nothing is scheduled)."""
        if scheduler_output.scheduled_seqs:
            return self.model_runner.execute_model(scheduler_output, self._seconds)  # (B, V)
        return torch.empty(0, self.model.config.vocab_size)  # (0, V)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Stage 3a: one token per row of `logits` (N, V), row i for `seqs[i]` with its request's parameters
        and its own generator."""
        start = time.perf_counter()
        owners = [self._owner[seq.seq_id] for seq in seqs]
        params = [state.request.params for state, _ in owners]
        generators = [state.request.generators[index] for state, index in owners]
        grammars = [self._grammar(seq) for seq in seqs]
        if any(grammar is not None for grammar in grammars):  # structured outputs: only what the grammars allow
            bitmask = self.structured_output_manager.grammar_bitmask(grammars)  # (N, W): the fill submitted at schedule
            logits = apply_token_bitmask(logits, bitmask)
        sampled = sample(logits, params, generators) if seqs else SamplerOutput([], [], [])
        self._seconds["sample"] += time.perf_counter() - start
        return sampled

    def update_from_output(
        self, scheduler_output: SchedulerOutput, seqs: list[Sequence], sampled: SamplerOutput
    ) -> list[RequestOutput]:
        """Stage 3b: append `sampled`'s token i to `seqs[i]`, check stop conditions, free the finished,
        detokenise; return the step's outputs (and record the step's statistics)."""
        start = time.perf_counter()
        for seq_id, num_cached in scheduler_output.num_cached_tokens.items():
            state, index = self._owner[seq_id]
            if index == 0 and seq_id in scheduler_output.new_seq_ids:
                state.num_cached_tokens = num_cached
        touched: dict[str, RequestState] = {}
        for b, seq in enumerate(seqs):
            state, index = self._owner[seq.seq_id]
            token_id = sampled.sampled_token_ids[b]
            seq.append_token(token_id)
            stop_string = state.add_token(index, token_id, sampled.logprobs[b], sampled.sampled_logprobs[b])
            grammar = self._grammar(seq)
            if grammar is not None and not grammar.accept_tokens([token_id]):
                raise RuntimeError(f"sequence {seq.seq_id} sampled token {token_id}, which its grammar's mask forbids")
            stopped = check_stop(seq, state.request.params, self.model.config.eos_token_id, self.max_model_len)
            if stopped is None and grammar is not None and grammar.is_terminated():
                stopped = (SequenceStatus.FINISHED_STOPPED, None)  # the output is complete
            if stop_string is not None:  # the text's stop string wins, as in vLLM: the text was cut there
                stopped = (SequenceStatus.FINISHED_STOPPED, stop_string)
            if stopped is not None:
                status, stop_reason = stopped
                self.scheduler.finish(seq, status)
                state.finish(index, _FINISH_REASONS[status], stop_reason)
            touched[state.request.request_id] = state
        outputs = [output for state in touched.values() if (output := self._finish_output(state)) is not None]
        self._seconds["postprocess"] += time.perf_counter() - start
        self._record(scheduler_output, self._seconds)
        return outputs

    def _grammar(self, seq: Sequence) -> StructuredOutputGrammar | None:
        """The grammar constraining `seq`'s tokens, if its request has structured outputs."""
        state, index = self._owner[seq.seq_id]
        return None if state.request.grammars is None else state.request.grammars[index]

    def _finish_output(self, state: RequestState) -> RequestOutput | None:
        output = state.make_output()
        if state.finished:
            del self.requests[state.request.request_id]
            for seq in state.request.seqs:
                del self._owner[seq.seq_id]
        return output

    def _record(self, scheduler_output: SchedulerOutput, seconds: dict[str, float]) -> None:
        used = self.kv_cache_manager.num_used_blocks
        self.stats.num_steps += 1
        self.stats.num_prefill_tokens += scheduler_output.num_prefill_tokens
        self.stats.num_decode_tokens += scheduler_output.num_decode_tokens
        self.stats.batch_sizes.append(len(scheduler_output.scheduled_seqs))
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, used)
        self.stats.steps.append(
            StepStats(
                scheduler_output.num_prefill_tokens, scheduler_output.num_decode_tokens, len(self.scheduler.running),
                len(self.scheduler.waiting), used, len(scheduler_output.preempted_seq_ids),
                sum(scheduler_output.num_cached_tokens.values()), seconds,
            )
        )


def sampling_seqs(scheduler_output: SchedulerOutput) -> list[Sequence]:
    """The sequences that sample a token after this step: those whose tokens are all computed once it has run
    (not a prompt chunk that is not the last), and the samples forked from them this step."""
    return [
        sample_seq
        for seq in scheduler_output.scheduled_seqs
        if seq.num_computed_tokens == seq.num_tokens
        for sample_seq in [*scheduler_output.forked_seqs.get(seq.seq_id, []), seq]
    ]


def engine_step(engine: LLMEngine) -> list[RequestOutput]:
    """One engine step over one flattened batch: schedule → execute → sample → postprocess.

    The model returns one row of logits per scheduled sequence, at its last scheduled token. Only a sequence
    whose tokens are all computed once this step has run samples from it (the scheduler has already advanced
    `num_computed_tokens`): a prompt chunk that is not the last predicts nothing anyone asked for. So the rows
    sampled are not simply the first ones — keep each sequence's own row. The samples the scheduler forked
    from a sequence this step (`n > 1`) sample from its row too.
    """
    scheduler_output = engine.schedule()
    logits = engine.execute_model(scheduler_output)  # (B, V)
    rows: list[int] = []
    seqs: list[Sequence] = []
    for row, seq in enumerate(scheduler_output.scheduled_seqs):
        if seq.num_computed_tokens < seq.num_tokens:
            continue  # a prompt chunk that is not the last: nothing to sample yet
        for sample_seq in [*scheduler_output.forked_seqs.get(seq.seq_id, []), seq]:  # n > 1: they share the row
            rows.append(row)
            seqs.append(sample_seq)
    sampled = engine.sample(logits[rows], seqs)  # (N, V) -> N tokens (rows may repeat)
    return engine.update_from_output(scheduler_output, seqs, sampled)
