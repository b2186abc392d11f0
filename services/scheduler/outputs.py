"""What the scheduler hands on after ``schedule()`` and ``update_from_output()``.

``SchedulerOutput`` (one step: ``services/common/step.py``'s ``StepInput`` and the scheduler's
bookkeeping of it) goes to every worker rank through ``worker_client.py``; ``RequestUpdate`` (a
request's new tokens or its end) goes to the routers through ``engine.py``. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.step import StepInput
from services.scheduler.beam_search import BeamHypothesis
from services.scheduler.logprobs import PromptLogprobs, TokenLogprobs
from services.scheduler.request import FinishReason, Request


@dataclass(slots=True)
class SchedulerOutput(StepInput):
    """One engine step as the scheduler keeps it until ``update_from_output``: the
    ``StepInput`` every rank gets, plus bookkeeping that is never sent."""

    # request_id -> its epoch when scheduled, in schedule order: a result from before a
    # preemption (or for an earlier request of the same id) is stale
    epochs: dict[str, int] = field(default_factory=dict)
    sampled_req_ids: set[str] = field(default_factory=set)  # chunks that reach the end: a token
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # drafts verified
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
    logprobs: list[TokenLogprobs] | None = None  # of new_token_ids (aligned), when asked
    prompt_logprobs: PromptLogprobs | None = None  # prompt tokens scored by this step's chunk
    beams: list[BeamHypothesis] | None = None  # a beam search's result, on its final update
    embedding: list[float] | None = None  # a pooling request's vector, on its final update


def request_update(
    request: Request, new_token_ids: list[int], reason: FinishReason | None,
    logprobs: list[TokenLogprobs] | None = None, prompt_logprobs: PromptLogprobs | None = None,
) -> RequestUpdate:
    """The RequestUpdate of ``request`` as it is now: ``new_token_ids`` appended (or none),
    finished with ``reason`` (or None while running)."""
    return RequestUpdate(
        request.request_id, new_token_ids, reason,
        request.num_prompt_tokens, request.num_output_tokens, max(request.num_cached_tokens, 0),
        logprobs, prompt_logprobs,
    )
