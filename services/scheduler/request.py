"""One generation request as the scheduler sees it: token ids, block ids, counters.

The scheduler never touches text or tensors. A request is its prompt token ids, the token ids
sampled so far, the KV block table that holds their keys/values, and a few counters that drive
the scheduling rule (docs/architecture.md, "The scheduling rule").

Index arithmetic (positions are token indices into ``all_token_ids``)::

    index:          0    1    2    3    4    5    6    7    8    9
    all_token_ids: [p0   p1   p2   p3   p4   p5 | o0   o1   o2   o3]
                   |<-- num_prompt_tokens = 6 ->|<-- num_output -->|
                   |<----- num_computed_tokens = 7 ---->|<- 3 --->|
                   |<------------------ num_tokens = 10 ---------->|

    num_computed_tokens   tokens whose K/V are in the cache or being computed by a step in
                          flight (counted when scheduled; here a request that was preempted
                          and is recomputing prompt + output: 7 of 10 done).
    num_scheduled_tokens  tokens computed in one step (chosen by the Scheduler):
                          min(num_tokens - num_computed_tokens, token budget left).
    sampling              the worker samples a next token only when the step's chunk reaches
                          the end: num_computed_tokens + num_scheduled_tokens == num_tokens.
    blocks                every block table (one per KV cache group, ``block_ids[g]``) must
                          cover num_computed_tokens + num_scheduled_tokens slots:
                          ceil(that / block_size) blocks; slot of token i in group g is
                          block_ids[g][i // block_size] * block_size + i % block_size
                          (-1 = a sliding window's released block, see block_manager.py).

In steady-state decode num_computed_tokens == num_tokens - 1 (the last sampled token is the one
to feed) before a step, and == num_tokens while that step is in flight (nothing more to schedule
until its token arrives); during a prefill it lags further behind.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from services.common.finish_reason import FinishReason
from services.common.lora import LoRARequest
from services.common.sampling_params import EngineSamplingParams
from services.scheduler.beam_search import BeamGroup


class RequestStatus(enum.Enum):
    """Lifecycle: WAITING -> RUNNING (<-> PREEMPTED -> RUNNING ...) -> FINISHED (why: the
    request's ``finish_reason``)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # back in the waiting queue, blocks freed, must recompute
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class Request:
    """A request's scheduling state. Identity-compared (``eq=False``) and hashable.

    Only the Scheduler mutates a Request after ``add_request``; ``prompt_token_ids`` and
    ``output_token_ids`` are append-only from its point of view.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: EngineSamplingParams = field(default_factory=EngineSamplingParams)
    arrival_time: float = field(default_factory=time.monotonic)  # seconds, time.monotonic()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # one block table per KV cache group, logical order, all of one length; [] = no blocks
    block_ids: list[list[int]] = field(default_factory=list)
    num_tokens_sent: int = 0  # prefix of all_token_ids already sent (0: never scheduled)
    num_output_placeholders: int = 0  # async scheduling: tokens sampled in steps in flight
    num_preemptions: int = 0
    epoch: int = 0  # unique per admission and per preemption (set by the Scheduler): a step's
    # result for an older epoch (an earlier request with the same id, or before a preemption)
    # is stale
    finish_reason: FinishReason | None = None
    priority: int = 0  # lower runs sooner under the priority policy (as in vLLM)
    arrival_seq: int = 0  # order of add_request (set by the Scheduler; breaks arrival ties)
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule, in tokens; -1 = not yet
    block_hashes: list[bytes] = field(default_factory=list)  # prefix key of each full block
    num_cached_blocks: int = 0  # leading full blocks of block_ids already registered (or, with
    # prefix caching off, already full): the prefix cache's and the scheduler's bookmark
    extra_keys: bytes = b""  # what else the K/V depends on (hashed into every block key)
    parent_request_id: str = ""  # set on the choices of an n > 1 request: they share blocks
    prompt_logprobs_next: int = 1  # next prompt index whose logprob goes to the router
    beam_group: BeamGroup[Request] | None = None  # the beam search this request is a beam of
    resend: bool = False  # (a beam forked onto another's KV) send its tokens and tables whole
    spec_token_ids: list[int] = field(default_factory=list)  # speculative decoding: drafts the
    # worker proposed to follow its tokens, for the next decode step to verify
    trimmed_to: int = -1  # blocks freed after rejected drafts: the tables' length the workers
    # must cut theirs to (the next step's first_new_block); -1 = none pending
    lora: LoRARequest | None = None  # the LoRA adapter it runs with (lora_id engine-wide, see
    # engine.py); None: the base model. Part of every block key (prefix_keys.py).
    num_lora_skips: int = 0  # steps admission passed it over: its adapter had no slot
    kv_loads_pending: int = 0  # KV tier loads its prefix hit waits for (kv_tier.py): it runs
    # only when none is left
    kv_load_failed: bool = False  # one of them failed: it looks its prefix up again
    num_tier_hit_tokens: int = 0  # of its prefix hit, tokens the KV tier supplies
    kv_loaded_blocks: list[int] = field(default_factory=list)  # its hit's blocks loaded so far

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are still unsent: no prefix-cache hit."""
        return (self.sampling_params.prompt_logprobs is not None
                and self.prompt_logprobs_next < len(self.prompt_token_ids))

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output as a new list (O(num_tokens); prefer ``token_ids_from`` for diffs)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_from(self, start: int) -> list[int]:
        """``all_token_ids[start:]`` in O(num_tokens - start), without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt :]
        return self.prompt_token_ids[start:] + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` in O(end - start)."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    def finish(self, reason: FinishReason) -> None:
        """Set ``status`` and ``finish_reason`` together (they must always agree)."""
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
