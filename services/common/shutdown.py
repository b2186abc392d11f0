"""Graceful shutdown, shared by the three services.

On SIGTERM (or SIGINT, or the ``stop`` event of ``serve()``) a service:

1. reports gRPC health NOT_SERVING at once (overall "" and its service names);
2. refuses new work with UNAVAILABLE (``SHUTTING_DOWN``): the router new Generate/Chat calls
   and HTTP requests (503), the scheduler new submits;
3. lets the work in flight finish, for at most ``--shutdown-timeout`` seconds; what still runs
   then ends with UNAVAILABLE (``TIMED_OUT``), never silently;
4. stops its servers and returns, so the process exits 0.

The worker has no requests of its own: it keeps executing steps while a scheduler's step
stream is open, and stops once none is (its scheduler drained) or at the timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from services.common.config import add_flag, float_in
from services.common.grpc_utils import set_serving

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 30.0  # seconds; helm's terminationGracePeriodSeconds leaves room above it
SHUTTING_DOWN = "server is shutting down; retry on another replica"
TIMED_OUT = "server shutting down: request still running at the end of --shutdown-timeout"


def add_shutdown_flags(p: argparse.ArgumentParser) -> None:
    """``--shutdown-timeout`` (env ``PAGEDSERVE_SHUTDOWN_TIMEOUT``), shared by every service
    and so passed by ``pagedserve serve`` to each of them."""
    add_flag(p, "--shutdown-timeout", type=float_in(0), default=DEFAULT_TIMEOUT,
             help="seconds that requests in flight get to finish after SIGTERM; those still "
                  "running then end with UNAVAILABLE (0: end them at once)")


class InFlight:
    """Counts the work in progress (requests, or a worker's step streams) and says whether new
    work is still admitted.

    ``draining`` turns True once with ``begin_drain()`` and stays so.
    """

    def __init__(self) -> None:
        self.draining = False
        self._count = 0
        self._idle: asyncio.Event | None = None  # made lazily: on the serving loop

    @property
    def count(self) -> int:
        """How many ``track()`` blocks are open now."""
        return self._count

    def begin_drain(self) -> None:
        """Admit no new work from now on (``draining`` becomes True)."""
        self.draining = True

    @contextlib.contextmanager
    def track(self):
        """Count the enclosed block as work in flight (whether or not draining)."""
        self._count += 1
        try:
            yield
        finally:
            self._count -= 1
            if self._count == 0 and self._idle is not None:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no work is in flight, at most ``timeout`` seconds.

        Returns:
            True when idle, False at the timeout.
        """
        if self._count == 0:
            return True
        self._idle = self._idle or asyncio.Event()
        self._idle.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return self._count == 0
        return True


async def wait_until(done: Callable[[], bool], timeout: float, poll: float = 0.02) -> bool:
    """Poll ``done()`` every ``poll`` seconds for at most ``timeout`` seconds.

    Returns:
        True once ``done()`` is true, False at the timeout.
    """
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(poll)
    return True


async def drain(name: str, health, services: list[str], timeout: float,
                begin: Callable[[], None], wait_idle: Callable[[float], Awaitable[bool]],
                on_timeout: Callable[[], Awaitable[None] | None] | None = None) -> bool:
    """Run steps 1-3 of the module note for service ``name``.

    Args:
        health: the service's grpc HealthServicer; set NOT_SERVING ("" and ``services``) first.
        timeout: seconds (>= 0) the work in flight gets to finish.
        begin: called right after health changed, to refuse new work from then on.
        wait_idle: ``wait_idle(seconds)`` -> True once nothing is in flight, False at the
            timeout.
        on_timeout: called (and awaited if it returns an awaitable) when work is still in
            flight at the timeout, to end it with an explicit error.

    Returns:
        True when everything finished within the timeout.
    """
    await set_serving(health, False, services)
    begin()
    log.info("%s shutting down: draining requests in flight (at most %gs)", name, timeout)
    t0 = time.monotonic()
    if await wait_idle(timeout):
        log.info("%s drained in %.2fs", name, time.monotonic() - t0)
        return True
    log.warning("%s: --shutdown-timeout (%gs) reached with work still in flight; ending it "
                "with UNAVAILABLE", name, timeout)
    if on_timeout is not None:
        result = on_timeout()
        if result is not None:
            await result
    return False
