"""The router's spans of a generation request (services/common/tracing.py sets tracing up).

- An ingress span (kind SERVER) per public call: ``POST /v1/chat/completions`` (and the other
  generation routes) or ``pagedserve.v1.GenerationService/Generate`` (and ``Chat``),
  continuing the client's W3C ``traceparent`` (HTTP header or gRPC metadata; none, or an
  unparsable one: a new trace). It is the current span while the call runs, so the
  scheduler's spans are its children: ``EngineClient.submit`` sends its traceparent in
  ``SubmitRequest.traceparent``. At its end: usage, finish reasons and the response id, from
  the call's access log entry (``generation.RequestLog``).
- ``router.validate_and_tokenize``, its child: ``generation.prepare`` (also on a thread: the
  context is copied), after which the request's ``gen_ai.request.*`` attributes are set on the
  ingress span.

While tracing is off none of this is installed (the HTTP middleware) or it returns at once
(``traced_prepare``, ``ingress``: a None check).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from aiohttp import web
from opentelemetry import context as otel_context
from opentelemetry import trace

from services.common import tracing as t
from services.common.finish_reason import FinishReason

# the HTTP routes that get an ingress span, and their gen_ai.operation.name
HTTP_OPERATIONS = {"/v1/chat/completions": "chat", "/v1/responses": "chat",
                   "/v1/completions": "text_completion"}


@contextlib.contextmanager
def ingress(name: str, traceparent: str, attributes: dict[str, Any],
            entry: Any = None) -> Iterator[trace.Span | None]:
    """The ingress span ``name`` (child of ``traceparent``, "" = a new trace) as the current
    span while the block runs; an exception out of the block marks it an error. ``entry``
    (a ``generation.RequestLog``, or None) gives its usage at the end. Yields None (and does
    nothing) while tracing is off."""
    tracer = t.tracer()
    if tracer is None:
        yield None
        return
    span = tracer.start_span(name, context=t.context_from(traceparent),
                             kind=trace.SpanKind.SERVER, attributes=attributes)
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield span
    except Exception as e:
        span.record_exception(e)
        span.set_status(trace.StatusCode.ERROR, f"{type(e).__name__}: {e}")
        raise
    finally:
        if entry is not None:
            _record_usage(span, entry)
        span.end()
        otel_context.detach(token)


def _record_usage(span: trace.Span, entry: Any) -> None:
    """The call's usage from its access log entry (``generation.RequestLog``)."""
    attributes: dict[str, Any] = {t.GEN_AI_USAGE_INPUT_TOKENS: entry.prompt_tokens,
                                  t.GEN_AI_USAGE_OUTPUT_TOKENS: entry.completion_tokens}
    if entry.request_id:
        attributes[t.GEN_AI_RESPONSE_ID] = entry.request_id
    if entry.finish_reasons:
        attributes[t.GEN_AI_RESPONSE_FINISH_REASONS] = [
            str(FinishReason(entry.finish_reasons[i])) for i in sorted(entry.finish_reasons)]
    span.set_attributes(attributes)


def grpc_ingress(method: str, context, entry: Any) -> contextlib.AbstractContextManager:
    """``ingress`` for a public gRPC call (``method``: e.g. ``Generate``), continuing the
    ``traceparent`` metadata; a no-op context while tracing is off."""
    if t.tracer() is None:
        return contextlib.nullcontext()
    metadata = dict(context.invocation_metadata() or ())
    return ingress(f"pagedserve.v1.GenerationService/{method}",
                   metadata.get(t.TRACEPARENT, ""),
                   {"rpc.system": "grpc", "rpc.service": "pagedserve.v1.GenerationService",
                    "rpc.method": method,
                    t.GEN_AI_OPERATION: "chat" if method == "Chat" else "text_completion"},
                   entry)


def http_middleware(entry_of: Callable[[web.Request], Any]):
    """aiohttp middleware: ``ingress`` around the generation routes (``HTTP_OPERATIONS``),
    continuing the ``traceparent`` header; ``entry_of(request)``: its access log entry.
    Installed only while tracing is on."""
    @web.middleware
    async def traced(request: web.Request, handler):
        operation = HTTP_OPERATIONS.get(request.path)
        if operation is None or request.method != "POST":
            return await handler(request)
        with ingress(f"POST {request.path}", request.headers.get(t.TRACEPARENT, ""),
                     {"http.request.method": "POST", "url.path": request.path,
                      "http.route": request.path, t.GEN_AI_OPERATION: operation},
                     entry_of(request)) as span:
            response = await handler(request)
            if span is not None:
                span.set_attribute("http.response.status_code", response.status)
            return response
    return traced


def traced_prepare(prepare: Callable) -> Callable:
    """Decorate ``generation.prepare``: while tracing is on it runs in the span
    ``router.validate_and_tokenize`` (an error in it is recorded there), and the request's
    ``gen_ai.request.*`` attributes go on the current (ingress) span."""
    @functools.wraps(prepare)
    def traced(request, tokenizer, info, **kwargs):
        tracer = t.tracer()
        if tracer is None:
            return prepare(request, tokenizer, info, **kwargs)
        parent = trace.get_current_span()
        with tracer.start_as_current_span("router.validate_and_tokenize") as span:
            prepared = prepare(request, tokenizer, info, **kwargs)
            span.set_attribute(t.GEN_AI_USAGE_INPUT_TOKENS, len(prepared.prompt_token_ids))
        p = prepared.params
        attributes: dict[str, Any] = {
            t.GEN_AI_REQUEST_MODEL: prepared.lora.name if prepared.lora else info.model,
            t.GEN_AI_REQUEST_TEMPERATURE: p.temperature, t.GEN_AI_REQUEST_TOP_P: p.top_p,
            t.GEN_AI_REQUEST_CHOICES: prepared.n, t.GEN_AI_RESPONSE_ID: prepared.request_id,
            t.GEN_AI_USAGE_INPUT_TOKENS: len(prepared.prompt_token_ids)}
        if p.max_tokens is not None:
            attributes[t.GEN_AI_REQUEST_MAX_TOKENS] = p.max_tokens
        if p.top_k > 0:
            attributes[t.GEN_AI_REQUEST_TOP_K] = p.top_k
        if p.seed is not None and p.seed < 2**63:  # (an attribute is an int64)
            attributes[t.GEN_AI_REQUEST_SEED] = p.seed
        if prepared.priority:
            attributes["pagedserve.priority"] = prepared.priority
        if request.WhichOneof("input") == "chat":
            attributes[t.GEN_AI_OPERATION] = "chat"
        parent.set_attributes(attributes)
        return prepared
    return traced
