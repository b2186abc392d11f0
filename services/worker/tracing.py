"""The worker's spans: one per traced request per step that carries it (a prefill chunk; the
scheduler names them in ``StepInput.traceparents``), the step's forward on this rank, child
of the scheduler's chunk span (services/scheduler/tracing.py).

Recorded after the step from two timestamps taken around it, never inside the forward; a step
that names no traced request costs the servicer a falsy check.
"""

from __future__ import annotations

from services.common import tracing
from services.common.step import StepInput


def record_step(step: StepInput, start_ns: int, end_ns: int, rank: int) -> None:
    """Record ``worker.forward`` for each traced request of ``step`` (``time.time_ns()``
    bounds of the step on this rank): the request's tokens in the step, the step's requests
    and total tokens. Does nothing while tracing is off here."""
    tracer = tracing.tracer()
    if tracer is None:
        return
    tokens = step.num_scheduled_tokens
    common = {"pagedserve.step.id": step.step_id, "pagedserve.worker.rank": rank,
              "pagedserve.step.num_requests": len(tokens),
              "pagedserve.step.num_tokens": step.total_num_scheduled_tokens}
    for request_id, traceparent in step.traceparents.items():
        span = tracer.start_span("worker.forward", context=tracing.context_from(traceparent),
                                 start_time=start_ns,
                                 attributes={**common, tracing.GEN_AI_RESPONSE_ID: request_id,
                                             "pagedserve.chunk.tokens": tokens.get(request_id,
                                                                                   0)})
        span.end(end_time=end_ns)
