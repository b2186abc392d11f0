"""Optional API keys on the router's public gRPC API and OpenAI-compatible HTTP API.

``--api-key KEY[,KEY2,...]`` (env ``PAGEDSERVE_API_KEY``) turns the check on. Every public call
must then carry ``authorization: Bearer <key>`` (gRPC metadata, or the HTTP ``Authorization``
header) with one of the keys; a missing or wrong key is gRPC UNAUTHENTICATED / HTTP 401. gRPC
health checking, reflection and HTTP ``GET /health`` and ``GET /metrics`` stay open, so probes,
scrapers and grpcurl need no key.

A presented key is compared with every configured key by ``hmac.compare_digest`` and without
stopping at the first match, so the time taken does not tell how much of a key was right or
which key matched. Keys are never logged: ``ApiKeys`` prints as the number of keys.
"""

from __future__ import annotations

import argparse
import hmac

import grpc
from aiohttp import web

from services.common.config import add_flag

# Methods that need no key: health checking and server reflection (both versions).
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                        "/grpc.reflection.v1.ServerReflection/")
OPEN_HTTP_PATHS = frozenset({"/health", "/metrics"})  # (probes and scrapers)
METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
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
    ``authorization: Bearer <key>`` with an accepted key (gRPC UNAUTHENTICATED otherwise)."""

    def __init__(self, keys: ApiKeys):
        self.keys = keys

    async def intercept_service(self, continuation, handler_call_details):
        """The method's own handler for open methods and accepted keys, else one that aborts
        with UNAUTHENTICATED (same streaming kind, so grpc can run it)."""
        method = handler_call_details.method or ""
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        why = self.keys.check(_metadata_value(handler_call_details.invocation_metadata,
                                              METADATA_KEY))
        handler = await continuation(handler_call_details)
        if why is None or handler is None:  # unknown method: let grpc say UNIMPLEMENTED
            return handler
        return _refusing(handler, why)


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


def http_middleware(keys: ApiKeys):
    """An aiohttp middleware answering 401 (OpenAI's error body, ``WWW-Authenticate: Bearer``)
    to a request without an accepted ``Authorization: Bearer <key>``; ``/health`` and
    ``/metrics`` are open."""
    @web.middleware
    async def check_api_key(request: web.Request, handler):
        if request.path not in OPEN_HTTP_PATHS:
            why = keys.check(request.headers.get("Authorization"))
            if why is not None:
                return web.json_response(
                    {"error": {"message": why, "type": "invalid_request_error", "param": None,
                               "code": "invalid_api_key"}},
                    status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)
    return check_api_key
