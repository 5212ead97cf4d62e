"""`POST /v1/completions`: a prompt (text or token ids) in, its continuation out, whole or streamed.

Streamed, every engine output becomes one chunk per sample that moved (`choices[0].index` says which of the `n`
samples), shaped like the whole response, with `usage` null (`stream_options.continuous_usage_stats`: the counts
so far); `stream_options.include_usage` adds one last chunk with no choices and the token counts; `data: [DONE]`
ends the stream.

`echo` puts the prompt's text before each sample's text (in its first chunk, streamed) and, with `logprobs`, the
prompt's logprobs before the sample's: the legacy format's parallel lists (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`), whose first entry has null logprobs — the first token is not predicted from
anything. `echo` with `max_tokens: 0` answers the prompt alone (see `CompletionRequest`).

Where this lives in vLLM: `vllm/entrypoints/openai/completion/serving.py` (`OpenAIServingCompletion`).
"""

from collections.abc import AsyncGenerator, Sequence

from fastapi import Request
from starlette.responses import Response

from solutions.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    json_logprob,
)
from solutions.entrypoints.openai.serving_engine import (
    OpenAIServing,
    finish_reason_of,
    sse_event,
    sse_events,
    token_text,
    usage_of,
)
from solutions.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    prompt_field = "prompt"
    request_id_prefix = "cmpl"

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(request)
        return await self.generate_response(request, request.single_prompt(), raw_request)

    def completion_logprobs(
        self, token_ids: Sequence[int], entries: Sequence[dict[int, Logprob] | None], text_offset: int
    ) -> CompletionLogProbs:
        """The legacy logprobs of `token_ids` (`entries`: each one's top-k and itself, or None: a prompt's first
        token), the first token's text starting at `text_offset`. `top_logprobs` holds the top-k tokens and, if
        it was not among them, the token itself (as vLLM returns)."""
        logprobs = CompletionLogProbs()
        for token_id, entry in zip(token_ids, entries, strict=True):
            if entry is None:
                token = self.tokenizer.decode([token_id]) if self.tokenizer else f"token_id:{token_id}"
                logprobs.token_logprobs.append(None)
                logprobs.top_logprobs.append(None)
            else:
                token = token_text(entry[token_id], token_id)
                logprobs.token_logprobs.append(json_logprob(entry[token_id].logprob))
                logprobs.top_logprobs.append({token_text(lp, t): json_logprob(lp.logprob) for t, lp in entry.items()})
            logprobs.text_offset.append(text_offset)
            logprobs.tokens.append(token)
            text_offset += len(token)
        return logprobs

    def prompt_text(self, output: RequestOutput) -> str:
        """The prompt as text, to echo: as sent, or decoded from the token ids sent."""
        if output.prompt is not None:
            return output.prompt
        return self.tokenizer.decode(output.prompt_token_ids) if self.tokenizer else ""

    def choice(
        self, request: CompletionRequest, completion: CompletionOutput, text_offset: int, echo: RequestOutput | None
    ) -> CompletionChoice:
        """One sample's choice; `echo`: the request's first output, whose prompt goes first (or alone, when the
        request asked for no generation: its one generated token is dropped)."""
        text, token_ids, entries = completion.text, completion.token_ids, completion.logprobs
        if echo is not None:
            if request.echo_without_generation:
                text, token_ids = "", []
            text = self.prompt_text(echo) + text
            if entries is not None:  # logprobs asked for: the prompt's came with the first output
                entries = [*echo.prompt_logprobs, *entries[: len(token_ids)]]
            token_ids = [*echo.prompt_token_ids, *token_ids]
        logprobs = None if entries is None else self.completion_logprobs(token_ids, entries, text_offset)
        return CompletionChoice(
            index=completion.index, text=text, logprobs=logprobs,
            finish_reason=finish_reason_of(completion), stop_reason=completion.stop_reason,
        )

    def response(
        self, request: CompletionRequest, request_id: str, created: int, final: RequestOutput
    ) -> CompletionResponse:
        choices = [self.choice(request, completion, 0, final if request.echo else None) for completion in final.outputs]
        if request.prompt_logprobs is not None:  # vLLM's extension, asked for by name
            for choice in choices:
                choice.prompt_logprobs = final.prompt_logprobs
        num_generated = sum(len(completion.token_ids) for completion in final.outputs)
        return CompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices,
            usage=usage_of(len(final.prompt_token_ids), num_generated),
        )

    def stream_events(
        self, request: CompletionRequest, request_id: str, created: int, first: RequestOutput,
        outputs: AsyncGenerator[RequestOutput, None],
    ) -> AsyncGenerator[str, None]:
        text_offsets = [0] * request.n  # per sample: where its next token's text starts (for logprobs)
        to_echo = set(range(request.n)) if request.echo else set()  # the samples whose prompt is still to be sent

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return sse_event(CompletionResponse(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
            ))

        def events(output: RequestOutput, usage: UsageInfo | None) -> list[str]:
            chunks = []
            for completion in output.outputs:
                if not completion.token_ids and completion.finish_reason is None:
                    continue
                echo = first if completion.index in to_echo else None
                to_echo.discard(completion.index)
                choice = self.choice(request, completion, text_offsets[completion.index], echo)
                text_offsets[completion.index] += sum(map(len, choice.logprobs.tokens)) if choice.logprobs else 0
                chunks.append(chunk([choice], usage))
            return chunks

        def usage_event(usage: UsageInfo) -> str:
            return chunk([], usage)

        return sse_events(
            first, outputs, events, usage_event if request.include_usage else None, request.continuous_usage
        )
