"""POST /v1/completions and POST /v1/chat/completions: requests (``openai.requests``,
``openai.messages``, ``openai.tools``, ``openai.structured_output_format`` parse them), whole
answers (``openai.responses.ResponseBuilder``, ``openai.completions.CompletionCall``) and stream
chunks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, RootModel

from services.router.openai.schemas.common import (
    Answer,
    ErrorResponse,
    Float,
    Int,
    Request,
    bounds,
    ranged,
)
from services.router.validation import (
    CHAT_ROLES,
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_STRINGS,
)

MAX_PROMPTS = 1024  # (openai.requests.MAX_PROMPTS; not imported: that module imports this one)


class StreamOptions(Request):
    """``stream_options`` (only with ``stream: true``)."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(None, description="vLLM's: usage on every chunk")


class JsonSchemaFormat(Request):
    """``response_format.json_schema``."""

    name: str
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON Schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Request):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Sampling(Request):
    """The sampling fields both routes (and the Responses route's extras) read."""

    model: str | None = Field(None, description="a served name or a LoRA adapter's; null: the "
                              "served model")
    temperature: ranged(0) = None  # type: ignore[valid-type]
    top_p: ranged(0, 1, open_lo=True) = None  # type: ignore[valid-type]
    top_k: Int | None = None
    min_p: ranged(0, 1) = None  # type: ignore[valid-type]
    repetition_penalty: Float | None = None
    presence_penalty: ranged(-2, 2) = None  # type: ignore[valid-type]
    frequency_penalty: ranged(-2, 2) = None  # type: ignore[valid-type]
    min_tokens: Int | None = bounds(0)
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    seed: Int | None = None
    stop: str | list[str] | None = bounds(max_items=MAX_STOP_STRINGS)
    stop_token_ids: list[Int] | None = None
    priority: Int | None = None
    logit_bias: dict[str, Float] | None = bounds(
        max_properties=MAX_LOGIT_BIAS,
        description=f"token id (decimal) -> bias in [-{LOGIT_BIAS_RANGE:g}, "
                    f"{LOGIT_BIAS_RANGE:g}]")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's: exactly one of json, regex, choice, grammar, json_object")
    response_format: ResponseFormat | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None


class Generation(Sampling):
    """The fields of both generation routes (not the Responses route's)."""

    n: Int | None = bounds(1, MAX_N)
    max_tokens: Int | None = bounds(0)
    prompt_logprobs: Int | None = bounds(0)
    return_tokens_as_token_ids: bool | None = None
    use_beam_search: bool | None = None
    beam_width: Int | None = bounds(1)
    length_penalty: Float | None = None
    early_stopping: bool | Literal["never"] | None = None


class CompletionRequest(Generation):
    """POST /v1/completions."""

    prompt: str | list[Int] | list[str] | list[list[Int]] = Field(
        description="a string, a list of token ids, or a batch of either (a list of "
        "strings or of token-id lists)",
        json_schema_extra={"maxItems": MAX_PROMPTS})
    echo: bool | None = None
    logprobs: Int | None = bounds(0)
    best_of: Int | None = bounds(1, MAX_N)
    suffix: str | None = Field(None, description="not supported (400 unless null)")


class ContentPart(Request):
    """A text part of a message's content (only ``type: "text"`` is served)."""

    type: Literal["text"]
    text: str


class FunctionCall(Request):
    """A tool call's function."""

    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(Request):
    """An assistant message's tool call."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class Message(Request):
    """A chat message."""

    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]
    content: str | list[ContentPart] | None = Field(
        None, description="a string or a list of text parts (null: an assistant message with "
        "tool_calls)")
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDefinition(Request):
    """A tool's function."""

    name: str = Field(description="1 to 64 of a-z, A-Z, 0-9, _ and -")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema")
    strict: bool | None = None


class Tool(Request):
    """A chat tool (``type: "function"``)."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Request):
    """``tool_choice.function``."""

    name: str


class NamedToolChoice(Request):
    """``tool_choice`` naming one function."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(Generation):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(description="a list of {role, content} objects")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='"none", "auto", "required" or a named function')
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = bounds(0)
    max_completion_tokens: Int | None = bounds(1)
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool | None = None
    functions: list[Any] | None = Field(None, description="not supported (400 unless empty)")


# ---- answers ------------------------------------------------------------------------------
class CachedTokens(Answer):
    cached_tokens: int


class ReasoningTokens(Answer):
    reasoning_tokens: int


class Usage(Answer):
    """A whole request's usage."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CachedTokens
    completion_tokens_details: ReasoningTokens | None = Field(
        None, description="(chat with --reasoning-parser)")


class ChunkUsage(Answer):
    """vLLM's continuous usage on a stream chunk: the prompt and this choice's tokens so far."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class PromptLogprob(Answer):
    logprob: float
    rank: int | None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # vLLM's; null for the first token


class CompletionLogprobs(Answer):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(Answer):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Answer):
    content: list[ChatLogprob]


class CompletionChoice(Answer):
    index: int
    text: str
    finish_reason: str | None = Field(description="stop, length, abort, ... (null: unfinished)")
    stop_reason: str | int | None = Field(
        description="vLLM's: the stop string or stop token id that ended it")
    logprobs: CompletionLogprobs | None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(Answer):
    """POST /v1/completions' answer."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(Answer):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None


class CompletionChunk(Answer):
    """A POST /v1/completions stream chunk (the last with include_usage: no choices)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | ChunkUsage | None = None


class ToolCallOut(Answer):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessageOut(Answer):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(Answer):
    index: int
    message: ChatMessageOut
    finish_reason: str | None = Field(description="stop, length, tool_calls, ...")
    stop_reason: str | int | None
    logprobs: ChatLogprobs | None


class ChatCompletionResponse(Answer):
    """POST /v1/chat/completions' answer."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None


class FunctionDelta(Answer):
    name: str | None = None
    arguments: str


class ToolCallDelta(Answer):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(Answer):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Answer):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None


class ChatCompletionChunk(Answer):
    """A POST /v1/chat/completions stream chunk."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | ChunkUsage | None = None


class CompletionStreamEvent(RootModel[CompletionChunk | ErrorResponse]):
    """A /v1/completions stream event's data: a chunk, or an error after the stream began."""


class ChatStreamEvent(RootModel[ChatCompletionChunk | ErrorResponse]):
    """A /v1/chat/completions stream event's data: a chunk, or an error after it began."""
