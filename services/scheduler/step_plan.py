"""What one ``Scheduler.schedule()`` call has decided so far (``StepPlan``), filled in by the
scheduling rule (``scheduler.py``) and by beam groups (``beam_scheduling.py``), then turned into
the step's ``ScheduledStep``."""

from __future__ import annotations

from dataclasses import dataclass, field


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
