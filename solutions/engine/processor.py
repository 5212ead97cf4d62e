"""The processor: raw input in, a validated engine request out — or a ValueError and nothing changed.

Everything a caller can get wrong is checked here, once, before the request touches a queue: the prompt (a
string is tokenised; token ids must be in the vocabulary; not empty; shorter than `max_model_len`), the
sampling parameters (their own `__post_init__` checked the values; here what depends on the engine, and a
structured-output constraint is compiled, so a schema that does not compile is refused here), the priority. So a bad request raises with the field named and never disturbs the requests already in flight.

Where this lives in vLLM: `vllm/v1/engine/processor.py` (`Processor.process_inputs`).
"""

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from solutions.core.block_manager import cdiv
from solutions.core.sequence import Sequence
from solutions.sampling_params import SamplingParams
from solutions.structured_output import StructuredOutputGrammar, StructuredOutputManager


@dataclass
class Request:
    """One prompt and the sequences serving it: one per sample, once its prompt is prefilled (for `n > 1` the
    scheduler forks the first sequence then). `generators[i]` draws sample i's tokens; `grammars[i]`, for a
    request with structured outputs, constrains them."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival: int
    generators: list[torch.Generator]
    seqs: list[Sequence] = field(default_factory=list)
    grammars: list[StructuredOutputGrammar] | None = None


class Processor:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase | None, *, vocab_size: int, max_model_len: int, num_blocks: int,
        block_size: int, seed: int, max_num_seqs: int | None = None, eos_token_id: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.structured_output_manager = StructuredOutputManager(tokenizer, vocab_size, eos_token_id)  # compiles
        self.max_num_seqs = max_num_seqs  # an n > 1 request runs its n samples at once: n may not exceed it
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.num_blocks, self.block_size, self.seed = num_blocks, block_size, seed

    def process_inputs(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int, arrival: int
    ) -> Request:
        """Validate and tokenise; raises ValueError naming the field, and has no side effect either way."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an int (lower runs first), got {priority!r}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt must be a list of token ids: this model folder has no tokenizer")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise ValueError(f"prompt of request {request_id!r} is empty: it must hold at least one token")
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            bad = next(t for t in token_ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"prompt_token_ids of request {request_id!r} must lie in [0, {self.vocab_size}), found {bad}")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of request {request_id!r} has {len(token_ids)} tokens; it must be shorter than "
                f"max_model_len={self.max_model_len}"
            )
        num_blocks_needed = cdiv(min(len(token_ids) + params.max_tokens, self.max_model_len), self.block_size)
        if num_blocks_needed > self.num_blocks:
            raise ValueError(
                f"request {request_id!r} could need {num_blocks_needed} KV blocks for one sequence, more than "
                f"num_kv_blocks={self.num_blocks}; lower max_tokens or raise num_kv_blocks"
            )
        if self.max_num_seqs is not None and params.n > self.max_num_seqs:
            raise ValueError(
                f"n={params.n} of request {request_id!r} exceeds max_num_seqs={self.max_num_seqs}: its samples run "
                "at once; lower n or raise max_num_seqs"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer, and this model folder has none; use stop_token_ids")
        constraint = params.structured_outputs
        grammars = None if constraint is None else self.structured_output_manager.grammar_init(constraint, params.n)
        # Unseeded requests draw from the engine's seed; a seeded request's i-th sample uses seed + i (as vLLM).
        seeds = [self.seed * 1_000_003 + arrival * 1_009 + i if params.seed is None else params.seed + i for i in range(params.n)]
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        return Request(request_id, text, token_ids, params, priority, arrival, generators, grammars=grammars)
