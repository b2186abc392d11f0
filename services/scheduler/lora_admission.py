"""Which LoRA adapters may run together: at most ``max_loras`` distinct adapters among the
running requests of a step (the workers hold that many active slots), without starving an
adapter that has few requests behind a busy one.

The rule (vLLM's, plus a bound): admission walks the waiting queue in policy order; a request
whose adapter is already running (or was admitted this step), or that has no adapter, or
whose adapter still has a free slot, is admitted as usual; one whose adapter would be one too
many is passed over, keeping its place in line, and the walk goes on behind it. Each request
counts the steps it was passed over; once one has been passed over ``max_lora_skips`` times,
nothing behind it is admitted any more, so the running adapters drain (their requests
finish) until a slot frees and it runs. Requests of the base model take no slot.

Cost: O(running) per step to collect the running adapters, O(1) per admission decision.
"""

from __future__ import annotations

from services.scheduler.request import Request
from services.scheduler.waiting_queue import WaitingQueue


class LoRAAdmission:
    """Per-step adapter bookkeeping of ``Scheduler._admit_waiting``.

    Args:
        max_loras: distinct adapters allowed among the running requests.
        max_lora_skips: steps a request may be passed over (``Request.num_lora_skips``).
    """

    def __init__(self, max_loras: int, max_lora_skips: int) -> None:
        self.max_loras = max_loras
        self.max_lora_skips = max_lora_skips
        self._active: set[int] = set()
        self._skipped: list[Request] = []

    def begin(self, running: list[Request]) -> LoRAAdmission:
        """Start a step's admission (returns itself): the adapters of the running requests
        hold their slots."""
        self._active = {r.lora.lora_id for r in running if r.lora is not None}
        self._skipped = []
        return self

    def fits(self, request: Request) -> bool:
        """Whether ``request`` may be admitted now as far as adapters go."""
        lora = request.lora
        return (lora is None or lora.lora_id in self._active
                or len(self._active) < self.max_loras)

    def next_request(self, waiting: WaitingQueue) -> Request | None:
        """The next waiting request to try (left on the queue: the caller pops it when it
        admits it), passing over (taking off the queue until ``end``) those whose adapter has
        no slot; None when the queue is exhausted, or a request has been passed over
        ``max_lora_skips`` times (nothing behind it may be admitted)."""
        while waiting:
            request = waiting.peek()
            if self.fits(request):
                return request
            self._skipped.append(waiting.pop())
            request.num_lora_skips += 1
            if request.num_lora_skips > self.max_lora_skips:
                return None
        return None

    def admitted(self, request: Request) -> None:
        """``request`` was admitted: its adapter holds a slot from now on."""
        if request.lora is not None:
            self._active.add(request.lora.lora_id)

    def end(self, waiting: WaitingQueue) -> None:
        """End the step's admission: the passed-over requests go back to their places in
        line."""
        skipped, self._skipped = self._skipped, []
        for request in reversed(skipped):  # (each to the front under fcfs: original order)
            waiting.add(request, preempted=True)
