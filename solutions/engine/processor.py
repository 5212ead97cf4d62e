"""The processor: raw input in, a validated engine-core request out — or a ValueError and nothing changed.

Everything a caller can get wrong is checked here, once, before the request touches a queue: the request id, the
prompt (tokenised; token ids in the vocabulary; not empty; shorter than `max_model_len`), what of the sampling
parameters depends on the engine (a structured-output constraint against the vocabulary), the priority. A bad
request raises `ParameterError` naming the field and never disturbs the requests in flight.

A string too long to fit is refused before it is tokenised (tokenising costs about half a second per megabyte):
no token spans more than `max_token_chars` characters (81 for SmolLM2), so C characters are at least
ceil(C / max_token_chars) tokens. (This assumes the normaliser does not shrink the text, true of byte-level BPE
and SentencePiece; the exact count is checked after tokenising either way.)

Where this lives in vLLM: `vllm/v1/engine/input_processor.py` (`InputProcessor.process_inputs`; vLLM renamed
`Processor` and its `processor.py` to these names).
"""

import functools
import math

from transformers import PreTrainedTokenizerBase

from solutions.config import VllmConfig
from solutions.engine import EngineCoreRequest
from solutions.exceptions import ParameterError
from solutions.sampling_params import SamplingParams
from solutions.structured_output.backend_guidance import GuidanceBackend
from solutions.utils.math_utils import cdiv


class Processor:
    def __init__(self, vllm_config: VllmConfig, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.vllm_config, self.tokenizer = vllm_config, tokenizer
        model_config = vllm_config.model_config
        self.vocab_size, self.max_model_len = model_config.vocab_size, model_config.max_model_len

    @functools.cached_property
    def guidance(self) -> GuidanceBackend:
        """Validates structured-output constraints against the vocabulary (made at the first such request)."""
        config = self.vllm_config
        return GuidanceBackend(
            self.tokenizer, config.model_config.vocab_size, config.model_config.eos_token_id,
            config.structured_outputs_config.disable_any_whitespace,
        )

    def process_inputs(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0
    ) -> tuple[str | None, EngineCoreRequest]:
        """Validate and tokenise: (the prompt's text, if it was given as text; the request for the core).
        Raises ParameterError naming the field, and has no side effect either way."""
        if not isinstance(request_id, str) or not request_id:
            raise ParameterError(f"request_id must be a non-empty string, got {request_id!r}", "request_id")
        if not isinstance(params, SamplingParams):
            raise ParameterError("sampling_params must be a SamplingParams, "
                                 f"got {type(params).__name__}", "sampling_params")
        self._validate_priority(priority)
        text, token_ids = self._tokenize(request_id, prompt)
        self._validate_length(request_id, token_ids, params)
        self._validate_params(request_id, params)
        return text, EngineCoreRequest(request_id, token_ids, params, priority)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for: its vocabulary entry's length (byte-level BPE
        writes each byte as one character, SentencePiece each character as itself; added tokens are their text)."""
        return max(map(len, self.tokenizer.convert_ids_to_tokens(range(len(self.tokenizer)))))

    def tokenize(self, text: str) -> list[int]:
        """`text` as token ids, as `LLM.generate` tokenises it; ParameterError("prompt") without tokenising if it
        is so long that it has at least `max_model_len` tokens whatever they are. (The server calls this off its
        event loop: tokenising a long text takes a while.)"""
        if self.tokenizer is None:
            raise ParameterError("prompt must be a list of token ids: this model folder has no tokenizer", "prompt")
        min_tokens = math.ceil(len(text) / self.max_token_chars)
        if min_tokens >= self.max_model_len:
            raise ParameterError(
                f"prompt has at least {min_tokens} tokens ({len(text)} characters, and no token of this tokenizer "
                f"spans more than {self.max_token_chars}); it must be shorter than max_model_len={self.max_model_len}",
                "prompt",
            )
        return self.tokenizer.encode(text)

    def _validate_priority(self, priority: object) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ParameterError(f"priority must be an int (lower runs first), got {priority!r}", "priority")
        if priority and self.vllm_config.scheduler_config.policy != "priority":
            raise ParameterError("priority needs scheduling_policy='priority'; under 'fcfs' leave it 0", "priority")

    def _tokenize(self, request_id: str, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise ParameterError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt")

    def _validate_length(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ParameterError(f"prompt of request {request_id!r} is empty: it "
                                 "must hold at least one token", "prompt")
        if len(token_ids) >= self.max_model_len:  # before the scan below: a huge prompt is refused at once
            raise ParameterError(
                f"prompt of request {request_id!r} has {len(token_ids)} tokens; it must be shorter than "
                f"max_model_len={self.max_model_len}", "prompt",
            )
        if (bad := next((t for t in token_ids if not 0 <= t < self.vocab_size), None)) is not None:
            raise ParameterError(f"prompt_token_ids of request {request_id!r} must lie in [0, "
                                 f"{self.vocab_size}), found {bad}", "prompt")
        cache_config = self.vllm_config.cache_config
        num_blocks_needed = cdiv(min(len(token_ids) + params.max_tokens, self.max_model_len), cache_config.block_size)
        if num_blocks_needed > cache_config.num_kv_blocks:
            raise ParameterError(
                f"request {request_id!r} could need {num_blocks_needed} KV blocks for one sequence, more than "
                f"num_kv_blocks={cache_config.num_kv_blocks}; lower max_tokens or raise num_kv_blocks", "max_tokens",
            )

    def _validate_params(self, request_id: str, params: SamplingParams) -> None:
        params.update_from_tokenizer(self.tokenizer)  # bad_words as token ids
        params.verify_token_ids(self.vocab_size)  # logit_bias, allowed_token_ids, bad_words
        max_num_seqs = self.vllm_config.scheduler_config.max_num_seqs
        if params.n > max_num_seqs:
            raise ParameterError(
                f"n={params.n} of request {request_id!r} exceeds max_num_seqs={max_num_seqs}: its samples run at "
                "once; lower n or raise max_num_seqs", "n",
            )
        if params.n != 1 and self.vllm_config.cache_config.kv_reservation is not None:
            raise ParameterError("n must be 1 with kv_reservation (each sample would need its own "
                                 f"reservation), got {params.n}", "n")
        if params.stop and self.tokenizer is None:
            raise ParameterError("SamplingParams.stop needs a tokenizer, and this model folder has "
                                 "none; use stop_token_ids", "stop")
        if params.structured_outputs is not None:
            if self.vllm_config.speculative_config is not None:
                raise ParameterError(
                    f"SamplingParams.structured_outputs of request {request_id!r} does not run with the engine's "
                    "speculative_config yet (drafts are not checked against the grammar): start the engine without "
                    "speculative_config", "structured_outputs",
                )
            if self.tokenizer is None:
                raise ParameterError(
                    "SamplingParams.structured_outputs needs a tokenizer, and this model folder has none",
                    "structured_outputs",
                )
            if params.structured_outputs.kind != "choice":  # a choice list is checked by its own fields
                self.guidance.validate_grammar(params.structured_outputs)
