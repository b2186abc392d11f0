"""The requests one scheduler holds, and the transitions both of its parts make.

``Scheduler`` (``scheduler.py``, the scheduling rule) and ``BeamScheduler``
(``beam_scheduling.py``, beam groups) share one ``SchedulerState``: the unfinished requests by
id, the waiting queue, the running list in policy order, the epoch counter, and the two
transitions that free a request's blocks, preemption by recompute and finishing.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from services.scheduler.block_manager import BlockManager
from services.scheduler.request import FinishReason, Request, RequestStatus
from services.scheduler.waiting_queue import WaitingQueue


class SchedulerState:
    """Unfinished requests (waiting + running) and their shared transitions.

    ``running`` is sorted by ``key`` (arrival under fcfs, (priority, arrival) under priority),
    so the preemption victim is always its tail; ``waiting`` uses the same order.

    Args:
        block_manager: the KV blocks the requests hold.
        scheduling_policy: ``"fcfs"`` or ``"priority"``.
    """

    def __init__(self, block_manager: BlockManager, scheduling_policy: str) -> None:
        self.block_manager = block_manager
        self.requests: dict[str, Request] = {}  # unfinished (waiting + running) by id
        self.waiting = WaitingQueue(scheduling_policy)
        self.running: list[Request] = []  # sorted by key
        self.key: Callable[[Request], int | tuple[int, int]] = (
            (lambda r: (r.priority, r.arrival_seq)) if scheduling_policy == "priority"
            else (lambda r: r.arrival_seq))
        self.finished_req_ids: set[str] = set()  # for the next ScheduledStep
        self.num_preemptions_total = 0
        self._num_epochs = 0

    def new_epoch(self) -> int:
        """A fresh epoch (one per admission, preemption and fork): a step's result for a
        request whose epoch changed since it was scheduled is stale."""
        self._num_epochs += 1
        return self._num_epochs

    def add_running(self, request: Request) -> None:
        """Put ``request`` into ``running`` at its place in policy order."""
        bisect.insort(self.running, request, key=self.key)

    def preempt(self, request: Request) -> None:
        """Recompute preemption: drop the KV (cached blocks stay cached, so the recompute may
        hit them), keep the tokens, back in line at its place. The caller has taken it out of
        ``running``."""
        self.block_manager.free(request)
        request.num_computed_tokens = request.num_output_placeholders = 0
        request.spec_token_ids = []
        request.trimmed_to = -1  # (a resume sends the whole tables)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        request.epoch = self.new_epoch()
        self.num_preemptions_total += 1
        self.waiting.add(request, preempted=True)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Free blocks, set the final status; tell the workers if they ever saw it. The caller
        takes it out of ``requests`` and ``running`` or ``waiting``."""
        self.block_manager.free(request)
        request.finish(reason)
        # NOTE: num_tokens_sent > 0 <=> the request was in some ScheduledStep (prompts are
        # non-empty); workers hold state only for those.
        if request.num_tokens_sent > 0:
            self.finished_req_ids.add(request.request_id)
