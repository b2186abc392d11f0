"""Anthropic's error body ``{"type": "error", "error": {"type", "message"}}`` and its HTTP
status, for every error of ``/v1/messages*`` (the OpenAI routes keep OpenAI's body).

The chat path the Messages API runs on raises ``OpenAIError``; ``from_openai`` turns one into
an ``AnthropicError`` by its status (400 ``invalid_request_error``, 401
``authentication_error``, 403 ``permission_error``, 404 ``not_found_error``, 413
``request_too_large``, 429 ``rate_limit_error``, 503 / 529 ``overloaded_error``, anything
else ``api_error``), the chat field names in its text replaced by the Anthropic ones.
"""

from __future__ import annotations

import re

from pydantic import ValidationError

from services.router.anthropic.models import ErrorBody, ErrorDetail, ErrorType
from services.router.openai.errors import OpenAIError

_TYPES: dict[int, ErrorType] = {400: "invalid_request_error", 401: "authentication_error",
                                403: "permission_error", 404: "not_found_error",
                                413: "request_too_large", 429: "rate_limit_error",
                                503: "overloaded_error", 529: "overloaded_error"}
# Chat field names in the text of the chat path's errors -> the Messages fields they came from.
_RENAMES = [(re.compile(r"\b(?:max_completion_tokens|max_tokens)\b"), "max_tokens"),
            (re.compile(r"\bstop\b(?=(?:\[\d+\])? must)"), "stop_sequences"),
            (re.compile(r"\b(tools\[\d+\])\.function\.parameters\b"), r"\1.input_schema"),
            (re.compile(r"\b(tools\[\d+\])\.function\b"), r"\1"),
            (re.compile(r"\bparallel_tool_calls\b"), "tool_choice.disable_parallel_tool_use"),
            (re.compile(r"\bresponse_format\.json_schema\.schema\b"),
             "output_config.format.schema"),
            (re.compile(r"\bresponse_format(?:\.json_schema)?\b"), "output_config.format")]


class AnthropicError(Exception):
    """A request answered with Anthropic's error body.

    Attributes:
        status: the HTTP status.
        type: Anthropic's error type (by the status, see the module's docstring).
        message: what is wrong; names the field of a 400.
    """

    def __init__(self, status: int, message: str, type: ErrorType | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.type: ErrorType = type or _TYPES.get(status, "api_error")

    def body(self) -> dict:
        """The JSON body to send (``ErrorBody``)."""
        return ErrorBody(error=ErrorDetail(type=self.type, message=self.message)).model_dump()


def invalid(message: str) -> AnthropicError:
    """An HTTP 400 ``invalid_request_error``."""
    return AnthropicError(400, message)


def from_openai(e: OpenAIError) -> AnthropicError:
    """The Anthropic error of a chat-path error: same status and message, the message's chat
    field names (``max_completion_tokens``, ``stop``, ``tools[i].function.parameters``, ...)
    renamed to the Messages fields."""
    message = e.message
    for pattern, name in _RENAMES:
        message = pattern.sub(name, message)
    return AnthropicError(e.status, message)


def from_validation(e: ValidationError) -> AnthropicError:
    """A 400 naming the field of ``e``'s most specific error (the deepest: a bad block's
    field rather than "not a string" of its ``str | list`` content), e.g.
    ``messages[1].content[0].text: Input should be a valid string``; errors of the same field
    (one per branch of a union) are joined."""
    errors = [(field_path(err["loc"]), len(err["loc"]), err["msg"])
              for err in e.errors(include_url=False)]
    deepest = max(depth for _, depth, _ in errors)
    where = next(path for path, depth, _ in errors if depth == deepest)
    messages = list(dict.fromkeys(msg for path, _, msg in errors if path == where))
    text = " / ".join(messages)
    return invalid(f"{where}: {text}" if where else text)


# Fields holding a discriminated union: pydantic puts the member's tag after them in a location.
_TAGGED_FIELDS = ("tool_choice",)


def field_path(loc: tuple) -> str:
    """pydantic's error location as the request's field: ``("messages", 1, "content",
    "list[...]", 0, "text", "text")`` -> ``messages[1].content[0].text`` (the union branches
    pydantic names, ``str`` / ``list[...]`` / a block's tag, left out)."""
    out, tag_next = "", False
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        if tag_next:  # a discriminated union's member, e.g. "tool_result"
            tag_next = False
            continue
        if part == "str" or "[" in part:  # a branch of ``str | list[...]``
            tag_next = "tagged-union" in part
            continue
        out += f".{part}" if out else part
        tag_next = part in _TAGGED_FIELDS
    return out
