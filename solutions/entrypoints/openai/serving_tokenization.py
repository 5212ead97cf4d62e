"""`POST /tokenize` and `POST /detokenize`: the model's tokenizer, as the server itself uses it (vLLM's endpoints).

    POST /tokenize    {"prompt": "..."} or {"messages": [...]}  ->  {"count", "max_model_len", "tokens"}
    POST /detokenize  {"tokens": [...]}                         ->  {"prompt": "..."}

`/tokenize` tokenises exactly as the generating endpoints do (a text with `add_special_tokens`, true by default;
a conversation rendered by the chat template, then no special tokens by default), so its `count` is the
`usage.prompt_tokens` of the same prompt. Neither endpoint checks `max_model_len` (that is what a client asks them
about); both refuse a model other than the one served, and `/detokenize` an id outside the vocabulary.

Where this lives in vLLM: `vllm/entrypoints/serve/tokenize/serving.py` (`OpenAIServingTokenization`).
"""

import asyncio
from http import HTTPStatus

from solutions.engine.async_llm import AsyncLLM
from solutions.entrypoints.openai.protocol import (
    DetokenizeRequest, DetokenizeResponse, RequestError, TokenizeRequest, TokenizeResponse,
)
from solutions.entrypoints.openai.serving_chat import render_conversation


class OpenAIServingTokenization:
    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.processor.vocab_size

    def check(self, request: TokenizeRequest | DetokenizeRequest, field: str) -> None:
        """The model must be the one served (404, as the other endpoints); there must be a tokenizer."""
        if request.model is not None and request.model != self.model_name:
            raise RequestError(f"The model `{request.model}` does not exist; this server serves `{self.model_name}`",
                               param="model", status=HTTPStatus.NOT_FOUND)
        if self.tokenizer is None:
            raise RequestError(f"{field}: this model has no tokenizer, so there is nothing to tokenise with", field)

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check(request, "prompt" if request.messages is None else "messages")
        if request.messages is None:
            text, add_special_tokens = request.prompt, True
        else:
            text = await asyncio.to_thread(render_conversation, self.tokenizer, request)
            add_special_tokens = False
        if request.add_special_tokens is not None:
            add_special_tokens = request.add_special_tokens
        tokens = await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        token_strs = self.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens,
                                token_strs=token_strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check(request, "tokens")
        if (bad := next((t for t in request.tokens if not 0 <= t < self.vocab_size), None)) is not None:
            raise RequestError(f"tokens: token id {bad} is out of vocabulary (this model's token ids lie in "
                               f"[0, {self.vocab_size}))", "tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(self.tokenizer.decode, request.tokens))
