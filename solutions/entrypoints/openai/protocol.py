"""The server's requests and responses, in OpenAI's JSON shapes, and the map from a request to `SamplingParams`.

Structured output comes in OpenAI's `response_format` (`{"type": "json_schema", "json_schema": {"name": ...,
"schema": {...}}}` or `{"type": "json_object"}`), or in vLLM's `structured_outputs` object (`json`, `regex`,
`choice`, `grammar`; with JSON, `whitespace_pattern` too) or its older `guided_*` fields; at most one of them per
request.

Requests are pydantic models, so a wrong type or a missing field is caught with the field's name. What a request
may hold is vLLM's surface, since clients are written for vLLM's (its benchmark client sends
`"repetition_penalty": 1.0`, lm-evaluation-harness `echo` and `seed`, the `openai` client `user` and `metadata`).
So, as vLLM's `OpenAIBaseModel` does:
- an unknown field is accepted and ignored, with a logged warning naming it (so a typo such as `max_token` is
  ignored too; the warning is where it shows);
- a known field is used: OpenAI's, and vLLM's sampler extensions (`top_k`, `min_p`, the penalties, `logit_bias`,
  ...), each passed to the `SamplingParams` field of the same name, which checks its value;
- a known feature this engine does not implement (beam search, `suffix`, tools...) is accepted at the value that
  changes nothing (`"use_beam_search": false`) and refused with a 400 naming the field at any other value.

`SamplingParams`' ValueError comes back as a `RequestError` naming the request's field (`max_completion_tokens`
rather than `SamplingParams.max_tokens`).

Where this lives in vLLM: `vllm/entrypoints/openai/completion/protocol.py`, `.../chat_completion/protocol.py`
and `vllm/entrypoints/serve/engine/protocol.py` (`OpenAIBaseModel`).
"""

import json
import logging
import time
from http import HTTPStatus
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, ValidationInfo, field_validator, model_validator

from solutions.exceptions import ParameterError
from solutions.outputs import Logprob
from solutions.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the server refuses: the message, the request field it is about (OpenAI's `param`), the status."""

    def __init__(self, message: str, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.param, self.status = param, status


# ---- requests ----


UNSUPPORTED = "x-unsupported-accepts"  # a field's mark, in its JSON schema too: the values it is accepted at


def unsupported(*neutral: Any) -> Any:
    """A request field of a feature this engine does not implement, declared once: accepted only at the `neutral`
    values, which change nothing (the first is its default); any other is refused naming it
    (`SamplingFields.refuse_unsupported`)."""
    return Field(neutral[0], json_schema_extra={UNSUPPORTED: list(neutral)})


class OpenAIRequest(BaseModel):
    """A request object: fields it does not declare are accepted and ignored, with a warning that names them."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _warn_about_ignored_fields(self) -> "OpenAIRequest":
        if self.model_extra:
            logger.warning("The following fields were present in the request but ignored: %s", sorted(self.model_extra))
        return self


class StreamOptions(OpenAIRequest):
    include_usage: bool = False  # one last chunk, with no choices, carrying the request's token counts
    continuous_usage_stats: bool = False  # vLLM's extension: every chunk carries the counts so far


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
    whitespace_pattern: str | None = None  # JSON: the whitespace allowed between two tokens


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
    # the penalties (OpenAI's presence/frequency, vLLM's repetition) and vLLM's other sampler extensions
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's form: token id (as a string) -> bias added to its logit
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None  # vLLM's extension: the top-k logprobs of every prompt token
    bad_words: list[str] | None = None  # words the output must not contain (as token sequences)
    # known features without an engine behind them (`unsupported`): only the values that change nothing
    use_beam_search: bool = unsupported(False)
    length_penalty: float = unsupported(1.0)
    include_stop_str_in_output: bool = unsupported(False)
    skip_special_tokens: bool = unsupported(True)  # the detokenizer always skips them
    spaces_between_special_tokens: bool = unsupported(True)
    truncate_prompt_tokens: int | None = unsupported(None)
    logprob_token_ids: list[int] | None = unsupported(None)
    return_tokens_as_token_ids: bool | None = unsupported(None, False)
    # OpenAI's bookkeeping: who asked, and the caller's own tags; nothing to do with them here
    user: str | None = None
    metadata: dict[str, str] | None = None

    # `SamplingParams` fields the request passes on under the same name, when given
    SAMPLER_FIELDS: ClassVar[tuple[str, ...]] = (
        "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "logit_bias",
        "allowed_token_ids", "prompt_logprobs", "bad_words",
    )

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and info.data.get("stream"):  # 0 (only each prompt token's own logprob) is allowed, as in vLLM
            raise ValueError("prompt_logprobs are not available with stream: true (echo them instead)")
        return value

    def refuse_unsupported(self) -> None:
        """RequestError naming the first field this engine does not implement that is set to a value that
        would change the result."""
        for name, info in type(self).model_fields.items():
            neutral = (info.json_schema_extra or {}).get(UNSUPPORTED)
            value = getattr(self, name)
            if neutral is not None and value not in neutral:
                allowed = " or ".join(json.dumps(v) for v in neutral)
                raise RequestError(
                    f"{name} is not supported by this server's engine: only {allowed} (which changes nothing) is "
                    f"accepted, got {json.dumps(value)}", param=name,
                )

    def sampler_extensions(self) -> dict[str, Any]:
        """The `SAMPLER_FIELDS` the request sets, as `SamplingParams` keywords (`logit_bias` keyed by int)."""
        given = {name: getattr(self, name) for name in self.SAMPLER_FIELDS if getattr(self, name) is not None}
        if "logit_bias" in given:
            try:
                given["logit_bias"] = {int(token_id): bias for token_id, bias in given["logit_bias"].items()}
            except ValueError as error:
                raise RequestError(f"logit_bias keys must be token ids, got {error}", param="logit_bias") from error
        return given

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

    def requested_max_tokens(self) -> int | None:
        """The request's own limit on generated tokens (None: fill the context)."""
        raise NotImplementedError

    def _num_logprobs(self) -> int | None:
        raise NotImplementedError

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """The request as `SamplingParams` (DELTA outputs: the server streams, or merges the deltas itself).

        `default_max_tokens` (the room left in the context, `max_model_len - prompt length`) stands in for an
        unset `max_tokens`. A bad value raises `RequestError` naming the request's field.
        """
        self.refuse_unsupported()
        max_tokens = self.requested_max_tokens()
        structured_outputs = self.structured_outputs_params()
        extensions = self.sampler_extensions()
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
                **extensions,
            )
        except ParameterError as error:  # its field, under this request's name for it
            param = self.request_field(error.parameter)
            message = str(error).replace(f"SamplingParams.{error.parameter}", param, 1)
            raise RequestError(message, param=param) from error

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`. OpenAI's default `max_tokens` is 16; an explicit `null` fills the context.

    `echo: true` puts the prompt (and with `logprobs: k` its logprobs, none for the first token) before the
    completion. `echo` with `max_tokens: 0` returns the prompt alone, as vLLM does: the one token the engine generates
    is dropped from the text and logprobs but counted in `usage.completion_tokens`. That is how lm-evaluation-harness's
    `local-completions` scores a text (`echo`, `logprobs: 1`, `max_tokens: 1`, summing the prompt's logprobs).
    """

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None  # the top-k tokens' log-probabilities per generated (and echoed) token
    echo: bool = False
    suffix: str | None = unsupported(None, "")
    best_of: int | None = unsupported(None, 1)

    @property
    def echo_without_generation(self) -> bool:
        return self.echo and self.max_tokens == 0

    def requested_max_tokens(self) -> int | None:
        return 1 if self.echo_without_generation else self.max_tokens

    def sampler_extensions(self) -> dict[str, Any]:
        """...and with `echo`, the prompt's logprobs as many as `logprobs` asks for (unless set on their own)."""
        extensions = super().sampler_extensions()
        if self.echo and self.logprobs is not None:
            extensions.setdefault("prompt_logprobs", self.logprobs)
        return extensions

    def _num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one (a string, or a list of token ids) or OpenAI's batch form, a list of strings
        or of token-id lists. Each becomes its own engine request; choice `i * n + j` is prompt i's sample j."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and not isinstance(prompt[0], str | list)):
            prompts = [prompt]  # one string, or one list of token ids
        else:
            prompts = list(prompt)
        if not prompts:
            raise RequestError("prompt must not be empty: give a string, a list of token ids, or a list of those",
                               param="prompt")
        for index, one in enumerate(prompts):
            if not one:
                where = "" if len(prompts) == 1 and prompts[0] is prompt else f"[{index}]"
                raise RequestError(f"prompt{where} must not be empty", param="prompt")
        return prompts


class TextContentPart(OpenAIRequest):
    type: Literal["text"]
    text: str


class ChatMessageParam(OpenAIRequest):
    """One message. `developer` is OpenAI's newer name for `system` and is given to the template as that; a
    `tool` message (a tool's result) and an assistant message's `tool_calls` go to the template as they are, and
    the template decides whether it can render them. An assistant message that only calls tools has no content."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    tool_calls: list[dict[str, Any]] | None = None  # an assistant message: the calls it made

    @model_validator(mode="after")
    def _content_unless_tool_calls(self) -> "ChatMessageParam":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's tool calls may go without)")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        given = {"name": self.name, "tool_call_id": self.tool_call_id, "tool_calls": self.tool_calls}
        return message | {key: value for key, value in given.items() if value is not None}


class ChatTemplateFields(OpenAIRequest):
    """Where a conversation's prompt ends, for the chat template: the default ends it where the assistant's reply
    begins; `continue_final_message` (vLLM's) instead leaves the last (assistant) message open, to be continued."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @field_validator("continue_final_message")
    @classmethod
    def _one_way_to_end_the_prompt(cls, value: bool, info: ValidationInfo) -> bool:
        """The two end the prompt in two different places: one at most."""
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("continue_final_message needs add_generation_prompt: false (the prompt ends in the "
                             "last message, not where a new assistant message begins)")
        return value

    def conversation(self) -> list[dict[str, Any]]:
        """The subclass's `messages`, as the template reads them."""
        return [message.for_template() for message in self.messages or []]


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    """`POST /v1/chat/completions`. No `max_tokens` (or `max_completion_tokens`, its newer name) fills the context."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False  # the sampled token's log-probability per generated token
    top_logprobs: int | None = None  # ...and the top-k tokens' (needs logprobs: true)
    tools: list[dict[str, Any]] | None = unsupported(None, [])
    tool_choice: str | dict[str, Any] | None = unsupported(None, "none", "auto")

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

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(ChatTemplateFields):
    """`POST /tokenize` (vLLM's): a text (`prompt`) or a conversation (`messages`, rendered by the chat template as
    the chat endpoint renders it), not both. `add_special_tokens` defaults as vLLM's: true for a text, false for a
    conversation (the template writes them); `return_token_strs` adds each token's vocabulary entry."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = Field(default=None, min_length=1, validate_default=True)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @field_validator("messages")
    @classmethod
    def _prompt_or_messages(
        cls, value: list[ChatMessageParam] | None, info: ValidationInfo
    ) -> list[ChatMessageParam] | None:
        if (value is None) == (info.data.get("prompt") is None):
            raise ValueError("give prompt (a text) or messages (a conversation): exactly one of them")
        return value


class DetokenizeRequest(OpenAIRequest):
    """`POST /detokenize` (vLLM's): token ids in, their text out."""

    model: str | None = None
    tokens: list[int]


# ---- responses ----


class OpenAIResponse(BaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


LOGPROB_FLOOR = -9999.0  # what OpenAI (and vLLM) send for a logprob of -inf, which JSON cannot hold


def json_logprob(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


PromptLogprobs = list[dict[int, Logprob] | None]  # per prompt token: its top-k and itself; the first has none


def _prompt_logprobs_json(value: PromptLogprobs | None) -> list[dict[int, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` in a response: per prompt token `{token id: {logprob, rank, decoded_token}}`."""
    if value is None:
        return None
    return [
        None if entry is None else {
            token_id: dict(logprob=json_logprob(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for token_id, lp in entry.items()
        }
        for entry in value
    ]


PromptLogprobsField = Annotated[PromptLogprobs | None, PlainSerializer(_prompt_logprobs_json)]


class CompletionLogProbs(BaseModel):
    """Completions' logprobs: parallel lists, one entry per token (echoed prompt tokens first; the first prompt
    token's logprob and top_logprobs are null)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None  # "stop" or "length"
    stop_reason: int | str | None = None  # vLLM's extension: the stop string or token id that ended it
    prompt_logprobs: PromptLogprobsField = None  # vLLM's extension, when asked for by `prompt_logprobs`


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
    prompt_logprobs: PromptLogprobsField = None  # vLLM's extension, when asked for by `prompt_logprobs`


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


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


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
