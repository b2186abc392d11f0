"""The scheduler's waiting queue, in policy order: who is admitted next.

- ``fcfs``: arrival order. A preempted request goes back to the FRONT: it arrived before every
  request still waiting (victims are the latest-arrived RUNNING requests), so that is its place.
- ``priority``: ordered by ``(priority, arrival)``, lower first, as in vLLM. A preempted request
  re-enters with its original key, so it keeps its place in line.

Both also track the tokens left to compute of everything queued (for load shedding).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from services.scheduler.request import Request


def policy_key(request: Request, policy: str) -> tuple[int, int]:
    """Sort key of ``request`` under ``policy``: smaller = admitted sooner, preempted later."""
    if policy == "priority":
        return request.priority, request.arrival_seq
    return 0, request.arrival_seq


class WaitingQueue:
    """Requests waiting for admission, in ``policy`` order.

    Args:
        policy: ``"fcfs"`` or ``"priority"``.

    Cost: O(1) (fcfs) or O(log n) (priority) per push/pop; ``remove`` is O(n).
    """

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[tuple[int, int], Request]] = []
        self.num_tokens = 0  # sum of num_tokens - num_computed_tokens over queued requests

    def __len__(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fifo)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Request]:
        """In admission order (O(n log n) under priority)."""
        if self.policy == "priority":
            return iter([r for _, r in sorted(self._heap, key=lambda e: e[0])])
        return iter(self._fifo)

    def add(self, request: Request, preempted: bool = False) -> None:
        """Queue a new arrival (at the back under fcfs), or a ``preempted`` request at its place
        in line (the front under fcfs; its original key under priority)."""
        self.num_tokens += request.num_tokens - request.num_computed_tokens
        if self.policy == "priority":
            heapq.heappush(self._heap, (policy_key(request, "priority"), request))
        elif preempted:
            self._fifo.appendleft(request)
        else:
            self._fifo.append(request)

    def peek(self) -> Request:
        """The next request to admit. Raises IndexError when empty."""
        return self._heap[0][1] if self.policy == "priority" else self._fifo[0]

    def pop(self) -> Request:
        """Remove and return the next request to admit. Raises IndexError when empty."""
        request = heapq.heappop(self._heap)[1] if self.policy == "priority" else (
            self._fifo.popleft())
        self.num_tokens -= request.num_tokens - request.num_computed_tokens
        return request

    def remove(self, request: Request) -> None:
        """Remove a queued request (an abort). Raises ValueError if it is not queued."""
        if self.policy == "priority":
            index = next((i for i, (_, r) in enumerate(self._heap) if r is request), None)
            if index is None:
                raise ValueError(f"request {request.request_id} is not waiting")
            self._heap[index] = self._heap[-1]
            self._heap.pop()
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(request)
        self.num_tokens -= request.num_tokens - request.num_computed_tokens
