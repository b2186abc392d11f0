"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API on
the router's chat path, registered by ``openai.http.OpenAIServer``.

A request is validated with ``models.MessagesRequest``, mapped onto a chat request
(``mapping``), then goes as a chat completion does: the server's ``_prepare`` (validation,
tokenization, access log), ``generation.stream_responses``, and ``events.MessageEvents``
shapes the answer (whole JSON, or Anthropic's server-sent events with ``stream: true``).
Every error of these routes is Anthropic's body (``errors``); an engine error before the first
token is a normal HTTP error (e.g. 429), after it an ``error`` event ends the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from services.common.pb.pagedserve.v1 import engine_pb2
from services.router.anthropic import models as m
from services.router.anthropic.errors import AnthropicError, from_openai, from_validation
from services.router.anthropic.events import MessageEvents, new_message_id
from services.router.anthropic.mapping import prompt, to_chat
from services.router.generation import (
    INLINE_PREPARE_BYTES,
    EngineError,
    PreparedRequest,
    RequestLog,
    stream_responses,
)
from services.router.openai import tokenization
from services.router.openai.errors import OpenAIError
from services.router.openai.reasoning import ReasoningOptions
from services.router.openai.requests import ParsedRequest, from_error
from services.router.openai.schema_check import json_response, sse_event
from services.router.openapi import Route
from services.router.replicas import ReplicaSet

log = logging.getLogger(__name__)
_M = TypeVar("_M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REQUEST_ID_HEADER = "X-Request-Id"  # (as openai.http's: the client's id, echoed)
_ERRORS = {400: "invalid_request_error: a field is wrong (the message names it)",
           401: "authentication_error: missing or wrong API key (x-api-key or Authorization: "
                "Bearer)",
           404: "not_found_error: the model is not served here",
           413: "request_too_large: the body is over --max-request-bytes",
           429: "rate_limit_error: the engine's queue is full",
           500: "api_error: the server failed", 503: "overloaded_error: no replica can serve"}
ROUTES = [
    Route("POST", "/v1/messages", "Anthropic Messages: a conversation's next assistant turn "
          "(text and tool_use blocks)", request=m.MessagesRequest, response=m.Message,
          stream=m.StreamEvent, errors=_ERRORS, error=m.ErrorBody, tags=("anthropic",)),
    Route("POST", "/v1/messages/count_tokens", "Anthropic Messages: the tokens of a request's "
          "rendered prompt", request=m.CountTokensRequest, response=m.CountTokensResponse,
          errors={k: v for k, v in _ERRORS.items() if k not in (429,)}, error=m.ErrorBody,
          tags=("anthropic",)),
]


class ChatServer(Protocol):
    """What the routes use of ``openai.http.OpenAIServer``."""

    engine: ReplicaSet
    tokenizer: Any
    tool_parser: str | None
    max_stream_buffer: int

    async def _body(self, request: web.Request
                    ) -> tuple[dict, engine_pb2.GetEngineInfoResponse]: ...

    async def _prepare(self, request: web.Request, parsed: ParsedRequest,
                       info: engine_pb2.GetEngineInfoResponse, default_id: str
                       ) -> PreparedRequest: ...

    def _reasoning(self, chat_template_kwargs: dict, include: bool,
                   prepared: PreparedRequest) -> ReasoningOptions | None: ...


def _error(e: AnthropicError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


def validate(model: type[_M], body: dict) -> _M:
    """``body`` validated with ``model``.

    Raises:
        AnthropicError: 400 naming the field.
    """
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise from_validation(e) from None


class MessagesRoutes:
    """The two routes of one server.

    Args:
        server: the OpenAI server whose chat path they run on.
        log_key: where the server keeps a request's access log entry.
    """

    def __init__(self, server: ChatServer, log_key: web.RequestKey[RequestLog]):
        self.server, self.log_key = server, log_key

    def handlers(self) -> list[tuple[Route, Handler]]:
        """Each route (``ROUTES``) with its handler, for the server to serve."""
        return list(zip(ROUTES, (self.messages, self.count_tokens), strict=True))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/messages."""
        return await _anthropic_errors(request, self._messages(request))

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/messages/count_tokens: ``{"input_tokens"}`` of the rendered prompt (the
        chat template with the tools)."""
        return await _anthropic_errors(request, self._count_tokens(request))

    async def _count_tokens(self, request: web.Request) -> web.StreamResponse:
        body, info = await self.server._body(request)
        chat = prompt(validate(m.CountTokensRequest, body))
        tokenizer = self.server.tokenizer
        if len(await request.read()) > INLINE_PREPARE_BYTES:  # keep the loop free
            answer = await asyncio.to_thread(tokenization.tokenize, chat, tokenizer, info)
        else:
            answer = tokenization.tokenize(chat, tokenizer, info)
        return json_response(m.CountTokensResponse,
                             {"input_tokens": answer["count"]})

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        server = self.server
        body, info = await server._body(request)
        parsed = to_chat(validate(m.MessagesRequest, body), body, server.tool_parser)
        message_id = new_message_id()
        prepared = await server._prepare(request, parsed, info, message_id)
        reasoning = server._reasoning(parsed.chat_template_kwargs, True, prepared)
        events = MessageEvents(info.model, len(prepared.prompt_token_ids), parsed.tool_calls,
                               message_id, reasoning.splitter if reasoning is not None else None)
        headers = {REQUEST_ID_HEADER: prepared.request_id}
        entry = request[self.log_key]
        # NOTE: aclosing: however the handler ends (client gone, error), the generator is
        # closed, and its clean-up aborts the engine request.
        async with contextlib.aclosing(stream_responses(
                server.engine, server.tokenizer, prepared,
                max_pending=server.max_stream_buffer)) as responses:
            try:
                first = await anext(responses, None)
                if not parsed.stream:
                    r = first
                    while r is not None:
                        entry.observe(r)
                        events.feed(r)
                        r = await anext(responses, None)
                    return json_response(m.Message, events.message(), headers=headers)
            except EngineError as e:  # e.g. an invalid grammar, a full queue
                raise from_error(e, "messages", parsed.structured_param) from None
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache", **headers})
            await resp.prepare(request)
            for event in events.start():
                await resp.write(sse_event(event, m.StreamEvent))
            try:
                r = first
                while r is not None:
                    entry.observe(r)
                    for event in events.feed(r):
                        await resp.write(sse_event(event, m.StreamEvent))
                    r = await anext(responses, None)
            except EngineError as e:
                entry.error = e.code.name
                err = from_openai(from_error(e, "messages", parsed.structured_param))
                await resp.write(sse_event(events.error(err), m.StreamEvent))
            await resp.write_eof()
            return resp


async def _anthropic_errors(request: web.Request, handling) -> web.StreamResponse:
    """Await a handler's coroutine; its errors answered with Anthropic's body (the app's
    middleware would write OpenAI's)."""
    try:
        return await handling
    except AnthropicError as e:
        return _error(e)
    except OpenAIError as e:
        return _error(from_openai(e))
    except web.HTTPException as e:  # e.g. 413 from reading the body
        if e.status < 400:
            raise
        return _error(AnthropicError(e.status, e.text or e.reason))
    except ConnectionError:  # the client went away: nobody to answer
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return _error(AnthropicError(500, "internal server error"))
