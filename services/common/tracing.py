"""OpenTelemetry tracing of requests, shared by the three services (off by default).

On when ``--otlp-traces-endpoint`` (vLLM's flag; ``PAGEDSERVE_OTLP_TRACES_ENDPOINT``) is set,
or else one of the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_ENDPOINT`` variables, unless ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none``. ``setup`` then builds one ``TracerProvider`` for the process
(resource ``service.name`` pagedserve-router / -scheduler / -worker unless
``OTEL_SERVICE_NAME`` or ``OTEL_RESOURCE_ATTRIBUTES`` name it) with a ``BatchSpanProcessor``
(its ``OTEL_BSP_*`` variables) and the OTLP/gRPC ``OTLPSpanExporter`` (its
``OTEL_EXPORTER_OTLP_*`` variables: headers, timeout, certificate ...; an ``http://`` endpoint
is plaintext, as in vLLM); the sampler is the SDK's ``OTEL_TRACES_SAMPLER`` (default
parentbased_always_on). Spans are exported on the processor's thread: a slow or absent
collector costs the serving path nothing (spans beyond the processor's queue are dropped).

Off, no provider exists and ``tracer()`` is None: the services' hot paths check that (or an
empty traceparent) and do nothing else.

Between processes the context is a W3C ``traceparent`` (https://www.w3.org/TR/trace-context/),
parsed and written by OpenTelemetry's ``TraceContextTextMapPropagator``: the client's HTTP
header or gRPC metadata at the router, ``SubmitRequest.traceparent`` to the scheduler and
``StepRequest.traceparents`` to the workers (docs/architecture.md, "Tracing").

NOTE: the provider is this module's, not OpenTelemetry's global one (which can be set only
once per process): tests and the in-process stack set tracing up more than once.
"""

from __future__ import annotations

import argparse
import logging
import os
from urllib.parse import urlparse

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.common.config import add_flag

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"  # the W3C header and gRPC metadata key
_PROPAGATOR = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None
_tracer: trace.Tracer | None = None

# Span attribute names: OpenTelemetry's gen_ai semantic conventions where one exists
# (opentelemetry-semantic-conventions, gen_ai_attributes), else ours under "pagedserve.".
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_TOP_K = "gen_ai.request.top_k"
GEN_AI_REQUEST_SEED = "gen_ai.request.seed"
GEN_AI_REQUEST_CHOICES = "gen_ai.request.choice.count"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"


def add_tracing_flags(p: argparse.ArgumentParser) -> None:
    """``--otlp-traces-endpoint`` (vLLM's flag), on every service and ``pagedserve serve``."""
    add_flag(p, "--otlp-traces-endpoint", type=endpoint_flag, default=None,
             help="send OpenTelemetry traces of requests to this OTLP/gRPC receiver, e.g. "
                  "http://127.0.0.1:4317 (http:// is plaintext); without it the standard "
                  "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT turn "
                  "tracing on; the other OTEL_* variables (OTEL_SERVICE_NAME, "
                  "OTEL_TRACES_SAMPLER, OTEL_BSP_*, ...) are honoured (default: off)")


def endpoint_flag(text: str) -> str:
    """argparse type of ``--otlp-traces-endpoint``: ``http(s)://host:port`` or ``host:port``.

    Raises:
        argparse.ArgumentTypeError: another scheme, or no host and port.
    """
    parsed = urlparse(text if "://" in text else f"//{text}")
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme not in ("", "http", "https") or not parsed.hostname or port is None:
        raise argparse.ArgumentTypeError(
            f"not an OTLP/gRPC endpoint: {text!r} (e.g. http://127.0.0.1:4317 or host:4317)")
    return text


def traces_endpoint(flag: str | None) -> str | None:
    """Where traces go: the flag, else the standard variables; None = tracing off (neither
    set, or ``OTEL_SDK_DISABLED=true``, or ``OTEL_TRACES_EXPORTER=none``)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return None
    return (flag or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None)


def setup(flag: str | None, service: str, exporter: SpanExporter | None = None) -> bool:
    """Turn tracing on for this process when asked (see the module docstring); returns
    whether it is on. A second call replaces the first set-up (shut down first).

    Args:
        flag: ``--otlp-traces-endpoint`` (None: the environment decides).
        service: ``service.name`` unless the environment names one (e.g. pagedserve-router).
        exporter: export there instead of OTLP (tests: an ``InMemorySpanExporter``); turns
            tracing on whatever the flag and environment say.

    Raises:
        ValueError: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (or ``OTEL_EXPORTER_OTLP_PROTOCOL``)
            asks for another protocol than grpc (only the gRPC exporter is installed).
    """
    global _provider, _tracer
    shutdown()
    endpoint = traces_endpoint(flag)
    if exporter is None and endpoint is None:
        return False
    if exporter is None:
        protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                    or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc")
        if protocol != "grpc":
            raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: only grpc is "
                             "supported (opentelemetry-exporter-otlp-proto-grpc)")
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter(
            endpoint=flag, insecure=True if (flag or endpoint or "").startswith("http://")
            else None)
    resource = Resource.create()  # OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service}))
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("pagedserve")
    log.info("tracing on: %s as %s", endpoint or type(exporter).__name__,
             resource.attributes.get(SERVICE_NAME))
    return True


def tracer() -> trace.Tracer | None:
    """This process's tracer, or None while tracing is off."""
    return _tracer


def force_flush(timeout_s: float = 10.0) -> bool:
    """Export the spans ended so far now (tests); True when done in time (or off)."""
    return _provider is None or _provider.force_flush(int(timeout_s * 1000))


def shutdown() -> None:
    """Flush and stop the exporter (at exit); tracing is off afterwards. Does nothing when
    off."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def context_from(traceparent: str) -> otel_context.Context:
    """The context whose remote parent is ``traceparent`` (a W3C header value); an
    unparsable one gives an empty context (a new trace), as the W3C spec asks."""
    return _PROPAGATOR.extract({TRACEPARENT: traceparent})


def traceparent_of(span: trace.Span) -> str:
    """``span``'s W3C traceparent ("" for an invalid, e.g. non-recording, span)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span))
    return carrier.get(TRACEPARENT, "")


def current_traceparent() -> str:
    """The traceparent of the current span (this task's context): "" when tracing is off or
    no span is current. What the router sends the scheduler."""
    if _tracer is None:
        return ""
    return traceparent_of(trace.get_current_span())
