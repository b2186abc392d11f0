"""POST /v1/responses and GET /v1/responses/{response_id}: the request
(``openai.responses_input``), the Response object and the stream events
(``openai.responses_api``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from services.router.openai.schemas.common import Answer, Int, Request, bounds
from services.router.openai.schemas.completions import Sampling


class InputContentPart(Request):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputItem(Request):
    """An input item: a message (``type`` absent or "message"), a ``function_call``, a
    ``function_call_output`` or a ``reasoning`` item (dropped)."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] | None = None
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContentPart] | None = None


class ResponsesTool(Request):
    type: Literal["function"] = Field(description="(no hosted tools)")
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(Request):
    type: Literal["function"]
    name: str


class TextFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(Request):
    format: TextFormat | None = None


class ReasoningConfig(Request):
    effort: str | None = Field(None, description="only null is served")
    summary: str | None = Field(None, description="only null is served")


class ResponsesRequest(Sampling):
    """POST /v1/responses."""

    input: str | list[InputItem] = Field(description="a string or a non-empty list of items")
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Int | None = bounds(1)
    metadata: dict[str, str] | None = bounds(max_properties=16)
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    background: bool | None = Field(None, description="not supported (400 unless false)")
    include: list[Any] | None = Field(None, description="not supported (400 unless empty)")
    truncation: str | None = Field(None, description='not supported (400 unless "disabled")')
    top_logprobs: Int | None = Field(None, description="not supported (400 unless 0)")
    max_tool_calls: Int | None = Field(None, description="not supported (400 unless null)")


# ---- answers ------------------------------------------------------------------------------
class OutputText(Answer):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class ReasoningText(Answer):
    type: Literal["reasoning_text"]
    text: str


Status = Literal["in_progress", "completed", "incomplete"]


class MessageItem(Answer):
    type: Literal["message"]
    id: str
    status: Status
    role: Literal["assistant"]
    content: list[OutputText]


class ReasoningItem(Answer):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[ReasoningText]
    status: Status


class FunctionCallItem(Answer):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Status


OutputItem = Annotated[MessageItem | ReasoningItem | FunctionCallItem,
                       Field(discriminator="type")]


class InputTokensDetails(Answer):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(Answer):
    reasoning_tokens: int


class ResponsesUsage(Answer):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Answer):
    reason: str


class TextConfigOut(Answer):
    """The request's ``text``, repeated (its other keys too)."""

    model_config = ConfigDict(extra="allow")
    format: dict[str, Any]


class ResponseObject(Answer):
    """A Response (the whole answer, a stored one, and the data of response.* events)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Status
    error: None
    incomplete_details: IncompleteDetails | None
    model: str
    output: list[OutputItem]
    usage: ResponsesUsage | None
    background: bool
    truncation: str
    reasoning: None
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str] | None
    parallel_tool_calls: bool | None
    previous_response_id: str | None
    store: bool
    temperature: float | None
    top_p: float | None
    text: TextConfigOut
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    user: str | None


EventType = Literal[
    "response.created", "response.in_progress", "response.completed", "response.incomplete",
    "response.output_item.added", "response.output_item.done",
    "response.content_part.added", "response.content_part.done",
    "response.output_text.delta", "response.output_text.done",
    "response.reasoning_text.delta", "response.reasoning_text.done",
    "response.function_call_arguments.delta", "response.function_call_arguments.done",
    "error"]


class ResponseStreamEvent(Answer):
    """One server-sent event of a streamed Response (``event:`` is its ``type``); which fields
    it has depends on the type (``openai.responses_api``)."""

    type: EventType
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    item_id: str | None = None
    item: OutputItem | None = None
    content_index: int | None = None
    part: OutputText | ReasoningText | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    logprobs: list[Any] | None = None
    code: str | None = Field(None, description="(error)")
    message: str | None = Field(None, description="(error)")
    param: str | None = Field(None, description="(error)")
