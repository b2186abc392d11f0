"""One engine step and its result: the only types that cross the scheduler↔worker boundary.

The scheduler builds a ``StepInput`` per step (``Scheduler.schedule``), every worker rank runs
its view of it (``StepInput.for_rank``: what a rank that samples is told differs) with
``ModelRunner.execute_step``, and the driver answers a ``StepOutput``. ``step_wire.py`` maps
both to worker.proto (one encoder and one decoder each way, encoding only); in-process users
(tests, benchmarks) pass the very same objects, through the same ``for_rank``. A request is
sent in full once (``NewRequest``), then only as diffs (``CachedRequest``):
docs/architecture.md, "The step protocol". Torch-free.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace

from services.common.lora import LoRARequest
from services.common.sampling_params import EngineSamplingParams


@dataclass(slots=True)
class NewRequest:
    """A request the worker has not seen (or has dropped), sent in full once."""

    request_id: str
    prompt_token_ids: list[int]  # every token the worker must hold (prompt + any output so far)
    sampling_params: EngineSamplingParams  # as the router validated them
    block_ids: list[int]  # the block tables, one per KV cache group, concatenated group by
    # group (n each), in logical order; -1 = no block (before a sliding window)
    num_computed_tokens: int  # tokens whose K/V are already in the cache (e.g. a prefix hit)
    num_scheduled_tokens: int  # tokens to compute this step
    lora: LoRARequest | None = None  # the adapter it runs with (lora_id engine-wide); None:
    # the base model alone


@dataclass(slots=True)
class CachedRequest:
    """A request the worker already holds: what changed since the previous step."""

    request_id: str
    # since last sent, appended to the token list: sent only under pipeline parallelism, for
    # the stages that do not sample (a rank that samples gets them only for a beam:
    # ``StepInput.for_rank``), and for a beam; when resumed, the whole token list (replaces
    # the worker's)
    new_token_ids: list[int]
    new_block_ids: list[int]  # appended to the block tables (k per KV cache group, group by
    # group), or the whole tables if resumed; -1 = no block
    resumed_from_preemption: bool  # True: new_block_ids and new_token_ids REPLACE table and list
    num_computed_tokens: int  # tokens whose K/V are cached; this step computes from here
    num_scheduled_tokens: int
    # the table index new_block_ids are written from in every group (replacing the entries from
    # there: copy-on-write gave the request a copy of its last block, or the blocks only
    # rejected drafts used were freed); -1 = appended. Ignored when resumed.
    first_new_block: int = -1
    # speculative decoding: the d draft tokens this step verifies (num_scheduled_tokens is then
    # 1 + d: the last token of the list and the drafts after it); never part of the token list
    # until the step accepts them
    spec_token_ids: list[int] = field(default_factory=list)
    # a beam: the scheduler picked new_token_ids, so the ranks that sample get them too
    beam: bool = False


@dataclass(frozen=True, slots=True)
class KVTransfer:
    """One block moved between the KV cache and the KV tier on disk: block ``block_id`` of KV
    cache group ``group`` and the tier's file of prefix key ``key`` (16 bytes,
    ``scheduler/prefix_keys.py``)."""

    block_id: int
    group: int
    key: bytes


@dataclass(slots=True)
class StepInput:
    """One engine step for every rank. Requests are computed in the order new_requests, then
    cached_requests."""

    step_id: int  # increases by one per schedule() call; echoed in the StepOutput
    new_requests: list[NewRequest]
    cached_requests: list[CachedRequest]
    finished_request_ids: Collection[str]  # dropped before anything else in this step
    # copy-on-write (src, dst) block ids: copied in every layer, in order, before the forward
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # speculative decoding: draft tokens the driver proposes after this step per request that
    # got a token (StepOutput.draft_token_ids); 0 = none
    num_speculative_tokens: int = 0
    # KV tier on disk: blocks every rank writes to the tier after this step's forward (except
    # those of requests it left out), and blocks it starts reading from the tier (reported in
    # a later StepOutput's kv_loads_done / kv_loads_failed)
    kv_stores: list[KVTransfer] = field(default_factory=list)
    kv_loads: list[KVTransfer] = field(default_factory=list)
    # tracing: request id -> W3C traceparent (the scheduler's span of its prefill chunk in this
    # step), for the traced requests with a prefill chunk here: each rank records their
    # forward as a span, child of it (services/worker/tracing.py); {} = none
    traceparents: dict[str, str] = field(default_factory=dict)

    def for_rank(self, samples: bool) -> StepInput:
        """The step as a rank sees it: a rank that ``samples`` (the last pipeline stage) has
        appended its own samples, so it gets ``new_token_ids`` only for resumed requests and
        beams (the scheduler picks a beam's tokens); any other rank gets every new token id.
        Returns ``self`` when nothing differs (no copy)."""
        if not samples or not any(c.new_token_ids and not (c.resumed_from_preemption or c.beam)
                                  for c in self.cached_requests):
            return self
        cached = [c if c.resumed_from_preemption or c.beam or not c.new_token_ids else
                  replace(c, new_token_ids=[]) for c in self.cached_requests]
        return replace(self, cached_requests=cached)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """Request id -> tokens computed this step, in compute order."""
        n = {r.request_id: r.num_scheduled_tokens for r in self.new_requests}
        n.update((c.request_id, c.num_scheduled_tokens) for c in self.cached_requests)
        return n

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens computed this step (at most the scheduler's max_num_batched_tokens)."""
        return (sum(r.num_scheduled_tokens for r in self.new_requests)
                + sum(r.num_scheduled_tokens for r in self.cached_requests))


@dataclass(slots=True)
class SampledLogprobs:
    """Columnar logprobs of one step (the StepResult's layout; see worker.proto).

    ``num_top_logprobs[i]`` is k for sampled token i of the StepOutput (``sampled_token_ids``,
    so one per request unless a request accepted drafts), or -1 when its request asked for
    none; ``sampled_logprobs`` has one float (natural log) per token with k >= 0, in order;
    ``top_token_ids`` / ``top_logprobs`` hold k entries per such token, most likely first.
    """

    num_top_logprobs: list[int]
    sampled_logprobs: list[float]
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class Logprobs:
    """The raw logprobs (natural logs) of consecutive tokens of one request: a prompt chunk's
    (``StepOutput.prompt_logprobs``, passed on to the router as is) or a step's new tokens
    (``RequestUpdate.logprobs``).

    Token ``start + j`` (``j < len(logprobs)``; a prompt index, or an output token's index in
    the whole token list) has logprob ``logprobs[j]`` given the tokens before it;
    ``top_token_ids`` / ``top_logprobs`` hold ``k`` pairs per token, most likely first.
    Prompt position 0 is never scored.
    """

    request_id: str
    start: int
    logprobs: list[float]
    top_token_ids: list[int]
    top_logprobs: list[float]

    @property
    def k(self) -> int:
        """Top pairs per token."""
        return len(self.top_token_ids) // max(1, len(self.logprobs))

    def from_position(self, position: int) -> Logprobs | None:
        """The part from token ``position`` on (None if nothing is left): a chunk recomputed
        after a preemption repeats tokens the router already has."""
        skip = max(0, position - self.start)
        if skip >= len(self.logprobs):
            return None
        if skip == 0:
            return self
        k = self.k
        return Logprobs(self.request_id, self.start + skip, self.logprobs[skip:],
                        self.top_token_ids[skip * k:], self.top_logprobs[skip * k:])


@dataclass(slots=True)
class StepOutput:
    """The sampled tokens (a pooling runner: the pooled vectors) of the requests whose chunk
    reached the end of their token list (the driver's; every other rank answers an empty one
    with the same step_id)."""

    step_id: int
    request_ids: list[str]
    # the new tokens of each request, concatenated: one each, or (speculative decoding) its
    # accepted drafts and then the token sampled after them
    sampled_token_ids: list[int]
    logprobs: SampledLogprobs | None = None  # None when no request of the step asked
    prompt_logprobs: list[Logprobs] = field(default_factory=list)  # chunks scored
    # per request, how many of sampled_token_ids are its (1 + accepted drafts); None = one each
    num_sampled_token_ids: list[int] | None = None
    # per request (parallel to request_ids), the drafts proposed to follow its new tokens
    # (StepInput.num_speculative_tokens > 0; [] where none); None = no proposals this step
    draft_token_ids: list[list[int]] | None = None
    # pooling runner: per request (parallel to request_ids: those whose chunk computed their
    # last prompt token), its pooled vector, float32; sampled_token_ids is then empty. None
    # under the generate runner.
    embeddings: list[list[float]] | None = None
    # requests the step left out because they cannot run (a LoRA adapter the worker could not
    # load), every rank the same ones, and why (aligned, naming the adapter and the problem):
    # the scheduler ends them with that error; the worker ignores them until they finish
    failed_request_ids: list[str] = field(default_factory=list)
    failed_messages: list[str] = field(default_factory=list)
    # constrained requests whose grammar broke this step (the driver's, once each), and why
    # (aligned, naming the constraint kind and llguidance's error): still in request_ids with
    # the token that broke it, which the scheduler does not output; it ends them with INTERNAL
    broken_request_ids: list[str] = field(default_factory=list)
    broken_messages: list[str] = field(default_factory=list)
    # KV tier: block ids of the loads finished (data in the cache before this step's forward)
    # and failed (contents undefined). From one rank over the wire; ``WorkerGroup.receive``
    # reports a block once every rank has (failed if any rank failed).
    kv_loads_done: list[int] = field(default_factory=list)
    kv_loads_failed: list[int] = field(default_factory=list)
