"""`POST /v1/chat/completions`: a conversation in, the assistant's reply out, whole or streamed.

The conversation becomes one prompt through the tokenizer's chat template (a Jinja template shipped with the
model), with `add_generation_prompt=True` so the prompt ends where the assistant's reply begins — exactly what
`LLM.chat` builds — and from there it is a completion. The template is rendered in a worker thread: a long
conversation must not hold up the event loop. Streamed, each sample's first chunk carries
`delta.role = "assistant"`, later chunks `delta.content`, the last one the `finish_reason`.

Where this lives in vLLM: `vllm/entrypoints/openai/chat_completion/serving.py` (`OpenAIServingChat`) and
`vllm/renderers/hf.py` (`HfRenderer.render_messages`, which applies the chat template; vLLM moved that there from
`entrypoints/chat_utils.py`'s `apply_hf_chat_template`).
"""

import asyncio
import functools
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import Request
from jinja2 import TemplateError
from starlette.responses import Response
from transformers import PreTrainedTokenizerBase

from solutions.entrypoints.openai.protocol import (
    ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogProb, ChatLogProbs,
    ChatLogProbsContent, ChatMessage, ChatStreamChoice, DeltaMessage, RequestError, TokenizeRequest, UsageInfo,
)
from solutions.entrypoints.openai.serving_engine import (
    OpenAIServing, finish_reason_of, sse_event, sse_events, token_text, usage_of,
)
from solutions.outputs import CompletionOutput, RequestOutput


def chat_logprobs(completion: CompletionOutput, num_top: int) -> ChatLogProbs:
    """Chat's logprobs: per token, the sampled token and the `num_top` most likely ones, most likely first."""
    content = []
    for token_id, entry in zip(completion.token_ids, completion.logprobs or [], strict=True):
        token = token_text(entry[token_id], token_id)
        top = sorted((lp.rank, t, lp) for t, lp in entry.items() if lp.rank <= num_top)
        content.append(ChatLogProbsContent(
            token=token, logprob=entry[token_id].logprob, bytes=list(token.encode()),
            top_logprobs=[
                ChatLogProb(token=token_text(lp, t), logprob=lp.logprob, bytes=list(token_text(lp, t).encode()))
                for _, t, lp in top
            ],
        ))
    return ChatLogProbs(content=content)


def render_conversation(
    tokenizer: PreTrainedTokenizerBase | None, request: ChatCompletionRequest | TokenizeRequest
) -> str:
    """The request's conversation as one prompt string, through the model's chat template (the chat endpoint's,
    and `/tokenize`'s for messages)."""
    if tokenizer is None or not tokenizer.chat_template:
        raise RequestError("messages need a chat template, and this model has none: use /v1/completions", "messages")
    try:
        return tokenizer.apply_chat_template(
            request.conversation(), tokenize=False, add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
        )
    except (TemplateError, ValueError) as error:  # the template's own checks, e.g. roles that must alternate;
        # Hugging Face's, e.g. continue_final_message after a user message
        raise RequestError(f"messages could not be formatted by the chat template: {error}", "messages") from error


class OpenAIServingChat(OpenAIServing):
    prompt_field = "messages"
    request_id_prefix = "chatcmpl"

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(request)
        prompt = await asyncio.to_thread(render_conversation, self.tokenizer, request)
        return await self.generate_response(request, [prompt], raw_request)

    def logprobs(self, request: ChatCompletionRequest, completion: CompletionOutput) -> ChatLogProbs | None:
        return None if completion.logprobs is None else chat_logprobs(completion, request.top_logprobs or 0)

    def response(
        self, request: ChatCompletionRequest, request_id: str, created: int, finals: list[RequestOutput]
    ) -> ChatCompletionResponse:
        (final,) = finals  # a conversation is one prompt
        choices = [
            ChatChoice(
                index=completion.index, message=ChatMessage(content=completion.text),
                logprobs=self.logprobs(request, completion),
                finish_reason=finish_reason_of(completion), stop_reason=completion.stop_reason,
            )
            for completion in final.outputs
        ]
        num_generated = sum(len(completion.token_ids) for completion in final.outputs)
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices,
            usage=usage_of(len(final.prompt_token_ids), num_generated),
            prompt_logprobs=final.prompt_logprobs if request.prompt_logprobs is not None else None,
        )

    def stream_events(
        self, request: ChatCompletionRequest, request_id: str, created: int, firsts: list[RequestOutput],
        outputs: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncGenerator[str, None]:
        def chunk(choice: ChatStreamChoice | None, usage: UsageInfo | None = None) -> str:
            choices = [] if choice is None else [choice]
            return sse_event(ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices,
                                                 usage=usage))

        def events(_: int, output: RequestOutput, usage: UsageInfo | None) -> list[str]:
            return [
                chunk(ChatStreamChoice(
                    index=completion.index, delta=DeltaMessage(content=completion.text),
                    logprobs=self.logprobs(request, completion),
                    finish_reason=finish_reason_of(completion), stop_reason=completion.stop_reason,
                ), usage)
                for completion in output.outputs
                if completion.token_ids or completion.finish_reason is not None
            ]

        roles = [  # each sample's first chunk names the speaker
            chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")))
            for index in range(request.n)
        ]
        usage_event = functools.partial(chunk, None) if request.include_usage else None  # a chunk with no choice
        return sse_events(firsts, outputs, events, usage_event, request.continuous_usage, opening=roles)
