"""services/common/tracing.py: set-up from the flag and the OTEL_* variables, off by default
(no provider), the W3C traceparent round trip; and the scheduler's and worker's spans of a
traced request (services/scheduler/tracing.py, services/worker/tracing.py) on an in-memory
exporter."""

from __future__ import annotations

import argparse

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import tracing
from services.common.finish_reason import FinishReason
from services.common.sampling_params import EngineSamplingParams
from services.common.step import CachedRequest, NewRequest
from services.scheduler.outputs import RequestUpdate, ScheduledStep
from services.scheduler.request import Request
from services.scheduler.tracing import request_tracer
from services.worker.tracing import record_step

CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACE_ID = int("0af7651916cd43dd8448eb211c80319c", 16)


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SDK_DISABLED",
                 "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                 "OTEL_EXPORTER_OTLP_PROTOCOL", "PAGEDSERVE_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    yield
    tracing.shutdown()


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    assert tracing.setup(None, "pagedserve-test", exporter=exporter)

    def finished():
        assert tracing.force_flush()
        return {s.name: s for s in exporter.get_finished_spans()}, exporter.get_finished_spans()
    return finished


def test_off_by_default_no_provider_and_no_traceparent():
    assert not tracing.setup(None, "pagedserve-router")
    assert tracing.tracer() is None and tracing._provider is None
    assert tracing.current_traceparent() == ""
    assert request_tracer() is None


@pytest.mark.parametrize("env", ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                                 "OTEL_EXPORTER_OTLP_ENDPOINT"])
def test_the_standard_variables_turn_it_on_and_name_the_service(monkeypatch, env):
    monkeypatch.setenv(env, "http://127.0.0.1:9")
    assert tracing.setup(None, "pagedserve-scheduler")
    assert tracing._provider.resource.attributes["service.name"] == "pagedserve-scheduler"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "mine")
    assert tracing.setup(None, "pagedserve-scheduler")
    assert tracing._provider.resource.attributes["service.name"] == "mine"
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.setup(None, "pagedserve-scheduler") and tracing.tracer() is None


def test_the_flag_wins_and_none_exporter_turns_it_off(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://10.0.0.1:4317")
    assert tracing.traces_endpoint("http://127.0.0.1:4317") == "http://127.0.0.1:4317"
    assert tracing.setup("http://127.0.0.1:4317", "pagedserve-worker")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.traces_endpoint("http://127.0.0.1:4317") is None


def test_only_the_grpc_protocol_is_accepted(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    with pytest.raises(ValueError, match=r"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL.*grpc"):
        tracing.setup("http://127.0.0.1:4317", "pagedserve-router")


def test_the_flag_is_checked_and_read_from_its_variable(monkeypatch):
    p = argparse.ArgumentParser()
    tracing.add_tracing_flags(p)
    assert p.parse_args([]).otlp_traces_endpoint is None
    for good in ("http://127.0.0.1:4317", "https://collector:4317", "collector:4317"):
        assert p.parse_args(["--otlp-traces-endpoint", good]).otlp_traces_endpoint == good
    for bad in ("ftp://x:1", "http://nohost", "collector", "http://:4317"):
        with pytest.raises(argparse.ArgumentTypeError, match="OTLP/gRPC endpoint"):
            tracing.endpoint_flag(bad)
    monkeypatch.setenv("PAGEDSERVE_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:4318")
    p = argparse.ArgumentParser()
    tracing.add_tracing_flags(p)
    assert p.parse_args([]).otlp_traces_endpoint == "http://127.0.0.1:4318"


def test_traceparent_round_trip(spans):
    tracer = tracing.tracer()
    span = tracer.start_span("child", context=tracing.context_from(CLIENT))
    tp = tracing.traceparent_of(span)
    span.end()
    ctx = span.get_span_context()
    assert ctx.trace_id == TRACE_ID and span.parent.span_id == int("b7ad6b7169203331", 16)
    assert tp == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-01"
    with trace.use_span(span):
        assert tracing.current_traceparent() == tp
    fresh = tracer.start_span("new", context=tracing.context_from("not-a-traceparent"))
    assert fresh.parent is None and fresh.get_span_context().trace_id != TRACE_ID
    fresh.end()


def _step(step_id: int, new=(), cached=()) -> ScheduledStep:
    return ScheduledStep(step_id, list(new), list(cached), [])


def test_scheduler_and_worker_spans_of_one_request(spans):
    """Two prefill chunks (a 3-token prefix hit), the first token, two decode steps, finish:
    the span set, its parent links, and that only the prefill steps name the request."""
    tracer = request_tracer()
    req = Request("r1", list(range(10)), EngineSamplingParams(max_tokens=3))
    tracer.submitted(req, CLIENT)
    untraced = Request("r2", [1, 2], EngineSamplingParams())
    new = NewRequest("r1", req.prompt_token_ids, req.sampling_params, [0, 1], 3, 4)
    steps = [_step(1, [new, NewRequest("r2", [1, 2], untraced.sampling_params, [2], 0, 2)]),
             _step(2, cached=[CachedRequest("r1", [], [], False, 7, 3)]),
             _step(3, cached=[CachedRequest("r1", [], [], False, 10, 1)]),
             _step(4, cached=[CachedRequest("r1", [], [], False, 11, 1)])]
    tokens = [[], [5], [6], [7]]
    for i, (step, new_tokens) in enumerate(zip(steps, tokens, strict=True)):
        tracer.scheduled(step)
        assert set(step.traceparents) == ({"r1"} if i < 2 else set())
        if step.traceparents:
            record_step(step, 1, 2, rank=0)
        tracer.step_done(step)
        n = len(req.output_token_ids) + len(new_tokens)
        req.output_token_ids += new_tokens
        tracer.observe_updates([RequestUpdate("r1", new_tokens, FinishReason.LENGTH if n == 3
                                              else None, 10, n, 3)])
    assert not tracer.active
    by_name, all_spans = spans()
    names = sorted(s.name for s in all_spans)
    assert names == sorted(["scheduler.request", "scheduler.queue", "scheduler.prefill_chunk",
                            "scheduler.prefill_chunk", "worker.forward", "worker.forward",
                            "scheduler.first_token", "scheduler.decode", "scheduler.finish"])
    root = by_name["scheduler.request"]
    assert {s.context.trace_id for s in all_spans} == {TRACE_ID}
    assert root.parent.span_id == int("b7ad6b7169203331", 16)
    chunks = [s for s in all_spans if s.name == "scheduler.prefill_chunk"]
    for s in all_spans:
        if s.name.startswith("scheduler.") and s is not root:
            assert s.parent.span_id == root.context.span_id, s.name
    forwards = [s for s in all_spans if s.name == "worker.forward"]
    assert {f.parent.span_id for f in forwards} == {c.context.span_id for c in chunks}
    assert [(c.attributes["pagedserve.chunk.tokens"], c.attributes["pagedserve.chunk.start"],
             c.attributes["pagedserve.prefix_cache.hit_tokens"]) for c in
            sorted(chunks, key=lambda c: c.attributes["pagedserve.chunk.index"])] == [
        (4, 3, 3), (3, 7, 3)]
    first = next(f for f in forwards if f.attributes["pagedserve.step.id"] == 1)
    assert first.attributes["pagedserve.step.num_requests"] == 2
    assert first.attributes["pagedserve.step.num_tokens"] == 6
    assert first.attributes["pagedserve.chunk.tokens"] == 4
    assert by_name["scheduler.decode"].attributes["pagedserve.decode.steps"] == 2
    assert by_name["scheduler.decode"].attributes["pagedserve.decode.output_tokens"] == 3
    finish = by_name["scheduler.finish"].attributes
    assert finish["gen_ai.response.finish_reasons"] == ("length",)
    assert (finish["gen_ai.usage.input_tokens"], finish["gen_ai.usage.output_tokens"],
            finish["gen_ai.usage.cache_read.input_tokens"]) == (10, 3, 3)


def test_an_abort_mid_prefill_ends_every_span_and_an_unsampled_parent_is_not_traced(spans):
    tracer = request_tracer()
    req = Request("r1", list(range(8)), EngineSamplingParams())
    tracer.submitted(req, CLIENT)
    tracer.submitted(Request("r2", [1], EngineSamplingParams()), CLIENT[:-2] + "00")
    step = _step(1, [NewRequest("r1", req.prompt_token_ids, req.sampling_params, [0], 0, 4)])
    tracer.scheduled(step)
    tracer.observe_updates([RequestUpdate("r1", [], FinishReason.ABORT, 8, 0, 0)])
    tracer.step_done(step)  # (the aborted request's step comes back later)
    assert not tracer.active
    by_name, all_spans = spans()
    assert sorted(by_name) == ["scheduler.finish", "scheduler.prefill_chunk",
                               "scheduler.queue", "scheduler.request"]
    assert len(all_spans) == 4
    assert by_name["scheduler.request"].attributes["gen_ai.response.finish_reasons"] == (
        "abort",)
