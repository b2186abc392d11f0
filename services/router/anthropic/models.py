"""The bodies of Anthropic's Messages API as pydantic models: what ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` accept (validated with them; fields they do not name are
allowed and ignored, as Anthropic's clients send extras such as ``metadata`` or
``cache_control``), what they answer, the stream's events and the error body.

The request models are strict (a string is no number, 1 is no boolean); ``mapping`` turns a
validated request into the chat request the rest of the router serves.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
ErrorType = Literal["invalid_request_error", "authentication_error", "permission_error",
                    "not_found_error", "request_too_large", "rate_limit_error", "api_error",
                    "overloaded_error"]


class _In(BaseModel):
    """A request part: strict types, extra fields allowed (and ignored)."""

    model_config = ConfigDict(extra="allow", strict=True)


# ---- request ------------------------------------------------------------------------------
class TextBlockParam(_In):
    """``{"type": "text", "text"}``."""

    type: Literal["text"]
    text: str


class ToolUseBlockParam(_In):
    """An earlier assistant turn's tool call: ``{"type": "tool_use", "id", "name", "input"}``."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlockParam(_In):
    """A user turn's answer to a tool call: ``{"type": "tool_result", "tool_use_id",
    "content"?: str | [text blocks], "is_error"?}``."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlockParam] | None = None
    is_error: bool | None = None


class ThinkingBlockParam(_In):
    """An earlier turn's thinking (``thinking`` / ``redacted_thinking``): dropped, as the
    model's chat template would drop it."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlockParam = Annotated[TextBlockParam | ToolUseBlockParam | ToolResultBlockParam
                              | ThinkingBlockParam, Field(discriminator="type")]


class MessageParam(_In):
    """One turn: ``{"role": "user" | "assistant", "content": str | [blocks]}``."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class ToolParam(_In):
    """A client tool: ``{"name", "description"?, "input_schema"}`` (``type`` "custom" or
    absent; Anthropic's server tools are not served)."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]


class _Choice(_In):
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAuto(_Choice):
    """The model decides (the router's ``--tool-call-parser`` reads its calls)."""

    type: Literal["auto"]


class ToolChoiceAny(_Choice):
    """At least one call of any tool (enforced by a grammar)."""

    type: Literal["any"]


class ToolChoiceTool(_Choice):
    """One call of the named tool (enforced by a grammar)."""

    type: Literal["tool"]
    name: str


class ToolChoiceNone(_In):
    """No call: the text is the answer."""

    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                       Field(discriminator="type")]


class JsonOutputFormat(_In):
    """Structured output: the answer's text is JSON valid against ``schema`` (a grammar)."""

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_In):
    """``output_config``: its ``format`` is served (``effort`` is accepted and ignored)."""

    format: JsonOutputFormat | None = None


class CountTokensRequest(_In):
    """``POST /v1/messages/count_tokens``: the prompt of a Messages request."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``. vLLM's sampling extras (``seed``, ``min_p``,
    ``repetition_penalty``, ``structured_outputs``, ``chat_template_kwargs``, ...) pass to
    the chat path as on ``/v1/chat/completions``."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None


# ---- answer -------------------------------------------------------------------------------
class TextBlock(BaseModel):
    """Generated text."""

    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(BaseModel):
    """A tool call: ``id`` (``toolu_...``), the tool's ``name`` and its ``input`` object."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(BaseModel):
    """The model's reasoning (with the router's ``--reasoning-parser``); ``signature`` is
    empty (nothing to verify: the next turn's thinking blocks are dropped)."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


ContentBlock = Annotated[TextBlock | ThinkingBlock | ToolUseBlock, Field(discriminator="type")]


class Usage(BaseModel):
    """Tokens: ``input_tokens`` of the rendered prompt, ``output_tokens`` generated."""

    input_tokens: int
    output_tokens: int


class Message(BaseModel):
    """The answer of ``POST /v1/messages`` (and, empty, the stream's ``message_start``)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(BaseModel):
    """The answer of ``POST /v1/messages/count_tokens``."""

    input_tokens: int


# ---- errors -------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    """What went wrong; the message names the field of a 400."""

    type: ErrorType
    message: str


class ErrorBody(BaseModel):
    """Anthropic's error body (and the stream's ``error`` event)."""

    type: Literal["error"] = "error"
    error: ErrorDetail


# ---- stream events ------------------------------------------------------------------------
class MessageStart(BaseModel):
    """First event: the message without content."""

    type: Literal["message_start"] = "message_start"
    message: Message


class Ping(BaseModel):
    """Keep-alive."""

    type: Literal["ping"] = "ping"


class ContentBlockStart(BaseModel):
    """A block opens at ``index`` (text empty; a tool_use's input ``{}``)."""

    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class TextDelta(BaseModel):
    """More text of a text block."""

    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(BaseModel):
    """More reasoning of a thinking block."""

    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJsonDelta(BaseModel):
    """More of a tool_use block's input, as JSON text (the pieces joined parse)."""

    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDelta(BaseModel):
    """More of the block at ``index``."""

    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Annotated[TextDelta | ThinkingDelta | InputJsonDelta, Field(discriminator="type")]


class ContentBlockStop(BaseModel):
    """The block at ``index`` is complete."""

    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDeltaBody(BaseModel):
    """Why the message ended."""

    stop_reason: StopReason | None
    stop_sequence: str | None


class DeltaUsage(BaseModel):
    """The tokens generated, as the message ends."""

    output_tokens: int


class MessageDelta(BaseModel):
    """The message's end: its stop reason and usage."""

    type: Literal["message_delta"] = "message_delta"
    delta: MessageDeltaBody
    usage: DeltaUsage


class MessageStop(BaseModel):
    """Last event."""

    type: Literal["message_stop"] = "message_stop"


class StreamEvent(RootModel):
    """One server-sent event of a streamed ``POST /v1/messages`` (``event: <type>``, its data
    one of these; an error after the stream started is an ``error`` event with ``ErrorBody``)."""

    root: Annotated[MessageStart | Ping | ContentBlockStart | ContentBlockDelta
                    | ContentBlockStop | MessageDelta | MessageStop | ErrorBody,
                    Field(discriminator="type")]
