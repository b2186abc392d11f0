"""Optional API keys on the router's public gRPC API and OpenAI-compatible HTTP API.

``--api-key KEY[,KEY2,...]`` (env ``PAGEDSERVE_API_KEY``) turns the check on. Every public call
must then carry ``authorization: Bearer <key>`` (gRPC metadata, or the HTTP ``Authorization``
header; over HTTP also ``x-api-key: <key>``, as Anthropic's clients send it) with one of the
keys; a missing or wrong key is gRPC UNAUTHENTICATED / HTTP 401. gRPC health checking,
reflection and HTTP ``GET /health``, ``GET /metrics`` and ``GET /openapi.json`` stay open, so
probes, scrapers, grpcurl and client generators need no key.

A presented key is compared with every configured key by ``hmac.compare_digest`` and without
stopping at the first match, so the time taken does not tell how much of a key was right or
which key matched. Keys are never logged: ``ApiKeys`` prints as the number of keys.

With ``--api-keys-file`` (``services.router.api_keys_file.KeyRing``) the edge also learns which
key called: it sets ``callers.caller_var`` for the request (in the handler's own context) and
admits the requests that do engine work against the key's limits (``services.router.quotas``):
HTTP 429 with ``Retry-After`` / gRPC RESOURCE_EXHAUSTED with ``retry-after`` metadata.
"""

from __future__ import annotations

import argparse
import hmac
import inspect

import grpc
from aiohttp import web

from services.common.config import add_flag
from services.router.callers import Caller, caller_var
from services.router.quotas import QUOTA_METHODS, QUOTA_PATHS, QuotaExceeded, Quotas

# Methods that need no key: health checking and server reflection (both versions).
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                        "/grpc.reflection.v1.ServerReflection/")
OPEN_HTTP_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})  # (probes, scrapers)
METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
X_API_KEY = "x-api-key"  # HTTP header carrying the bare key (Anthropic's clients)
MISSING = "missing API key: send the header 'authorization: Bearer <key>'"
INVALID = "invalid API key"


class ApiKeys:
    """The accepted keys, parsed from ``KEY[,KEY2,...]`` (blanks around commas ignored).

    Its ``str``/``repr`` never show a key (argparse's ``--help`` prints defaults, and a
    namespace may be logged).

    Raises:
        argparse.ArgumentTypeError: no key in the text.
    """

    __slots__ = ("_keys",)

    def __init__(self, text: str):
        keys = tuple(k.strip() for k in text.split(",") if k.strip())
        if not keys:
            raise argparse.ArgumentTypeError("--api-key needs at least one non-empty key")
        self._keys = tuple(k.encode() for k in keys)

    def __repr__(self) -> str:
        return f"<{len(self._keys)} API key{'s' if len(self._keys) > 1 else ''}, redacted>"

    __str__ = __repr__

    def __len__(self) -> int:
        return len(self._keys)

    def as_flag_value(self) -> str:
        """The keys joined by commas again (to hand them to a child process's environment)."""
        return ",".join(k.decode() for k in self._keys)

    def matches(self, presented: str | bytes | None) -> bool:
        """Whether ``presented`` is one of the keys, in time independent of which key matched
        or how many leading characters were right."""
        if presented is None:
            return False
        if isinstance(presented, str):
            presented = presented.encode()
        ok = False
        for key in self._keys:  # NOTE: no early exit: every key is compared
            ok |= hmac.compare_digest(presented, key)
        return ok

    def check(self, authorization: str | bytes | None) -> str | None:
        """None when the ``Authorization`` value carries a valid key, else why not (a message
        that never contains the key)."""
        token = bearer_token(authorization)
        if token is None:
            return MISSING
        return None if self.matches(token) else INVALID

    quotas: Quotas | None = None  # (``--api-key`` keys have no limits)

    def identify(self, authorization: str | bytes | None) -> Caller | str:
        """The caller (id "default") when the ``Authorization`` value carries a valid key, else
        why not."""
        why = self.check(authorization)
        return Caller("default") if why is None else why


def bearer_token(authorization: str | bytes | None) -> str | None:
    """The token of ``Bearer <token>`` (scheme case-insensitive), or None."""
    if authorization is None:
        return None
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def add_api_key_flag(p: argparse.ArgumentParser) -> None:
    """``--api-key`` (env ``PAGEDSERVE_API_KEY``)."""
    add_flag(p, "--api-key", type=ApiKeys, default=None,
             help="require 'authorization: Bearer <key>' on every public gRPC call and HTTP "
                  "request (several keys: comma-separated); health and reflection stay open")


def _metadata_value(metadata, key: str):
    for k, v in metadata or ():
        if k == key:
            return v
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health checking and reflection unless its metadata carries
    ``authorization: Bearer <key>`` with an accepted key (gRPC UNAUTHENTICATED otherwise);
    an accepted call runs as its key's ``Caller``, admitted against its limits.

    ``keys``: ``ApiKeys`` or ``api_keys_file.KeyRing`` (``identify``, ``quotas``)."""

    def __init__(self, keys):
        self.keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        """The method's own handler for open methods and accepted keys, else one that aborts
        with UNAUTHENTICATED (same streaming kind, so grpc can run it)."""
        method = handler_call_details.method or ""
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        caller = self.keys.identify(_metadata_value(handler_call_details.invocation_metadata,
                                                    METADATA_KEY))
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: let grpc say UNIMPLEMENTED
            return handler
        if isinstance(caller, str):
            return _refusing(handler, caller)
        quotas = self.keys.quotas if method in QUOTA_METHODS else None
        return _as_caller(handler, caller, quotas)


def _refusing(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that aborts with UNAUTHENTICATED."""
    async def refuse(_request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)


def _as_caller(handler: grpc.RpcMethodHandler, caller: Caller, quotas: Quotas | None
               ) -> grpc.RpcMethodHandler:
    """``handler`` run as ``caller`` (``caller_var``, set in the handler's own context) and,
    with ``quotas``, admitted against the caller's limits first (RESOURCE_EXHAUSTED with
    trailing metadata ``retry-after`` when over one); the admission lasts until the call ends,
    however it ends."""
    async def refuse(context, e: QuotaExceeded):
        context.set_trailing_metadata((("retry-after", str(e.retry_after)),))
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, e.message)

    def wrap_unary(behavior):
        async def run(request_or_iterator, context):
            caller_var.set(caller)
            if quotas is None:
                return await behavior(request_or_iterator, context)
            try:
                with quotas.admit(caller.key_id):
                    return await behavior(request_or_iterator, context)
            except QuotaExceeded as e:
                await refuse(context, e)
        return run

    def wrap_streaming(behavior):
        async def run(request_or_iterator, context):
            caller_var.set(caller)
            admitted = None
            if quotas is not None:
                try:
                    admitted = quotas.acquire(caller.key_id)
                except QuotaExceeded as e:
                    await refuse(context, e)
            try:
                responses = behavior(request_or_iterator, context)
                if inspect.isasyncgen(responses):
                    async for response in responses:
                        yield response
                else:  # a coroutine that writes with context.write
                    await responses
            finally:
                if quotas is not None:
                    quotas.release(admitted)
        return run

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(wrap_streaming(handler.stream_stream),
                                                     **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary), **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(wrap_streaming(handler.unary_stream),
                                                    **kwargs)
    return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), **kwargs)


def quota_response(path: str, e: QuotaExceeded) -> web.Response:
    """HTTP 429 for ``e``: OpenAI's error body (Anthropic's on ``/v1/messages``) and
    ``Retry-After``."""
    body = e.anthropic_body() if path.startswith("/v1/messages") else e.openai_body()
    return web.json_response(body, status=429, headers={"Retry-After": str(e.retry_after)})


def http_middleware(keys):
    """An aiohttp middleware answering 401 (OpenAI's error body, Anthropic's on
    ``/v1/messages*``; ``WWW-Authenticate: Bearer``) to a request without an accepted
    ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (Anthropic's clients); ``/health``
    and ``/metrics`` are open. An accepted request runs as its key's ``Caller``; a POST to one of
    ``quotas.QUOTA_PATHS`` is admitted against its limits first (429 when over one).

    ``keys``: ``ApiKeys`` or ``api_keys_file.KeyRing`` (``identify``, ``quotas``)."""
    @web.middleware
    async def check_api_key(request: web.Request, handler):
        if request.path in OPEN_HTTP_PATHS:
            return await handler(request)
        caller = keys.identify(request.headers.get("Authorization"))
        x_api_key = request.headers.get(X_API_KEY)  # (Anthropic's clients send this)
        if isinstance(caller, str) and x_api_key is not None:
            caller = keys.identify(f"Bearer {x_api_key.strip()}")
        if isinstance(caller, str):
            body: dict = (
                {"type": "error", "error": {"type": "authentication_error", "message": caller}}
                if request.path.startswith("/v1/messages") else
                {"error": {"message": caller, "type": "invalid_request_error", "param": None,
                           "code": "invalid_api_key"}})
            return web.json_response(body, status=401, headers={"WWW-Authenticate": "Bearer"})
        caller_var.set(caller)
        if keys.quotas is None or request.method != "POST" or request.path not in QUOTA_PATHS:
            return await handler(request)
        try:
            admitted = keys.quotas.acquire(caller.key_id)
        except QuotaExceeded as e:
            return quota_response(request.path, e)
        try:
            return await handler(request)
        finally:
            keys.quotas.release(admitted)
    return check_api_key
