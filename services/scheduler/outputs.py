"""What the scheduler hands on after ``schedule()`` and ``update_from_output()``.

``ScheduledStep`` (one step: ``services/common/step.py``'s ``StepInput`` and the scheduler's
bookkeeping of it) goes to every worker rank through ``worker_client.py`` (each rank its
``StepInput.for_rank`` view); ``RequestUpdate`` (a
request's new tokens or its end) goes to the routers through ``engine.py``. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.step import Logprobs, StepInput
from services.scheduler.beam_search import BeamHypothesis
from services.scheduler.request import FinishReason, Request


@dataclass(slots=True)
class ScheduledStep(StepInput):
    """One engine step as the scheduler keeps it until ``update_from_output``: the
    ``StepInput`` every rank gets (its view: ``for_rank``), plus bookkeeping that is never
    sent. (vLLM's ``SchedulerOutput`` is what the workers receive: our StepInput.)
    The drafts a step verifies are its CachedRequests' ``spec_token_ids``, nowhere else."""

    # request_id -> its epoch when scheduled, in schedule order: a result from before a
    # preemption (or for an earlier request of the same id) is stale
    epochs: dict[str, int] = field(default_factory=dict)
    sampled_req_ids: set[str] = field(default_factory=set)  # chunks that reach the end: a token
    applied: bool = False  # update_from_output has consumed it


@dataclass(slots=True)
class RequestUpdate:
    """What a router needs about one request after a step: its new tokens, or its end."""

    request_id: str
    new_token_ids: list[int]  # [] when only finishing (abort)
    finish_reason: FinishReason | None  # None while still running
    num_prompt_tokens: int
    num_output_tokens: int  # after this update
    num_cached_tokens: int  # prefix-cache hit at first schedule (0 if never scheduled)
    logprobs: Logprobs | None = None  # of new_token_ids (aligned), when asked
    prompt_logprobs: Logprobs | None = None  # prompt tokens scored by this step's chunk
    beams: list[BeamHypothesis] | None = None  # a beam search's result, on its final update
    embedding: list[float] | None = None  # a pooling request's vector, on its final update


def request_update(
    request: Request, new_token_ids: list[int], reason: FinishReason | None,
    logprobs: Logprobs | None = None, prompt_logprobs: Logprobs | None = None,
) -> RequestUpdate:
    """The RequestUpdate of ``request`` as it is now: ``new_token_ids`` appended (or none),
    finished with ``reason`` (or None while running)."""
    return RequestUpdate(
        request.request_id, new_token_ids, reason,
        request.num_prompt_tokens, request.num_output_tokens, max(request.num_cached_tokens, 0),
        logprobs, prompt_logprobs,
    )
