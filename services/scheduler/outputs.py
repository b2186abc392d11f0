"""What the scheduler hands on after ``schedule()`` and ``update_from_output()``.

``SchedulerOutput`` (one step, with ``NewRequestData`` and ``CachedRequestData`` per request)
goes to every worker rank through ``worker_client.py``; ``RequestUpdate`` (a request's new
tokens or its end) goes to the routers through ``engine.py``. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.beam_search import BeamHypothesis
from services.scheduler.logprobs import PromptLogprobs, TokenLogprobs
from services.scheduler.request import EngineSamplingParams, FinishReason, Request


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has never seen, sent in full once."""

    request_id: str
    prompt_token_ids: list[int]  # all_token_ids at first schedule (what the worker must hold)
    sampling_params: EngineSamplingParams
    block_ids: list[int]  # the whole block tables, concatenated group by group (-1 = none)
    num_computed_tokens: int  # tokens already cached (0 until prefix caching); compute from here


@dataclass(slots=True)
class CachedRequestData:
    """A request the worker already holds: only what changed since it last saw it."""

    request_id: str
    # since last sent (for the pipeline stages that do not sample; [] mid-prefill and with
    # async scheduling); when resumed, the whole token list (replaces the worker's)
    new_token_ids: list[int]
    # appended to each table this step (the same count per group), concatenated group by
    # group; the whole tables if resumed
    new_block_ids: list[int]
    resumed_from_preemption: bool  # the worker must replace (not extend) table and tokens
    num_computed_tokens: int  # tokens whose K/V are cached; this step computes from here
    # the table index new_block_ids are written from (copy-on-write replaced the entry there
    # and after, or blocks only rejected drafts used were freed from there); -1 = appended
    first_new_block: int = -1
    beam: bool = False  # a beam: the scheduler picked new_token_ids, every rank gets them
    # speculative decoding: the drafts this step verifies after the request's last token
    # (num_scheduled_tokens = 1 + len); not part of its tokens until accepted
    spec_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """One engine step, sent to every worker rank."""

    step_id: int  # increases by one per schedule() call
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request_id -> tokens computed this step
    total_num_scheduled_tokens: int  # sum of num_scheduled_tokens, <= max_num_batched_tokens
    finished_req_ids: set[str]  # finished/aborted since the last step: worker drops their state
    # copy-on-write: (src, dst) blocks every rank copies before this step's forward
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # speculative decoding: drafts the driver proposes after this step per sampled request
    num_speculative_tokens: int = 0
    # NOTE: the ones below stay in the scheduler (update_from_output reads them); not sent.
    # request_id -> its epoch when scheduled: a result from before a preemption (or for an
    # earlier request of the same id) is stale.
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
