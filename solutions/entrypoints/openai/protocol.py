"""The server's requests and responses, in OpenAI's JSON shapes, and the map from a request to `SamplingParams`.

Structured output comes in OpenAI's `response_format` (`{"type": "json_schema", "json_schema": {"name": ...,
"schema": {...}}}` or `{"type": "json_object"}`), or in vLLM's `structured_outputs` object (`json`, `regex`,
`choice`, `grammar`) or its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields; at
most one of them per request.

Requests are pydantic models, so a wrong type or a missing field is caught before the engine sees anything, with
the field's name. Unlike vLLM (which accepts and ignores fields it does not know), a field that is not declared
here is refused, as OpenAI's own API refuses an unrecognised argument: a typo such as `max_token` would otherwise
silently generate 16 tokens. Beside OpenAI's fields, the ones vLLM adds for its sampler: `top_k`, `min_p`,
`ignore_eos`, `stop_token_ids` (the `openai` client sends them through `extra_body`).

The values themselves are checked once, by `SamplingParams`; its ValueError comes back as a `RequestError`
naming the request's field (`max_completion_tokens` rather than `SamplingParams.max_tokens`).

Where this lives in vLLM: `vllm/entrypoints/openai/protocol.py`.
"""

import time
from http import HTTPStatus
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from solutions.exceptions import ParameterError
from solutions.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


class RequestError(ValueError):
    """A request the server refuses: the message, the request field it is about (OpenAI's `param`), the status."""

    def __init__(self, message: str, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.param, self.status = param, status


# ---- requests ----


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(OpenAIRequest):
    include_usage: bool = False  # one last chunk, with no choices, carrying the request's token counts


class JsonSchemaFormat(OpenAIRequest):
    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # always strict here: the mask allows nothing the schema does not


class ResponseFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(OpenAIRequest):
    """vLLM's `structured_outputs` request field: the keywords of `StructuredOutputsParams`."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


STRUCTURED_OUTPUT_FIELDS = (
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"
)


class SamplingFields(OpenAIRequest):
    """The sampling fields both endpoints share; `None` means "the default", as in vLLM's server."""

    model: str | None = None  # None: the one model this server serves
    n: int = 1
    temperature: float | None = None  # default 1.0
    top_p: float | None = None  # default 1.0
    top_k: int | None = None  # default 0: all tokens (vLLM's extension)
    min_p: float | None = None  # default 0.0 (vLLM's extension)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extension
    seed: int | None = None
    ignore_eos: bool = False  # vLLM's extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None  # OpenAI's structured output: a JSON schema or any JSON object
    structured_outputs: StructuredOutputsFields | None = None  # vLLM's extension
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names for the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return value

    def request_field(self, sampling_field: str) -> str:
        """The request field a `SamplingParams` field comes from (chat: `max_completion_tokens`, `top_logprobs`)."""
        if sampling_field == "structured_outputs":
            return self.structured_output_field or sampling_field
        return sampling_field

    @property
    def structured_output_field(self) -> str | None:
        """The one request field that asks for structured output, if any."""
        return next((name for name in STRUCTURED_OUTPUT_FIELDS if self._asks_for_structure(name)), None)

    def _asks_for_structure(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not None and not (name == "response_format" and value.type == "text")

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's constraint as `StructuredOutputsParams` (RequestError naming the field if it is bad)."""
        given = [name for name in STRUCTURED_OUTPUT_FIELDS if self._asks_for_structure(name)]
        if len(given) > 1:
            raise RequestError(f"ask for structured output in one field, got {given}", param=given[1])
        if not given:
            return None
        name = given[0]
        value = getattr(self, name)
        try:
            if name == "response_format":
                if value.type == "json_object":
                    return StructuredOutputsParams(json_object=True)
                if value.json_schema is None:
                    raise ValueError('response_format of type "json_schema" needs a json_schema object')
                return StructuredOutputsParams(json=value.json_schema.schema_)
            if name == "structured_outputs":
                return StructuredOutputsParams(**{k.rstrip("_"): v for k, v in vars(value).items()})
            return StructuredOutputsParams(**{name.removeprefix("guided_"): value})
        except ValueError as error:
            raise RequestError(f"{name}: {error}", param=name) from error

    def _requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    def _num_logprobs(self) -> int | None:
        raise NotImplementedError

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The request as `SamplingParams` (DELTA outputs: the server streams, or merges the deltas itself).

        `default_max_tokens` (the room left in the context, `max_model_len - prompt length`) stands in for an
        unset `max_tokens`. A bad value raises `RequestError` naming the request's field.
        """
        max_tokens = self._requested_max_tokens()
        structured_outputs = self.structured_outputs_params()
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                max_tokens=default_max_tokens if max_tokens is None else max_tokens,
                stop=[] if self.stop is None else self.stop,
                stop_token_ids=[] if self.stop_token_ids is None else self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                seed=self.seed,
                logprobs=self._num_logprobs(),
                output_kind=RequestOutputKind.DELTA,
                structured_outputs=structured_outputs,
            )
        except ParameterError as error:  # its field, under this request's name for it
            param = self.request_field(error.parameter)
            message = str(error).replace(f"SamplingParams.{error.parameter}", param, 1)
            raise RequestError(message, param=param) from error

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`. OpenAI's default `max_tokens` is 16; an explicit `null` fills the context."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None  # the top-k tokens' log-probabilities per generated token

    def _requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (this server takes one per request; OpenAI's batch form is refused)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise RequestError(f"prompt must be one prompt (a string or a list of token ids), got a list of "
                                   f"{len(prompt)} prompts; send one request per prompt", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise RequestError("prompt must not be empty", param="prompt")
        return prompt


class TextContentPart(OpenAIRequest):
    type: Literal["text"]
    text: str


class ChatMessageParam(OpenAIRequest):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`. No `max_tokens` (or `max_completion_tokens`, its newer name) fills the context."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False  # the sampled token's log-probability per generated token
    top_logprobs: int | None = None  # ...and the top-k tokens' (needs logprobs: true)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    def request_field(self, sampling_field: str) -> str:
        if sampling_field == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return {"logprobs": "top_logprobs"}.get(sampling_field) or super().request_field(sampling_field)

    def _requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# ---- responses ----


class OpenAIResponse(BaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogProbs(BaseModel):
    """Completions' logprobs: parallel lists, one entry per generated token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None  # "stop" or "length"
    stop_reason: int | str | None = None  # vLLM's extension: the stop string or token id that ended it


class CompletionResponse(OpenAIResponse):
    """A whole completion; each streamed chunk has this shape too, with one choice and `usage` null."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    content: list[ChatLogProbsContent] = Field(default_factory=list)


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None  # "stop" or "length"
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None  # only in each choice's first chunk
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None  # "stop" or "length"
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIResponse):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIResponse):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "paged-attention-from-scratch"
    max_model_len: int  # vLLM's extension: the context limit


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str  # "BadRequestError", "NotFoundError", ...: the exception class OpenAI's client raises
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
