"""The output processor: engine tokens in, user output out — text, stop strings, finish reasons, deltas.

Detokenisation is incremental. Decoding the whole completion after every token costs O(n²); decoding only the new
token is wrong (a byte-level BPE token may hold part of a UTF-8 character, and spacing depends on the token
before). So each completion keeps two offsets: text is decoded from `prefix_offset` (a few tokens of context) up to
`read_offset` and to the end, and the difference is the new text, emitted once it no longer ends in a partial
character. Prompt logprobs arrive a chunk per prefill step and are put together here (the first token's is None).

Stop strings are searched in the new text (plus the `len(stop) - 1` characters before it) and the text is cut
where one begins. The core never sees text, so a request a stop string finishes is handed back to be aborted
there (`reqs_to_abort`), once every sample of an `n > 1` request has finished (vLLM can abort one sample: each has
its own request id in its core).

Where this lives in vLLM: `vllm/v1/engine/output_processor.py` (`OutputProcessor`, `RequestState`) and
`vllm/v1/engine/detokenizer.py` (`IncrementalDetokenizer`, `check_stop_strings`).
"""

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from solutions.engine import EngineCoreOutput, EngineCoreRequest
from solutions.exceptions import ParameterError
from solutions.outputs import CompletionOutput, FinishReason, Logprob, RequestOutput
from solutions.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class IncrementalDetokenizer:
    """Turns one completion's tokens into text a few tokens at a time (see the module docstring)."""

    tokenizer: PreTrainedTokenizerBase | None
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    def update(self, new_token_ids: list[int]) -> str:
        """Add tokens; return the text they complete (possibly "" while a character is still partial)."""
        self.token_ids += new_token_ids
        if self.tokenizer is None:
            return ""
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full_text = decode(self.token_ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""  # nothing printable yet: wait for the rest of the character
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full_text[len(prefix_text) :]


@dataclass
class CompletionState:
    index: int
    detokenizer: IncrementalDetokenizer
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    num_sent_tokens: int = 0  # what earlier DELTA outputs already carried
    num_sent_chars: int = 0
    finish_sent: bool = False

    @property
    def token_ids(self) -> list[int]:
        return self.detokenizer.token_ids


def check_stop_strings(text: str, num_new_chars: int, stop: list[str]) -> tuple[str, int] | None:
    """The first stop string in `text` that ends within its last `num_new_chars` characters: (it, where it starts)."""
    starts = ((text.find(s, max(0, len(text) - num_new_chars - len(s) + 1)), s) for s in stop)
    position, s = min(((position, s) for position, s in starts if position != -1), default=(-1, None))
    return None if s is None else (s, position)


class RequestState:
    """Everything the output processor keeps for one request until it finishes."""

    def __init__(
        self, prompt: str | None, request: EngineCoreRequest, tokenizer: PreTrainedTokenizerBase | None
    ) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request.request_id, prompt, request.prompt_token_ids
        self.params: SamplingParams = request.sampling_params
        self.tokenizer = tokenizer
        self.completions = [CompletionState(i, IncrementalDetokenizer(tokenizer)) for i in range(self.params.n)]
        if self.params.logprobs is not None:
            for completion in self.completions:
                completion.logprobs, completion.cumulative_logprob = [], 0.0
        self.num_cached_tokens = 0
        self.stopped_by_string = False  # the core does not know: it must be told to abort
        # per prompt token, filled a chunk at a time; None unless asked for
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            None if self.params.prompt_logprobs is None else [None]
        )
        self.prompt_logprobs_sent = False  # a DELTA request gets them once, in its first output

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def add_output(self, output: EngineCoreOutput) -> None:
        """Take one sample's new tokens: text, logprobs, stop strings; then the core's finish, if any."""
        completion = self.completions[output.index]
        if output.num_cached_tokens is not None:
            self.num_cached_tokens = output.num_cached_tokens
        if output.new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            position, entries = output.new_prompt_logprobs
            token_ids = self.prompt_token_ids[position : position + len(entries)]
            # from `position` on: a prompt whose prefill was preempted and started over sends its chunks again
            self.prompt_logprobs[position:] = [
                self._logprob_entry(token_id, top, chosen)
                for token_id, (top, chosen) in zip(token_ids, entries, strict=True)
            ]
        if completion.finish_reason is not None:
            return  # a stop string ended it; the core ran on until the whole request was done
        for i, token_id in enumerate(output.new_token_ids):
            top, sampled = (None, None) if output.new_logprobs is None else output.new_logprobs[i]
            if stop_string := self.add_token(output.index, token_id, top, sampled):
                self.finish(output.index, FinishReason.STOP, stop_string)  # the text's stop wins, as in vLLM
                self.stopped_by_string = True
                return
        if output.finish_reason is not None:
            self.finish(output.index, output.finish_reason, output.stop_reason)

    def add_token(
        self, index: int, token_id: int, top_logprobs: list[tuple[int, float]] | None,
        sampled_logprob: tuple[float, int] | None,
    ) -> str | None:
        """Record sample `index`'s new token; return the stop string it completed, if any."""
        completion = self.completions[index]
        new_text = completion.detokenizer.update([token_id])
        completion.text += new_text
        if completion.logprobs is not None:
            completion.logprobs.append(self._logprob_entry(token_id, top_logprobs, sampled_logprob))
            completion.cumulative_logprob += sampled_logprob[0]
        stop = self.params.stop
        if len(completion.token_ids) <= self.params.min_tokens:
            return None  # no stop string before min_tokens, as vLLM
        if stop and new_text and (hit := check_stop_strings(completion.text, len(new_text), stop)):
            stop_string, position = hit
            completion.text = completion.text[:position]
            return stop_string
        return None

    def _logprob_entry(
        self, token_id: int, top_logprobs: list[tuple[int, float]] | None, chosen: tuple[float, int]
    ) -> dict[int, Logprob]:
        """One position's logprobs: the top tokens (ranks 1, 2, ...), then `token_id`'s (its logprob, rank)."""
        entry = {t: Logprob(lp, r + 1, self._decode(t)) for r, (t, lp) in enumerate(top_logprobs or [])}
        entry.setdefault(token_id, Logprob(chosen[0], chosen[1], self._decode(token_id)))
        return entry

    def _decode(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def finish(self, index: int, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        completion = self.completions[index]
        if completion.finish_reason is None:
            completion.finish_reason, completion.stop_reason = reason, stop_reason

    def make_output(self) -> RequestOutput | None:
        """This step's output for the request, by its output kind; None when there is nothing to report."""
        final_only = self.params.output_kind is RequestOutputKind.FINAL_ONLY
        if final_only and not self.finished:
            return None
        # While a sample runs, hold back the text a stop string could still start in: it may yet be cut.
        hold_back = max((len(s) for s in self.params.stop), default=1) - 1
        outputs = []
        for c in self.completions:
            if c.finish_sent:
                continue
            start, chars = (0, 0) if final_only else (c.num_sent_tokens, c.num_sent_chars)
            if len(c.token_ids) == start and c.finish_reason is None:
                continue  # nothing new for this sample
            text_end = len(c.text) if c.finish_reason is not None else max(chars, len(c.text) - hold_back)
            outputs.append(CompletionOutput(
                c.index, c.text[chars:text_end], c.token_ids[start:], c.finish_reason, c.stop_reason,
                c.cumulative_logprob, None if c.logprobs is None else c.logprobs[start:],
            ))
            c.num_sent_tokens, c.num_sent_chars = len(c.token_ids), text_end
            c.finish_sent = c.finish_reason is not None
        if not outputs:
            return None
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is not None and not final_only:
            prompt_logprobs = [] if self.prompt_logprobs_sent else prompt_logprobs
            self.prompt_logprobs_sent = True
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, self.finished,
                             self.num_cached_tokens, prompt_logprobs)


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # finished here by a stop string: the core must free them


class OutputProcessor:
    """The front end's registry of unfinished requests: engine-core outputs in, `RequestOutput`s out."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}

    def check_new_request_ids(self, request_ids: list[str]) -> None:
        """ParameterError if one of these ids is still in use, or given twice: the one check of request ids."""
        taken = [i for n, i in enumerate(request_ids) if i in self.request_states or i in request_ids[:n]]
        if taken:
            raise ParameterError(f"request_id {taken[0]!r} is already in use by an unfinished request", "request_id")

    def add_request(self, prompt: str | None, request: EngineCoreRequest) -> None:
        """Register a request before it is sent to the core (ParameterError if its id is still in use)."""
        self.check_new_request_ids([request.request_id])
        self.request_states[request.request_id] = RequestState(prompt, request, self.tokenizer)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.request_states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        """Detokenise a step's outputs, check stop strings, make each touched request's `RequestOutput`."""
        touched: dict[str, RequestState] = {}
        for output in outputs:
            state = self.request_states.get(output.request_id)
            if state is None:
                continue  # aborted here; the core's abort is on its way
            state.add_output(output)
            touched[output.request_id] = state
        request_outputs, reqs_to_abort = [], []
        for request_id, state in touched.items():
            if (request_output := state.make_output()) is not None:
                request_outputs.append(request_output)
            if state.finished:
                self.request_states.pop(request_id, None)  # (a server's caller may have aborted it meanwhile)
                if state.stopped_by_string:
                    reqs_to_abort.append(request_id)
        return OutputProcessorOutput(request_outputs, reqs_to_abort)
