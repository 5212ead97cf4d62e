"""`POST /v1/completions`: a prompt (text or token ids) in, its continuation out, whole or streamed.

`prompt` may be a list of prompts (OpenAI's batch form, as lm-evaluation-harness sends): each is its own engine
request, choice `i * n + j` is prompt i's sample j, and `usage` sums them. Streamed, each engine output becomes
one chunk per sample that moved, shaped like the whole response with `usage` null (or its prompt's counts so far,
`continuous_usage_stats`); `include_usage` adds a last chunk with the token counts; `data: [DONE]` ends it.

`echo` puts the prompt's text before each sample's and, with `logprobs`, the prompt's logprobs before the
sample's, in the legacy format's parallel lists (the first entry's logprobs are null: nothing predicts it). `echo`
with `max_tokens: 0` answers the prompt alone (see `CompletionRequest`). A whole response's choices also carry
vLLM's `prompt_logprobs` whenever the engine computed them.

Where this lives in vLLM: `vllm/entrypoints/openai/completion/serving.py` (`OpenAIServingCompletion`).
"""

import functools
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

from fastapi import Request
from starlette.responses import Response

from solutions.entrypoints.openai.protocol import (
    CompletionChoice, CompletionLogProbs, CompletionRequest, CompletionResponse, UsageInfo, json_logprob,
)
from solutions.entrypoints.openai.serving_engine import (
    OpenAIServing, finish_reason_of, sse_event, sse_events, token_text, usage_of,
)
from solutions.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    prompt_field = "prompt"
    request_id_prefix = "cmpl"

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(request)
        return await self.generate_response(request, request.prompts(), raw_request)

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
        self, request: CompletionRequest, index: int, completion: CompletionOutput, text_offset: int,
        echo: RequestOutput | None,
    ) -> CompletionChoice:
        """One sample's choice, numbered `index` in the response; `echo`: its prompt's first output, whose prompt
        goes first (or alone, when the request asked for no generation: its one generated token is dropped)."""
        text, token_ids, entries = completion.text, completion.token_ids, completion.logprobs
        if echo is not None:
            if request.echo_without_generation:
                text, token_ids = "", []
            text = self.prompt_text(echo) + text
            if entries is not None:  # logprobs asked for: the prompt's came with the first output
                entries = [*echo.prompt_logprobs, *entries[: len(token_ids)]]
            token_ids = [*echo.prompt_token_ids, *token_ids]
        logprobs = None if entries is None else self.completion_logprobs(token_ids, entries, text_offset)
        return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason_of(completion),
                                stop_reason=completion.stop_reason)

    def response(
        self, request: CompletionRequest, request_id: str, created: int, finals: list[RequestOutput]
    ) -> CompletionResponse:
        choices = []
        for prompt_index, final in enumerate(finals):
            for completion in final.outputs:
                choice = self.choice(request, prompt_index * request.n + completion.index, completion, 0,
                                     final if request.echo else None)
                # vLLM's extension: its prompt's logprobs, whenever the engine computed them (asked for by name,
                # or by echo with logprobs)
                choice.prompt_logprobs = final.prompt_logprobs
                choices.append(choice)
        num_prompt = sum(len(final.prompt_token_ids) for final in finals)
        num_generated = sum(len(completion.token_ids) for final in finals for completion in final.outputs)
        return CompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                  usage=usage_of(num_prompt, num_generated))

    def stream_events(
        self, request: CompletionRequest, request_id: str, created: int, firsts: list[RequestOutput],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncGenerator[str, None]:
        num_choices = len(firsts) * request.n
        text_offsets = [0] * num_choices  # per choice: where its next token's text starts (for logprobs)
        to_echo = set(range(num_choices)) if request.echo else set()  # the choices whose prompt is still to be sent

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return sse_event(CompletionResponse(id=request_id, created=created, model=self.model_name, choices=choices,
                                                usage=usage))

        def events(prompt_index: int, output: RequestOutput, usage: UsageInfo | None) -> list[str]:
            chunks = []
            for completion in output.outputs:
                if not completion.token_ids and completion.finish_reason is None:
                    continue
                index = prompt_index * request.n + completion.index
                echo = firsts[prompt_index] if index in to_echo else None
                to_echo.discard(index)
                choice = self.choice(request, index, completion, text_offsets[index], echo)
                text_offsets[index] += sum(map(len, choice.logprobs.tokens)) if choice.logprobs else 0
                chunks.append(chunk([choice], usage))
            return chunks

        usage_event = functools.partial(chunk, []) if request.include_usage else None  # a chunk with no choices
        return sse_events(firsts, outputs, events, usage_event, request.continuous_usage)
