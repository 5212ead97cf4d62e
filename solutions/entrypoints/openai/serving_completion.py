"""`POST /v1/completions`: a prompt (text or token ids) in, its continuation out, whole or streamed.

Streamed, every engine output becomes one chunk per sample that moved (`choices[0].index` says which of the `n`
samples), shaped like the whole response, with `usage` null; `stream_options.include_usage` adds one last chunk
with no choices and the token counts; `data: [DONE]` ends the stream.

Where this lives in vLLM: `vllm/entrypoints/openai/serving_completion.py` (`OpenAIServingCompletion`).
"""

from collections.abc import AsyncGenerator

from fastapi import Request
from starlette.responses import Response

from solutions.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from solutions.entrypoints.openai.serving_engine import (
    OpenAIServing,
    finish_reason_of,
    sse_event,
    sse_events,
    token_text,
    usage_of,
)
from solutions.outputs import CompletionOutput, RequestOutput


def completion_logprobs(completion: CompletionOutput, text_offset: int) -> CompletionLogProbs:
    """Completions' logprobs for the tokens of `completion`, the first token's text starting at `text_offset`.

    `top_logprobs` holds the top-k tokens and, if it was not among them, the sampled one (as vLLM returns).
    """
    logprobs = CompletionLogProbs()
    for token_id, entry in zip(completion.token_ids, completion.logprobs or [], strict=True):
        token = token_text(entry[token_id], token_id)
        logprobs.text_offset.append(text_offset)
        logprobs.tokens.append(token)
        logprobs.token_logprobs.append(entry[token_id].logprob)
        logprobs.top_logprobs.append({token_text(lp, t): lp.logprob for t, lp in entry.items()})
        text_offset += len(token)
    return logprobs


class OpenAIServingCompletion(OpenAIServing):
    prompt_field = "prompt"
    request_id_prefix = "cmpl"

    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(request)
        return await self.generate_response(request, request.single_prompt(), raw_request)

    def choice(self, completion: CompletionOutput, text_offset: int) -> CompletionChoice:
        logprobs = None if completion.logprobs is None else completion_logprobs(completion, text_offset)
        return CompletionChoice(
            index=completion.index, text=completion.text, logprobs=logprobs,
            finish_reason=finish_reason_of(completion), stop_reason=completion.stop_reason,
        )

    def response(
        self, request: CompletionRequest, request_id: str, created: int, final: RequestOutput
    ) -> CompletionResponse:
        num_generated = sum(len(completion.token_ids) for completion in final.outputs)
        return CompletionResponse(
            id=request_id, created=created, model=self.model_name,
            choices=[self.choice(completion, text_offset=0) for completion in final.outputs],
            usage=usage_of(len(final.prompt_token_ids), num_generated),
        )

    def stream_events(
        self, request: CompletionRequest, request_id: str, created: int, first: RequestOutput,
        outputs: AsyncGenerator[RequestOutput, None],
    ) -> AsyncGenerator[str, None]:
        text_offsets = [0] * request.n  # per sample: where its next token's text starts (for logprobs)

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return sse_event(CompletionResponse(
                id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
            ))

        def events(output: RequestOutput) -> list[str]:
            chunks = []
            for completion in output.outputs:
                if not completion.token_ids and completion.finish_reason is None:
                    continue
                choice = self.choice(completion, text_offsets[completion.index])
                text_offsets[completion.index] += sum(map(len, choice.logprobs.tokens)) if choice.logprobs else 0
                chunks.append(chunk([choice]))
            return chunks

        def usage_event(num_generated: int) -> str:
            return chunk([], usage_of(len(first.prompt_token_ids), num_generated))

        return sse_events(first, outputs, events, usage_event if request.include_usage else None)
