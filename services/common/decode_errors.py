"""A server interceptor that answers a request message that does not parse with
INVALID_ARGUMENT, not UNKNOWN.

grpc.aio calls the request deserializer (``Message.FromString``) itself, before any servicer
code runs; when it raises (corrupt wire format, a string field that is not UTF-8, a truncated
message) the call ends with UNKNOWN "Unexpected [DecodeError] raised by servicer method" and
an error-level traceback in the log. That is the client's fault, so this interceptor swaps in
a deserializer that never raises (it returns an ``_Undecodable`` marker) and a behaviour that
aborts such calls with INVALID_ARGUMENT naming the message type and what is wrong.
"""

from __future__ import annotations

import inspect

import grpc


class _Undecodable:
    """Stands for a request message that did not parse; ``error`` says why."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def _lenient(deserializer):
    def deserialize(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError (and any other)
            return _Undecodable(e)
    return deserialize


async def _abort(context, request: _Undecodable, method: str) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request of {method} is not a valid protobuf message: "
                        f"{request.error}")


def _unary_stream(behavior, method: str):
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            if isinstance(request, _Undecodable):
                await _abort(context, request, method)
            async for response in behavior(request, context):
                yield response
        return stream

    async def writer(request, context):  # a coroutine that writes with context.write
        if isinstance(request, _Undecodable):
            await _abort(context, request, method)
        return await behavior(request, context)
    return writer


def _unary_unary(behavior, method: str):
    async def unary(request, context):
        if isinstance(request, _Undecodable):
            await _abort(context, request, method)
        return await behavior(request, context)
    return unary


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """INVALID_ARGUMENT for unary-request methods whose request message does not parse
    (request-streaming methods are left as they are)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        deserializer = _lenient(handler.request_deserializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                _unary_stream(handler.unary_stream, method), request_deserializer=deserializer,
                response_serializer=handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            _unary_unary(handler.unary_unary, method), request_deserializer=deserializer,
            response_serializer=handler.response_serializer)
