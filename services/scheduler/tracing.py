"""The scheduler's spans of a traced request (one whose ``SubmitRequest.traceparent`` is set).

Per request, children of the router's span (the traceparent), with explicit start and end
times (``time.time_ns()``):

- ``scheduler.request`` — arrival to finish, the parent of all below; on it the usage
  (``gen_ai.usage.*``, ``gen_ai.usage.cache_read.input_tokens`` = the prefix-cache hit) and
  ``gen_ai.response.finish_reasons``.
- ``scheduler.queue`` — arrival to the first step that schedules it.
- ``scheduler.prefill_chunk`` — one per prefill chunk (also the recompute after a
  preemption): sent to the result back; its tokens, its index, where it starts and the
  admission's prefix-cache hit tokens. The step carries its traceparent to every rank
  (``StepInput.traceparents``), whose forward is its child (services/worker/tracing.py). Only
  prefill steps carry one: decode steps cost nothing on the wire.
- ``scheduler.first_token`` — arrival to the step result that brought the first token (so its
  duration is the scheduler's time to first token); a span, not an event, so that it has one.
- ``scheduler.decode`` — the first token to the finish, a summary: output tokens, decode steps,
  preemptions.
- ``scheduler.finish`` — the finish itself (reason, usage), at its end.

The engine calls ``submitted`` / ``scheduled`` / ``step_done`` / ``observe_updates`` only while
tracing is on (``request_tracer()`` is None when off), and the last three only while a traced
request is in flight (``active``): an untraced request costs a falsy check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.util.types import AttributeValue

from services.common import tracing as t
from services.scheduler.outputs import RequestUpdate, ScheduledStep
from services.scheduler.request import Request


@dataclass(slots=True)
class _Traced:
    """One traced request's spans and counters."""

    request: Request
    span: trace.Span  # scheduler.request
    context: Context  # with ``span`` current: the parent of the others
    arrival_ns: int
    queued: bool = True  # not scheduled yet (the queue span not recorded)
    prefill_end: int = 0  # position where this admission's prefill ends (its tokens then)
    hit_tokens: int = 0  # this admission's prefix-cache hit
    num_chunks: int = 0
    chunks: dict[int, trace.Span] = field(default_factory=dict)  # step id -> open chunk span
    first_token_ns: int = 0
    decode_steps: int = 0


class RequestTracer:
    """The spans of the traced requests of one engine (see the module docstring)."""

    def __init__(self, tracer: trace.Tracer):
        self._tracer = tracer
        self._traced: dict[str, _Traced] = {}

    @property
    def active(self) -> bool:
        """Some traced request is in flight."""
        return bool(self._traced)

    def submitted(self, request: Request, traceparent: str) -> None:
        """A request was queued with this W3C traceparent (the router's span); one whose
        parent is not sampled is not traced here either."""
        now = time.time_ns()
        attributes: dict[str, AttributeValue] = {
            t.GEN_AI_RESPONSE_ID: request.request_id,
            t.GEN_AI_USAGE_INPUT_TOKENS: request.num_prompt_tokens,
            "pagedserve.priority": request.priority}
        if request.sampling_params.max_tokens is not None:
            attributes[t.GEN_AI_REQUEST_MAX_TOKENS] = request.sampling_params.max_tokens
        span = self._tracer.start_span("scheduler.request", context=t.context_from(traceparent),
                                       start_time=now, attributes=attributes)
        if span.is_recording():
            self._traced[request.request_id] = _Traced(
                request, span, trace.set_span_in_context(span), now)

    def scheduled(self, step: ScheduledStep) -> None:
        """A step was built: open a chunk span for each traced request with a prefill chunk
        in it, and name them in ``step.traceparents`` for the workers."""
        now = time.time_ns()
        for r in step.new_requests:
            tr = self._traced.get(r.request_id)
            if tr is not None:
                tr.prefill_end, tr.hit_tokens = len(r.prompt_token_ids), r.num_computed_tokens
                self._chunk(step, tr, r.num_computed_tokens, r.num_scheduled_tokens, now)
        for c in step.cached_requests:
            tr = self._traced.get(c.request_id)
            if tr is None:
                continue
            if c.resumed_from_preemption:  # new_token_ids: the whole token list
                tr.prefill_end, tr.hit_tokens = len(c.new_token_ids), c.num_computed_tokens
            if c.num_computed_tokens < tr.prefill_end:
                self._chunk(step, tr, c.num_computed_tokens, c.num_scheduled_tokens, now)

    def _chunk(self, step: ScheduledStep, tr: _Traced, start: int, tokens: int,
               now: int) -> None:
        if tr.queued:
            tr.queued = False
            self._tracer.start_span("scheduler.queue", context=tr.context,
                                    start_time=tr.arrival_ns).end(end_time=now)
        span = self._tracer.start_span(
            "scheduler.prefill_chunk", context=tr.context, start_time=now,
            attributes={"pagedserve.chunk.index": tr.num_chunks,
                        "pagedserve.chunk.start": start, "pagedserve.chunk.tokens": tokens,
                        "pagedserve.prefix_cache.hit_tokens": tr.hit_tokens,
                        "pagedserve.step.id": step.step_id,
                        "pagedserve.step.num_requests": (len(step.new_requests)
                                                         + len(step.cached_requests))})
        tr.num_chunks += 1
        tr.chunks[step.step_id] = span
        step.traceparents[tr.request.request_id] = t.traceparent_of(span)

    def step_done(self, step: ScheduledStep) -> None:
        """The result of ``step`` is back: its chunk spans end."""
        now = time.time_ns()
        for rid in step.traceparents:
            tr = self._traced.get(rid)
            span = tr.chunks.pop(step.step_id, None) if tr is not None else None
            if span is not None:
                span.end(end_time=now)

    def observe_updates(self, updates: list[RequestUpdate]) -> None:
        """The updates of a step (or an abort): the first token, decode steps, the finish."""
        now = time.time_ns()
        for u in updates:
            tr = self._traced.get(u.request_id)
            if tr is None:
                continue
            if u.new_token_ids:
                if tr.first_token_ns:
                    tr.decode_steps += 1
                else:
                    tr.first_token_ns = now
                    self._tracer.start_span(
                        "scheduler.first_token", context=tr.context, start_time=tr.arrival_ns,
                        attributes={"pagedserve.time_to_first_token_s":
                                    (now - tr.arrival_ns) / 1e9}).end(end_time=now)
            if u.finish_reason is not None:
                self._finish(tr, u, now)

    def _finish(self, tr: _Traced, u: RequestUpdate, now: int) -> None:
        del self._traced[u.request_id]
        for span in tr.chunks.values():  # (ended before its chunk came back: an abort)
            span.end(end_time=now)
        usage: dict[str, AttributeValue] = {
            t.GEN_AI_RESPONSE_FINISH_REASONS: (str(u.finish_reason),),
            t.GEN_AI_USAGE_INPUT_TOKENS: u.num_prompt_tokens,
            t.GEN_AI_USAGE_OUTPUT_TOKENS: u.num_output_tokens,
            t.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: u.num_cached_tokens}
        if tr.first_token_ns:
            self._tracer.start_span(
                "scheduler.decode", context=tr.context, start_time=tr.first_token_ns,
                attributes={"pagedserve.decode.output_tokens": u.num_output_tokens,
                            "pagedserve.decode.steps": tr.decode_steps,
                            "pagedserve.num_preemptions": tr.request.num_preemptions}
            ).end(end_time=now)
        self._tracer.start_span("scheduler.finish", context=tr.context, start_time=now,
                                attributes=usage).end()
        tr.span.set_attributes(usage)
        tr.span.set_attribute("pagedserve.num_preemptions", tr.request.num_preemptions)
        tr.span.end()


def request_tracer() -> RequestTracer | None:
    """The engine's tracer of requests, or None while tracing is off in this process."""
    tracer = t.tracer()
    return None if tracer is None else RequestTracer(tracer)
