"""What one ``Scheduler.schedule()`` call has decided so far (``StepPlan``), filled in by the
scheduling rule (``scheduler.py``) and by beam groups (``beam_scheduling.py``), then turned into
the step's ``ScheduledStep``."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

from services.common.step import CachedRequest
from services.scheduler.request import Request


@dataclass(slots=True)
class StepPlan:
    """One step's schedule as it is being built.

    Attributes:
        budget: tokens left of ``max_num_batched_tokens``.
        speculating: this step verifies drafts and asks for new ones (speculative decoding on
            and the batch under ``disable_by_batch_size``).
        lookahead: slots past each request's tokens for a draft model's own K/V (0 = none).
        num_scheduled: request_id -> tokens it computes this step, in schedule order.
        new_blocks: request_id -> block ids new to the workers, group by group.
        first_new_block: request_id -> the table index ``new_blocks`` start at, for a request
            whose table entries copy-on-write replaced (absent: appended).
        resumed: requests admitted again after a preemption (sent whole).
        blocks_to_copy: copy-on-write (src, dst) blocks every rank copies before the forward.
    """

    budget: int
    speculating: bool = False
    lookahead: int = 0
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    first_new_block: dict[str, int] = field(default_factory=dict)
    resumed: set[str] = field(default_factory=set)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)


def cached_request(request: Request, num_new: int, plan: StepPlan, send_tokens: bool,
                    drafts: list[int]) -> CachedRequest:
    """The diff of a request the workers hold: whole when resumed (or a forked beam, whose
    KV is new), else its new tokens (``send_tokens``: for the stages that do not sample;
    ``StepInput.for_rank`` is what a sampling rank gets) and blocks, verifying ``drafts``."""
    request_id = request.request_id
    if request_id in plan.resumed or request.resend:
        request.resend = False
        return CachedRequest(request_id, request.all_token_ids,
                             list(chain.from_iterable(request.block_ids)), True,
                             request.num_computed_tokens, num_new)
    beam = request.beam_group is not None  # (the scheduler picks its tokens)
    first = plan.first_new_block.get(request_id, -1)
    if request.trimmed_to >= 0:  # (blocks freed after rejected drafts)
        first, request.trimmed_to = request.trimmed_to, -1
    sent, num_prompt = request.num_tokens_sent, len(request.prompt_token_ids)
    new_tokens = ([] if not (send_tokens or beam) else
                  request.output_token_ids[sent - num_prompt:] if sent >= num_prompt
                  else request.token_ids_from(sent))
    return CachedRequest(request_id, new_tokens, plan.new_blocks[request_id], False,
                         request.num_computed_tokens, num_new, first, drafts, beam)
