"""The engine loop: admit requests, run one forward pass per step, sample, check stop conditions, free.

This version batches *statically*: it admits as many waiting sequences as fit (by `max_num_seqs` and by
the blocks they could need at their longest), prefills them, then decodes that batch until all of it has
finished before admitting more. Chapter 5 replaces the admission rule with continuous batching; the step
structure — schedule, execute, postprocess — stays the same.

Where this lives in vLLM: `vllm/v1/engine/llm_engine.py` (`add_request`, `step`), with the processor
(`vllm/v1/engine/processor.py`) and output processor (`vllm/v1/engine/output_processor.py`).
"""

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from solutions.core.block_manager import BlockManager, cdiv
from solutions.model.llama import LlamaForCausalLM
from solutions.worker.model_runner import ModelRunner
from solutions.outputs import CompletionOutput, FinishReason, RequestOutput
from solutions.sample.sampler import sample
from solutions.sampling_params import SamplingParams
from solutions.core.sequence import Sequence, SequenceStatus


@dataclass
class Request:
    """One prompt with its n sequences (one per sample) and what each has produced so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    seqs: list[Sequence]
    generators: list[torch.Generator]
    completions: list[CompletionOutput]

    @property
    def finished(self) -> bool:
        return all(seq.status == SequenceStatus.FINISHED for seq in self.seqs)


@dataclass
class EngineStats:
    """What the engine did, for the command line and the chapters' measurements."""

    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # sequences per step
    peak_blocks_used: int = 0


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
        seed: int,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.block_size, self.max_model_len = block_size, max_model_len
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.block_manager = BlockManager(num_kv_blocks, block_size)
        self.model_runner = ModelRunner(model, num_kv_blocks, block_size)
        self.seed = seed
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Request] = {}
        self._owner: dict[int, tuple[Request, int]] = {}  # seq_id -> (its request, its sample index)
        self._seq_ids = itertools.count()
        self.stats = EngineStats()

    # --- processor: validate and tokenise, before anything is queued --------------------------------------

    def process_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> Request:
        """Validate one request and build its sequences; raises ValueError and changes nothing if invalid."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt must be a list of token ids: this model folder has no tokenizer")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        vocab_size = self.model.config.vocab_size
        if not token_ids:
            raise ValueError(f"prompt of request {request_id!r} is empty: it must hold at least one token")
        if any(not 0 <= t < vocab_size for t in token_ids):
            raise ValueError(f"prompt_token_ids of request {request_id!r} must lie in [0, {vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of request {request_id!r} has {len(token_ids)} tokens; it must be shorter than "
                f"max_model_len={self.max_model_len}"
            )
        if self._blocks_needed(len(token_ids), params) > self.block_manager.num_blocks:
            raise ValueError(
                f"request {request_id!r} could need {self._blocks_needed(len(token_ids), params)} KV blocks, more "
                f"than num_kv_blocks={self.block_manager.num_blocks}; lower max_tokens or raise num_kv_blocks"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer, and this model folder has none; use stop_token_ids")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int (lower runs first), got {priority!r}")
        seqs, generators = [], []
        for index in range(params.n):
            seq_id = next(self._seq_ids)
            seqs.append(Sequence(seq_id, token_ids))
            # Unseeded requests draw from the engine's seed; a seeded request's i-th sample uses seed + i (as vLLM).
            seed = self.seed * 1_000_003 + seq_id if params.seed is None else params.seed + index
            generators.append(torch.Generator().manual_seed(seed))
        completions = [CompletionOutput(i, "", [], None) for i in range(params.n)]
        return Request(request_id, text, token_ids, params, priority, seqs, generators, completions)

    def add_request(self, request: Request) -> None:
        """Queue a processed request; waiting sequences are kept in (priority, arrival) order."""
        self.requests[request.request_id] = request
        for index, seq in enumerate(request.seqs):
            self._owner[seq.seq_id] = (request, index)
        ordered = sorted([*self.waiting, *request.seqs], key=lambda s: (self._owner[s.seq_id][0].priority, s.seq_id))
        self.waiting = deque(ordered)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step: schedule -> execute -> postprocess -------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One forward pass; returns the requests that finished during it."""
        batch = self._schedule()
        logits = self.model_runner.execute_model(batch)  # (B, V)
        owners = [self._owner[s.seq_id] for s in batch]
        params = [request.params for request, _ in owners]
        generators = [request.generators[index] for request, index in owners]
        finished = self._postprocess(batch, sample(logits, params, generators))
        self.stats.num_steps += 1
        self.stats.batch_sizes.append(len(batch))
        return finished

    def _blocks_needed(self, prompt_len: int, params: SamplingParams) -> int:
        """Blocks one sequence could hold at its longest: the static batch reserves this much headroom."""
        return cdiv(min(prompt_len + params.max_tokens, self.max_model_len), self.block_size)

    def _schedule(self) -> list[Sequence]:
        """Prefill newly admitted sequences (up to the token budget), else decode the running batch."""
        if not self.running:  # static batching: admit a new batch only when the last one is done
            headroom = self.block_manager.num_free_blocks
            while self.waiting and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                need = self._blocks_needed(seq.num_tokens, self._owner[seq.seq_id][0].params)
                if need > headroom:
                    break
                headroom -= need
                self.block_manager.allocate(self.waiting.popleft())
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
        prefills, budget = [], self.max_num_batched_tokens
        for seq in self.running:
            new_tokens = seq.num_tokens - seq.num_computed_tokens
            if new_tokens > 1 and (new_tokens <= budget or not prefills):
                prefills.append(seq)
                budget -= new_tokens
        if prefills:
            self.stats.num_prefill_tokens += sum(s.num_tokens - s.num_computed_tokens for s in prefills)
            return prefills
        self.stats.num_decode_tokens += len(self.running)
        return list(self.running)

    def _postprocess(self, batch: list[Sequence], token_ids: list[int]) -> list[RequestOutput]:
        self.stats.peak_blocks_used = max(self.stats.peak_blocks_used, self.block_manager.num_used_blocks)
        done: list[RequestOutput] = []
        for seq, token_id in zip(batch, token_ids, strict=True):
            request, index = self._owner[seq.seq_id]
            seq.append_token(token_id)
            completion = request.completions[index]
            self._update_completion(seq, completion, request.params)
            if completion.finish_reason is None:
                self.block_manager.append_slot(seq)
                continue
            seq.status = SequenceStatus.FINISHED
            self.block_manager.free(seq)
            self.running.remove(seq)
            del self._owner[seq.seq_id]
            if request.finished:
                del self.requests[request.request_id]
                done.append(RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, request.completions, True))
        return done

    def _update_completion(self, seq: Sequence, completion: CompletionOutput, params: SamplingParams) -> None:
        """Output processor: detokenise, then apply stop conditions in vLLM's order."""
        token_id = seq.last_token_id
        completion.token_ids = seq.output_token_ids
        if self.tokenizer is not None:
            completion.text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        if token_id in params.stop_token_ids:
            completion.finish_reason, completion.stop_reason = FinishReason.STOP, token_id
        elif token_id == self.model.config.eos_token_id and not params.ignore_eos:
            completion.finish_reason = FinishReason.STOP
        elif hits := [(completion.text.find(s), s) for s in params.stop if s in completion.text]:
            cut, stop = min(hits)
            completion.text, completion.finish_reason, completion.stop_reason = completion.text[:cut], FinishReason.STOP, stop
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            completion.finish_reason = FinishReason.LENGTH
