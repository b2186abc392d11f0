"""OpenTelemetry tracing across the three processes (``pagedserve serve``): one request with a
client ``traceparent`` (HTTP header, gRPC metadata) is one trace, the client's, whose spans
the router, scheduler and worker export to a real OTLP/gRPC receiver started here; the parent
links cross the processes (services/common/tracing.py, docs/architecture.md "Tracing")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from services.common.pb.pagedserve.v1 import api_pb2, api_pb2_grpc
from services.common.ports import free_ports

pytestmark = pytest.mark.slow
CLI = [sys.executable, "-m", "services.cli"]
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
PROMPT = " ".join(f"word{i}" for i in range(40))  # 110 tokens: several chunks


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: keeps every span with its resource's service.name."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []

    def Export(self, request, context):
        for rs in request.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes
                           if a.key == "service.name")
            self.spans += [(service, s) for ss in rs.scope_spans for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str, until: set[str], timeout: float = 20.0) -> dict:
        """The spans of ``trace_id`` once the ``until`` names are all there: name ->
        [(service, span)]."""
        deadline = time.monotonic() + timeout
        while True:
            spans: dict[str, list] = {}
            for service, s in list(self.spans):
                if s.trace_id.hex() == trace_id:
                    spans.setdefault(s.name, []).append((service, s))
            if until <= set(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rec = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    rec.port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield rec
    server.stop(0)


@pytest.fixture(scope="module")
def stack(receiver, tiny_model_dir):
    port, sport, wport, hport = free_ports(4)
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    proc = subprocess.Popen([
        *CLI, "serve", "--port", str(port), "--scheduler-port", str(sport), "--worker-port",
        str(wport), "--http-port", str(hport), "--metrics-port", "-1", "--model", tiny_model_dir,
        "--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-num-batched-tokens", "32",
        "--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.port}"],
        env=env, start_new_session=True)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while subprocess.run([*CLI, "health", "--address", address],
                         capture_output=True).returncode != 0:
        assert proc.poll() is None, f"serve exited early with {proc.returncode}"
        assert time.monotonic() < deadline, "stack not healthy in time"
        time.sleep(0.5)
    yield address, f"http://127.0.0.1:{hport}"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def _one(spans: dict, name: str, service: str):
    assert len(spans.get(name, [])) == 1, f"{name}: {spans.get(name)}"
    got, span = spans[name][0]
    assert got == service, f"{name} came from {got}, not {service}"
    return span


def _attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        kind = v.WhichOneof("value")
        out[a.key] = ([x.string_value for x in v.array_value.values] if kind == "array_value"
                      else getattr(v, kind))
    return out


def _check_engine_spans(spans: dict, ingress) -> int:
    """The scheduler's spans under the router's ingress span, the worker's under the chunks;
    returns the request's prefix-cache hit tokens."""
    sched = _one(spans, "scheduler.request", "pagedserve-scheduler")
    assert sched.parent_span_id == ingress.span_id
    for name in ("scheduler.queue", "scheduler.first_token", "scheduler.decode",
                 "scheduler.finish"):
        assert _one(spans, name, "pagedserve-scheduler").parent_span_id == sched.span_id, name
    chunks = [s for _, s in spans["scheduler.prefill_chunk"]]
    assert len(chunks) > 1  # (--max-num-batched-tokens 32 and the long-prefill cap)
    assert {s.parent_span_id for s in chunks} == {sched.span_id}
    spans_of = sorted((_attrs(c)["pagedserve.chunk.index"], _attrs(c)["pagedserve.chunk.start"],
                       _attrs(c)["pagedserve.chunk.tokens"]) for c in chunks)
    hit = _attrs(sched)["gen_ai.usage.cache_read.input_tokens"]  # the prefix-cache hit
    assert {_attrs(c)["pagedserve.prefix_cache.hit_tokens"] for c in chunks} == {hit}
    starts = [hit]
    for _, _, tokens in spans_of:
        starts.append(starts[-1] + tokens)
    assert [(i, start) for i, start, _ in spans_of] == list(enumerate(starts[:-1]))
    assert starts[-1] == _attrs(sched)["gen_ai.usage.input_tokens"]  # the rest of the prompt
    forwards = spans["worker.forward"]
    assert {service for service, _ in forwards} == {"pagedserve-worker"}
    assert sorted(s.parent_span_id for _, s in forwards) == sorted(c.span_id for c in chunks)
    decode = _attrs(spans["scheduler.decode"][0][1])
    assert decode["pagedserve.decode.output_tokens"] == 5
    assert decode["pagedserve.decode.steps"] == 4
    return hit


def test_one_http_request_is_one_trace_across_the_three_processes(stack, receiver):
    _, http_url = stack
    body = json.dumps({"model": "x", "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                       "ignore_eos": True}).encode()
    # (the served name: whatever the router reports)
    models = json.load(urllib.request.urlopen(f"{http_url}/v1/models", timeout=30))
    body = body.replace(b'"x"', json.dumps(models["data"][0]["id"]).encode())
    req = urllib.request.Request(f"{http_url}/v1/completions", data=body, headers={
        "Content-Type": "application/json",
        "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    answer = json.load(urllib.request.urlopen(req, timeout=60))
    assert answer["usage"]["completion_tokens"] == 5
    spans = receiver.trace(CLIENT_TRACE, {"POST /v1/completions", "scheduler.request",
                                          "worker.forward", "scheduler.finish"})
    ingress = _one(spans, "POST /v1/completions", "pagedserve-router")
    assert ingress.parent_span_id.hex() == CLIENT_SPAN  # the client's trace, continued
    a = _attrs(ingress)
    assert a["gen_ai.request.model"] == models["data"][0]["id"]
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"],
            a["gen_ai.usage.output_tokens"]) == (5, 0.0, 5)
    assert a["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["http.response.status_code"] == 200
    validate = _one(spans, "router.validate_and_tokenize", "pagedserve-router")
    assert validate.parent_span_id == ingress.span_id
    _check_engine_spans(spans, ingress)
    finish = _attrs(spans["scheduler.finish"][0][1])
    assert finish["gen_ai.response.finish_reasons"] == ["length"]
    assert finish["gen_ai.usage.output_tokens"] == 5


def test_grpc_generate_continues_the_traceparent_metadata(stack, receiver):
    """The same prompt twice, the second traced: its chunks start after the prefix-cache hit
    (whole blocks of the first) and say so."""
    address, _ = stack
    trace_id = "a" * 32
    request = api_pb2.GenerateRequest(prompt="grpc " + PROMPT, sampling_params=api_pb2.
                                      SamplingParams(max_tokens=5, temperature=0,
                                                     ignore_eos=True))
    with grpc.insecure_channel(address) as channel:
        stub = api_pb2_grpc.GenerationServiceStub(channel)
        list(stub.Generate(request, timeout=60))  # (no traceparent: a trace of its own)
        responses = list(stub.Generate(request, timeout=60, metadata=(
            ("traceparent", f"00-{trace_id}-{'b' * 16}-01"),)))
    assert responses[-1].usage.completion_tokens == 5
    spans = receiver.trace(trace_id, {"pagedserve.v1.GenerationService/Generate",
                                      "worker.forward", "scheduler.finish"})
    ingress = _one(spans, "pagedserve.v1.GenerationService/Generate", "pagedserve-router")
    assert ingress.parent_span_id.hex() == "b" * 16
    assert _attrs(ingress)["rpc.method"] == "Generate"
    assert _check_engine_spans(spans, ingress) >= 96  # 6 of the prompt's 7 full blocks
    # the first, without a traceparent, started a trace of its own (the router's span its root)
    roots = [s for _, s in receiver.spans if s.name == ingress.name and not s.parent_span_id]
    assert len(roots) == 1 and roots[0].trace_id.hex() != trace_id
    own = receiver.trace(roots[0].trace_id.hex(), {"scheduler.request", "worker.forward"})
    assert own["scheduler.request"][0][1].parent_span_id == roots[0].span_id
