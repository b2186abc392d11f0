"""When ``pagedserve serve`` restarts a crashed service, and what it exports about it.

- ``RestartPolicy``: one per service. Each crash is recorded; the restart waits
  ``base_delay * 2 ** (k - 1)`` seconds (capped at ``max_delay``), k = the crashes within the last
  ``window`` seconds, so a service that stayed up for a window starts again at ``base_delay``.
  The ``max_restarts + 1``-th crash within one window gives up (``max_restarts`` 0: the first).
  The same rule as systemd's ``StartLimitBurst`` / ``StartLimitIntervalSec``.
- ``ServeMetrics``: serve's own Prometheus registry, with
  ``pagedserve:service_restarts_total{service}``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

DEFAULT_MAX_RESTARTS = 5
DEFAULT_RESTART_WINDOW = 60.0  # seconds
BASE_DELAY, MAX_DELAY = 1.0, 30.0  # seconds: the first restart's backoff, and its cap


class RestartPolicy:
    """Exponential backoff with a crash limit per time window, for one service.

    Args:
        max_restarts: restarts allowed within ``window`` (0 = never restart).
        window: seconds over which crashes are counted.
        base_delay, max_delay: seconds before the first restart, and the most ever waited.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, max_restarts: int = DEFAULT_MAX_RESTARTS,
                 window: float = DEFAULT_RESTART_WINDOW, base_delay: float = BASE_DELAY,
                 max_delay: float = MAX_DELAY, clock: Callable[[], float] = time.monotonic):
        if max_restarts < 0 or window <= 0 or base_delay < 0 or max_delay < base_delay:
            raise ValueError("RestartPolicy: need max_restarts >= 0, window > 0 and "
                             "0 <= base_delay <= max_delay")
        self.max_restarts = max_restarts
        self.window = window
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._clock = clock
        self._crashes: deque[float] = deque()

    @property
    def recent_crashes(self) -> int:
        """Crashes within the last ``window`` seconds."""
        self._forget_old(self._clock())
        return len(self._crashes)

    def on_crash(self) -> float | None:
        """Record a crash now. Returns the seconds to wait before restarting, or ``None`` when
        this crash exceeds ``max_restarts`` within ``window`` (give up)."""
        now = self._clock()
        self._forget_old(now)
        self._crashes.append(now)
        attempt = len(self._crashes)
        if attempt > self.max_restarts:
            return None
        return min(self.max_delay, self.base_delay * 2 ** (attempt - 1))

    def _forget_old(self, now: float) -> None:
        while self._crashes and self._crashes[0] <= now - self.window:
            self._crashes.popleft()


class ServeMetrics:
    """``pagedserve serve``'s own metrics (its children export theirs on their own ports)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._restarts = Counter("pagedserve:service_restarts",
                                 "Times pagedserve serve restarted a service that exited.",
                                 ["service"], registry=self.registry)
        for name in ("worker", "scheduler", "router"):  # 0 from the start: rate() needs a base
            self._restarts.labels(service=name)

    def restarted(self, service: str) -> None:
        """Count one restart of ``service`` (worker, scheduler or router)."""
        self._restarts.labels(service=service).inc()
