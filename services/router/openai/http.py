"""The OpenAI-compatible HTTP API (aiohttp), served by the router on its own asyncio loop.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (whole JSON, or
server-sent events with ``stream: true``), GET /v1/responses/{id} (a stored answer),
POST /v1/embeddings (a pooling server's, ``openai.embeddings``), GET /v1/models, vLLM's
POST /tokenize and POST /detokenize (``openai.tokenization``) and GET /version, GET /health,
GET /metrics and GET /openapi.json (the OpenAPI 3.1 document of every route served, built from
the ``openai.schemas`` models that each handler checks its body with and writes its answers
through: ``openai.routes``, ``openai.schema_check``; ``add_route`` serves more).
A request goes the same way as a gRPC Generate call: ``openai.requests`` maps the JSON onto a
GenerateRequest, then
``generation.prepare`` (validation, tokenization) and ``generation.stream_responses`` (engine,
detokenization, stop strings, n choices). Errors use OpenAI's body
``{"error": {message, type, param, code}}``: 400 invalid argument, 404 unknown model or route,
429 engine queue full, 503 no scheduler replica can serve (none connected, or their engines
wait for their workers; ``GET /health`` answers 503 then too).

Each completion request leaves one access log line when it ends (a stream: when the stream
ends), as a gRPC Generate call does: request id, route, HTTP status, prompt and completion
tokens, duration (``services.common.logs.log_access``). The request id is the client's
``X-Request-Id`` header (echoed in the response) or else the response's ``id``.

A client that disconnects cancels its handler (aiohttp's ``handler_cancellation``), which
closes the ``stream_responses`` generator, which aborts the engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import replace

from aiohttp import web

from services.common import tracing
from services.common.logs import request_id_var
from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import engine_pb2
from services.router.anthropic.handler import MessagesRoutes
from services.router.embedding import prepare_embed, run_embed
from services.router.generation import (
    DEFAULT_MAX_STREAM_BUFFER,
    INLINE_PREPARE_BYTES,
    EngineError,
    PreparedRequest,
    RequestLog,
    prepare,
    stream_responses,
)
from services.router.metrics import RouterMetrics
from services.router.openai import routes, tokenization
from services.router.openai.completions import CompletionCall
from services.router.openai.embeddings import (
    embedding_error,
    embedding_response,
    is_one_token_list,
    parse_embedding,
)
from services.router.openai.errors import OpenAIError, bad_request
from services.router.openai.reasoning import (
    ReasoningOptions,
    constrain_after,
    prompt_ends_reasoning,
    starts_in_reasoning,
    tag_ids,
)
from services.router.openai.requests import (
    ParsedRequest,
    from_error,
    parse_chat,
    parse_completion,
)
from services.router.openai.responses import ResponseBuilder
from services.router.openai.responses_api import ResponseEvents, new_response_id
from services.router.openai.responses_input import ParsedResponses, parse_responses, rename
from services.router.openai.responses_store import ResponseStore
from services.router.openai.schema_check import check_body, json_response, sse, sse_event
from services.router.openai.schemas import completions as cs
from services.router.openai.schemas import embeddings as es
from services.router.openai.schemas import misc as ms
from services.router.openai.schemas import responses as rs
from services.router.openai.schemas.common import ErrorResponse
from services.router.openai.structured_output_format import error_param
from services.router.openapi import Route, document
from services.router.quotas import charge_tokens
from services.router.replicas import ReplicaSet
from services.router.served_model import ServedModel
from services.router.tracing import http_middleware
from services.router.usage.routes import USAGE_ROUTE, usage_report
from services.router.usage.service import Usage
from services.router.validation import MAX_LOGPROBS, MAX_REQUEST_ID_CHARS, RequestError

log = logging.getLogger(__name__)
# NOTE: the largest request the public APIs read (HTTP body; gRPC message, router
# --max-request-bytes): 8 MiB holds a 128k-token prompt many times over (as JSON token
# ids ~7 B/token, as text ~4 B/token), and bounds what one request makes the router parse
# and tokenize. Larger: HTTP 413, gRPC RESOURCE_EXHAUSTED.
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
DISABLED = -1  # --http-port value that turns the HTTP server off
# Routes whose requests get an access log line at INFO (others, e.g. probes, at DEBUG).
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses",
                     "/v1/embeddings", "/v1/messages")
# HTTP header naming the request (as gRPC's x-request-id metadata), echoed in the response.
REQUEST_ID_HEADER = "X-Request-Id"
# The access-log status of a request whose client went away before its response (nginx's).
CLIENT_CLOSED = 499
NO_RETRY_HEADER = "x-should-retry"  # (read by OpenAI's and Anthropic's Python SDKs)
_LOG = web.RequestKey("request_log", RequestLog)  # the request's access log entry
_LORA = web.RequestKey("lora", LoRARequest)  # the LoRA adapter its model names (absent: none)
# NOTE: aiohttp's limits on a request's head (its defaults, named here so the docs can state
# them): a request line or header name longer than MAX_LINE_BYTES, a header value longer than
# MAX_FIELD_BYTES, or more than MAX_HEADERS headers is answered 400 by aiohttp's parser before
# any handler runs, and only that connection is closed.
MAX_LINE_BYTES = 8190
MAX_FIELD_BYTES = 8190
MAX_HEADERS = 128


def _error(e: OpenAIError) -> web.Response:
    # NOTE: the engine's INTERNAL (a constraint that broke, a kernel error) comes again on a
    # retry with the same request; OpenAI's SDKs retry a 500 twice unless told not to.
    headers = {NO_RETRY_HEADER: "false"} if e.code == "internal" else None
    return json_response(ErrorResponse, e.body(), status=e.status, headers=headers)


def _event(body: dict) -> bytes:
    """A Responses stream event: ``event: <type>`` then its data."""
    return sse_event(body, rs.ResponseStreamEvent)


@web.middleware
async def _openai_errors(request: web.Request, handler):
    """OpenAI-shaped bodies for our errors, aiohttp's own (unknown route, wrong method, too
    big) and unexpected ones (500, logged)."""
    try:
        return await handler(request)
    except OpenAIError as e:
        return _error(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = (f"Invalid URL ({request.method} {request.path})" if e.status in (404, 405)
                   else e.text or e.reason if e.status == 413  # names the limit and the size
                   else e.reason)
        answer = _error(OpenAIError(e.status, message, code=e.reason.lower().replace(" ", "_")))
        if "Allow" in e.headers:  # a 405 names the methods the route has (RFC 9110)
            answer.headers["Allow"] = e.headers["Allow"]
        return answer
    except ConnectionError:  # the client went away: nobody to answer
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return _error(OpenAIError(500, "internal server error", "server_error"))


class OpenAIServer:
    """The OpenAI-compatible HTTP front end of one router.

    Args:
        engine: the router's scheduler replicas.
        tokenizer: the model's fast tokenizer.
        max_body_bytes: larger request bodies are refused with 413 (router
            --max-request-bytes).
        served: the names the model is served under (router --served-model-name; default:
            the engine's name).
    """

    def __init__(self, engine: ReplicaSet, tokenizer, metrics: RouterMetrics | None = None,
                 max_body_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 served: ServedModel | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.served = served or ServedModel()
        self.max_logprobs = MAX_LOGPROBS  # router --max-logprobs
        self.max_stream_buffer = DEFAULT_MAX_STREAM_BUFFER  # router --max-stream-buffer
        # router --tool-call-parser, when --enable-auto-tool-choice is set (tool_choice "auto")
        self.tool_parser: str | None = None
        # router --enable-responses-api-store: the stored Responses answers, or None
        self.responses_store: ResponseStore | None = None
        self.reasoning_parser: str | None = None  # router --reasoning-parser
        self.usage: Usage | None = None  # router --usage-db: rows, GET /v1/usage (usage/)
        self._think_ids: tuple[int, int] | None = None  # reasoning.tag_ids of the tokenizer
        self._think_ids_known = False  # (looked up at the first request that needs them)
        self.app = web.Application(middlewares=[self._count, _openai_errors],
                                   client_max_size=max_body_bytes)
        self.routes: list[Route] = []  # every route served, as /openapi.json lists them
        self._document: tuple[int, dict] | None = None  # (len(routes), the document)
        for route, handler in ((routes.COMPLETIONS, self.completions),
                               (routes.CHAT, self.chat_completions),
                               (routes.RESPONSES, self.responses),
                               (routes.STORED_RESPONSE, self.stored_response),
                               (routes.EMBEDDINGS, self.embeddings),
                               (routes.MODELS, self.models),
                               (routes.TOKENIZE, self.tokenize),
                               (routes.DETOKENIZE, self.detokenize),
                               (routes.VERSION, self.version),
                               (USAGE_ROUTE, self.usage_report),
                               (routes.HEALTH, self.health),
                               (routes.METRICS, self.prometheus),
                               (routes.OPENAPI, self.openapi)):
            self.add_route(route, handler)
        # Anthropic's Messages API on the chat path (services.router.anthropic)
        for messages_route, messages_handler in MessagesRoutes(self, _LOG).handlers():
            self.add_route(messages_route, messages_handler)
        self._runner: web.AppRunner | None = None
        if tracing.tracer() is not None:  # (inside the error middleware: sees our errors)
            self.app.middlewares.append(http_middleware(lambda request: request.get(_LOG)))

    @web.middleware
    async def _count(self, request: web.Request, handler):
        """Count each request by route and final HTTP status (``cancelled``: the client left),
        and write a completion request's access log line."""
        status: int | str = "cancelled"
        entry = request[_LOG] = RequestLog(
            request.path, usage=self.usage.recorder if self.usage is not None else None)
        client_id = request.headers.get(REQUEST_ID_HEADER, "")
        if len(client_id) <= MAX_REQUEST_ID_CHARS:  # (a body refused before prepare: named too)
            entry.request_id = client_id or None
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as e:
            status = e.status
            raise
        finally:
            if self.metrics is not None:
                route = request.match_info.route.resource
                path = route.canonical if route is not None else "unmatched"
                self.metrics.request_done(path, str(status))
            if request.path in GENERATION_ROUTES:
                entry.done(CLIENT_CLOSED if status == "cancelled" else status)

    def add_route(self, route: Route, handler) -> None:
        """Serve ``handler`` (an aiohttp handler) at ``route.method`` ``route.path`` and list
        it in ``GET /openapi.json``; call before ``start``.

        Raises:
            RuntimeError: (aiohttp's) the server has started (its router is frozen).
        """
        if route.method == "GET":  # (HEAD too, as aiohttp's web.get)
            self.app.router.add_get(route.path, handler)
        else:
            self.app.router.add_route(route.method, route.path, handler)
        self.routes.append(route)

    def require_api_keys(self, keys) -> None:
        """Answer 401 to every request but ``GET /health`` without an accepted
        ``Authorization: Bearer <key>`` (``keys``: ``auth.ApiKeys``). Call before ``start``."""
        from services.router.auth import http_middleware
        self.app.middlewares.insert(1, http_middleware(keys))  # after _count: 401s are counted

    async def start(self, host: str, port: int, ssl_context=None) -> int:
        """Listen on host:port (0 = a free port); returns the bound port. With
        ``ssl_context`` (``TLSConfig.http_ssl_context()``) it serves HTTPS.

        Raises:
            ValueError: port outside [0, 65535].
            RuntimeError: the address cannot be bound (e.g. the port is in use).
        """
        if not 0 <= port <= 65535:
            raise ValueError(f"--http-port must be in [0, 65535], or -1 (off), got {port}")
        # NOTE: handler_cancellation: a client that goes away cancels its handler, so the
        # engine requests are aborted even while no byte is being written.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                     shutdown_timeout=2.0, max_line_size=MAX_LINE_BYTES,
                                     max_field_size=MAX_FIELD_BYTES, max_headers=MAX_HEADERS)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, host, port, ssl_context=ssl_context).start()
        except OSError as e:
            await self._runner.cleanup()
            raise RuntimeError(f"cannot bind HTTP {host}:{port}: {e.strerror or e}") from None
        return self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Close the listener and the open connections."""
        if self._runner is not None:
            await self._runner.cleanup()

    # ---- routes -------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """Readiness: 200 while at least one scheduler replica can serve (connected, and its
        engine has its workers; gRPC health SERVING), else 503 (and 503 while draining)."""
        return web.Response(status=200 if self.engine.serving.is_set() else 503)

    async def openapi(self, request: web.Request) -> web.Response:
        """GET /openapi.json: the OpenAPI 3.1 document of every route served (``routes``),
        built from the models the handlers check and write (open without an API key)."""
        if self._document is None or self._document[0] != len(self.routes):
            version = importlib.metadata.version("pagedserve")
            self._document = (len(self.routes), document(self.routes, "pagedserve", version))
        return web.json_response(self._document[1])

    async def prometheus(self, request: web.Request) -> web.Response:
        """The router's metrics on the serving port too (as a vLLM server serves them), where
        gateways that route to this endpoint scrape them (``gateway_metrics.py``); open without
        an API key, like ``/health``."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = generate_latest(self.metrics.registry) if self.metrics is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def models(self, request: web.Request) -> web.Response:
        """The served model, as OpenAI's model list (``id``: the first served name, ``root``:
        the engine's name, as vLLM), then its LoRA adapters (``root``: the adapter's folder,
        ``parent``: the base model's id or the entry's base_model_name, as vLLM)."""
        info = self._info()
        base = {"id": info.model, "object": "model", "created": 0, "owned_by": "pagedserve",
                "root": self.engine.info.model if self.engine.info else info.model,
                "parent": None, "max_model_len": info.max_model_len}
        return json_response(ms.ModelList, {"object": "list", "data": [base, *(
            {**base, "id": lora.name, "root": lora.path, "parent": parent}
            for lora, parent in self.served.adapters(info))]})

    async def version(self, request: web.Request) -> web.Response:
        """pagedserve's version (its package metadata), as vLLM's ``GET /version``."""
        return json_response(ms.Version, {"version": importlib.metadata.version("pagedserve")})

    async def usage_report(self, request: web.Request) -> web.Response:
        """GET /v1/usage: tokens per key and day (``usage.routes``; admin key only)."""
        return await usage_report(request, self.usage)

    async def tokenize(self, request: web.Request) -> web.Response:
        """POST /tokenize (vLLM's): the ids a completion or chat request would send."""
        return await self._text(request, tokenization.tokenize, ms.TokenizeRequest,
                                ms.TokenizeResponse)

    async def detokenize(self, request: web.Request) -> web.Response:
        """POST /detokenize (vLLM's): the text of token ids."""
        return await self._text(request, tokenization.detokenize, ms.DetokenizeRequest,
                                ms.DetokenizeResponse)

    async def _text(self, request: web.Request, fn, model, answer_model) -> web.Response:
        body, info = await self._body(request)
        check_body(model, body)
        if len(await request.read()) > INLINE_PREPARE_BYTES:  # keep the loop free
            answer = await asyncio.to_thread(fn, body, self.tokenizer, info)
        else:
            answer = fn(body, self.tokenizer, info)
        return json_response(answer_model, answer)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions: one prompt or a batch, echo, best_of
        (``openai.completions``)."""
        body, info = await self._body(request)
        check_body(cs.CompletionRequest, body)
        parsed = parse_completion(body)
        structured_param = error_param(body)
        client_id = request.headers.get(REQUEST_ID_HEADER, "")
        request_id = client_id or "cmpl-" + uuid.uuid4().hex
        entry: RequestLog = request[_LOG]
        entry.request_id = request_id
        request_id_var.set(request_id)
        try:
            if len(await request.read()) > INLINE_PREPARE_BYTES:  # keep the loop free
                call = await asyncio.to_thread(CompletionCall.prepare, parsed, request_id,
                                               self.tokenizer, info, self.max_logprobs,
                                               request.get(_LORA))
            else:
                call = CompletionCall.prepare(parsed, request_id, self.tokenizer, info,
                                              self.max_logprobs, request.get(_LORA))
        except RequestError as e:
            raise from_error(e, "prompt") from None
        for prepared in call.prepared:
            entry.accepted(prepared)
        entry.request_id = request_id
        entry.prompt_tokens = sum(len(p.prompt_token_ids) for p in call.prepared)
        if not client_id:
            call.id = request_id
        headers = {REQUEST_ID_HEADER: request_id}
        async with contextlib.aclosing(call.responses(
                self.engine, self.tokenizer, max_pending=self.max_stream_buffer)) as responses:
            if parsed.stream:
                return await self._stream(request, responses, call, parsed.include_usage,
                                          "prompt", structured_param, headers)
            try:
                async for r in responses:
                    entry.observe(r)
                    call.add(r)
            except EngineError as e:  # e.g. an invalid grammar (before any message)
                raise from_error(e, "prompt", structured_param) from None
            return json_response(cs.CompletionResponse, call.response(), headers=headers)

    async def embeddings(self, request: web.Request) -> web.Response:
        """POST /v1/embeddings: one vector per input (``openai.embeddings``, then the same
        ``prepare_embed`` / ``run_embed`` as gRPC Embed)."""
        body, info = await self._body(request)
        check_body(es.EmbeddingRequest, body)
        if request.get(_LORA) is not None:
            raise bad_request(f"model: LoRA adapter {body['model']!r} does not embed (adapters "
                              "run on generation only)", "model")
        parsed, encoding_format = parse_embedding(body)
        parsed.request_id = request.headers.get(REQUEST_ID_HEADER, "")
        entry: RequestLog = request[_LOG]
        try:
            if len(await request.read()) > INLINE_PREPARE_BYTES:  # keep the loop free
                prepared = await asyncio.to_thread(prepare_embed, parsed, self.tokenizer, info,
                                                   one_list=is_one_token_list(body))
            else:
                prepared = prepare_embed(parsed, self.tokenizer, info,
                                         one_list=is_one_token_list(body))
        except RequestError as e:
            raise embedding_error(e) from None
        entry.request_id = prepared.request_id
        request_id_var.set(prepared.request_id)
        entry.prompt_tokens = sum(map(len, prepared.prompts))
        charge_tokens(entry.prompt_tokens)  # (the key's tokens_per_minute)
        try:
            vectors = await run_embed(self.engine, prepared)
        except EngineError as e:
            raise from_error(e, "input") from None
        return json_response(
            es.EmbeddingResponse,
            embedding_response(prepared, vectors, encoding_format, info.model),
            headers={REQUEST_ID_HEADER: prepared.request_id})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        return await self._generate(request)

    # ---- one request --------------------------------------------------------------------
    def _info(self) -> engine_pb2.GetEngineInfoResponse:
        """The engine's info, ``model`` being the reported served name.

        Raises:
            OpenAIError: 503 while no scheduler replica can serve.
        """
        if self.engine.info is None:
            raise OpenAIError(503, "router is connecting to its scheduler", "server_error",
                              code="unavailable")
        if not self.engine.serving.is_set():
            raise OpenAIError(503, self.engine.unavailable_reason(), "server_error",
                              code="unavailable")
        return self.served.info(self.engine.info)

    async def _body(self, request: web.Request) -> tuple[dict, engine_pb2.GetEngineInfoResponse]:
        """The request's JSON object and the engine's info, the model checked: a LoRA
        adapter's name is kept in ``request[_LORA]`` and is then the info's ``model``.

        Raises:
            OpenAIError: 400 not a JSON object, 404 another model, 503 no engine.
        """
        try:
            body = await request.json()
        except ValueError:  # also a body that is not UTF-8 (UnicodeDecodeError)
            raise bad_request("the request body is not valid JSON") from None
        except RecursionError:  # e.g. [[[[...]]]] thousands deep: json's recursion limit
            raise bad_request("the request body is not valid JSON: nested too deeply") from None
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        info = self._info()
        model = body.get("model")
        if not (model is None or isinstance(model, str)):
            raise bad_request(f"model must be a string, got {json.dumps(model)}"[:200], "model")
        try:
            lora = self.served.resolve(model, info)
        except RequestError as e:
            raise OpenAIError(404, e.message, param="model", code="model_not_found") from None
        if lora is not None:
            request[_LORA] = lora
        return body, self.served.for_adapter(info, lora)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        """A chat completion."""
        body, info = await self._body(request)
        check_body(cs.ChatCompletionRequest, body)
        parsed = parse_chat(body, self.tool_parser, max_logprobs=(
            self.max_logprobs if self.max_logprobs >= 0 else info.vocab_size))
        client_id = request.headers.get(REQUEST_ID_HEADER, "")
        prepared = await self._prepare(request, parsed, info, "chatcmpl-" + uuid.uuid4().hex)
        entry: RequestLog = request[_LOG]
        builder = ResponseBuilder(True, info.model, prepared.n, self.tokenizer,
                                  tool_calls=parsed.tool_calls, options=parsed.options,
                                  prompt_tokens=len(prepared.prompt_token_ids),
                                  reasoning=self._reasoning(parsed.chat_template_kwargs,
                                                            parsed.include_reasoning, prepared))
        if not client_id:
            builder.id = prepared.request_id
        headers = {REQUEST_ID_HEADER: prepared.request_id}
        # NOTE: aclosing: however the handler ends (client gone, error), the generator is
        # closed, and its clean-up aborts every engine request still running.
        async with contextlib.aclosing(stream_responses(
                self.engine, self.tokenizer, prepared,
                max_pending=self.max_stream_buffer)) as responses:
            if parsed.stream:
                return await self._stream(request, responses, builder, parsed.include_usage,
                                          parsed.prompt_param, parsed.structured_param, headers)
            try:
                async for r in responses:
                    entry.observe(r)
                    builder.add(r)
            except EngineError as e:  # e.g. an invalid grammar (before any message)
                raise from_error(e, parsed.prompt_param,
                                  parsed.structured_param) from None
            return json_response(cs.ChatCompletionResponse, builder.response(), headers=headers)

    async def _prepare(self, request: web.Request, parsed: ParsedRequest,
                       info: engine_pb2.GetEngineInfoResponse, default_id: str,
                       errors: Callable[[OpenAIError], OpenAIError] = lambda e: e
                       ) -> PreparedRequest:
        """Validate and tokenize a chat request (on a thread when the body is large), named by
        the client's X-Request-Id or else ``default_id``, and record it in the access log.

        Raises:
            OpenAIError: 400 naming the field (through ``errors``, e.g. a renaming).
        """
        # NOTE: without X-Request-Id the request is named by the response's id, so a client can
        # find its request in the logs; validated by prepare (at most 128 characters).
        parsed.request.request_id = request.headers.get(REQUEST_ID_HEADER, "") or default_id
        entry: RequestLog = request[_LOG]
        entry.request_id = parsed.request.request_id
        request_id_var.set(entry.request_id)
        try:
            # len(read()): the body already read (cached), also when it came chunked
            if len(await request.read()) > INLINE_PREPARE_BYTES:  # keep the loop free
                prepared = await asyncio.to_thread(prepare, parsed.request, self.tokenizer, info,
                                                   max_logprobs=self.max_logprobs,
                                                   lora=request.get(_LORA))
            else:
                prepared = prepare(parsed.request, self.tokenizer, info,
                                   max_logprobs=self.max_logprobs, lora=request.get(_LORA))
        except RequestError as e:
            raise errors(from_error(e, parsed.prompt_param,
                                     parsed.structured_param)) from None
        entry.accepted(prepared)
        return prepared

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/responses: the Responses API on the chat path (``openai.responses_input``
        maps the request, ``openai.responses_api`` shapes the answer)."""
        body, info = await self._body(request)
        check_body(rs.ResponsesRequest, body)
        parsed = parse_responses(body, self.tool_parser, self.responses_store)
        chat = parsed.chat
        response_id = new_response_id()
        prepared = await self._prepare(request, chat, info, response_id,
                                       rename)
        reasoning = self._reasoning(chat.chat_template_kwargs, chat.include_reasoning, prepared)
        events = ResponseEvents(info.model, parsed.echo, chat.tool_calls,
                                reasoning.splitter if reasoning is not None else None,
                                response_id=response_id)
        headers = {REQUEST_ID_HEADER: prepared.request_id}
        entry: RequestLog = request[_LOG]
        async with contextlib.aclosing(stream_responses(
                self.engine, self.tokenizer, prepared,
                max_pending=self.max_stream_buffer)) as responses:
            try:
                first = await anext(responses, None)
                if not chat.stream:
                    r = first
                    while r is not None:
                        entry.observe(r)
                        events.feed(r)
                        r = await anext(responses, None)
                    self._keep(parsed, events)
                    return json_response(rs.ResponseObject, events.response(), headers=headers)
            except EngineError as e:  # e.g. an invalid grammar (before any message)
                raise rename(from_error(e, "input", chat.structured_param)) from None
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache", **headers})
            await resp.prepare(request)
            for event in events.start():
                await resp.write(_event(event))
            try:
                r = first
                while r is not None:
                    entry.observe(r)
                    for event in events.feed(r):
                        await resp.write(_event(event))
                    r = await anext(responses, None)
                self._keep(parsed, events)
            except EngineError as e:
                entry.error = e.code.name
                err = rename(from_error(e, "input", chat.structured_param))
                await resp.write(_event(events.error(err.message, err.code, err.param)))
            await resp.write_eof()
            return resp

    def _keep(self, parsed: ParsedResponses, events: ResponseEvents) -> None:
        """Store a finished answer when the request asked for it (``store``)."""
        if parsed.store and self.responses_store is not None:
            self.responses_store.put(events.response(), parsed.messages)

    async def stored_response(self, request: web.Request) -> web.Response:
        """GET /v1/responses/{response_id}: a stored answer (404 when it is not stored)."""
        response_id = request.match_info["response_id"]
        entry = self.responses_store.get(response_id) if self.responses_store else None
        if entry is None:
            raise OpenAIError(404, f"No response with id {response_id!r} is stored by this "
                              "router", param="response_id", code="not_found")
        return json_response(rs.ResponseObject, entry.response)

    def _reasoning(self, chat_template_kwargs: dict, include: bool,
                   prepared: PreparedRequest) -> ReasoningOptions | None:
        """How a chat request's output is split (``openai.reasoning``); None without
        ``--reasoning-parser``. A grammar then applies after the reasoning: sets
        ``prepared.params.reasoning_end_token_id`` (``reasoning.constrain_after``)."""
        if self.reasoning_parser is None:
            return None
        if not self._think_ids_known:
            self._think_ids, self._think_ids_known = tag_ids(self.tokenizer), True
        ends = prompt_ends_reasoning(prepared.prompt_token_ids, self._think_ids)
        options = ReasoningOptions(starts_in_reasoning(self.reasoning_parser,
                                                       chat_template_kwargs, ends), include)
        options, end = constrain_after(options, self._think_ids,
                                       prepared.structured_outputs is not None)
        if end is not None:
            prepared.params = replace(prepared.params, reasoning_end_token_id=end)
        return options

    async def _stream(self, request: web.Request, responses,
                      builder: ResponseBuilder | CompletionCall, usage: bool,
                      prompt_param: str, structured_param: str, headers: dict
                      ) -> web.StreamResponse:
        """Server-sent events: role chunks (chat), one chunk per message with text or a
        finish_reason, the usage chunk if asked, ``data: [DONE]``. An engine error before the
        first message is a normal HTTP error (e.g. 429); after it, an ``error`` event."""
        try:
            first = await anext(responses, None)
        except EngineError as e:
            raise from_error(e, prompt_param, structured_param) from None
        entry: RequestLog = request[_LOG]
        model = cs.ChatStreamEvent if isinstance(builder, ResponseBuilder) else \
            cs.CompletionStreamEvent
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache", **headers})
        await resp.prepare(request)
        for role_chunk in builder.role_chunks(usage):
            await resp.write(sse(role_chunk, model))
        try:
            r = first
            while r is not None:
                entry.observe(r)
                chunk = builder.chunk(r, usage)
                if chunk is not None:
                    await resp.write(sse(chunk, model))
                r = await anext(responses, None)
            if usage:
                await resp.write(sse(builder.usage_chunk(), model))
        except EngineError as e:
            entry.error = e.code.name
            await resp.write(sse(from_error(e, prompt_param,
                                            structured_param).body(), model))
        await resp.write(sse("[DONE]"))
        await resp.write_eof()
        return resp
